"""The rerank's scoring over the key copy's codes on the CPU by a hand-written kernel
(`layers/csrc/block_mass.cpp`): what `rerank._fused_mass_codes` computes, about twice as
fast. SmolLM2-135M at 7K x 6 requests, K=128 (c=256, 142 MB of int8 codes a step), 2 threads
of a 2-core AMD EPYC (Zen 4), quiet machine (`scripts/bench_rerank.py --threads 2`): 12.4 ms
a step (AVX-512; AVX2 14.2) vs inductor's 25.8; 6.7-7.3 ms since the kernel prefetches 8
blocks ahead (was 2), and every block of the six (rerank=inf, 248 MB) 8.7-9.7 ms. The reads
from memory set its pace: with the codes in cache the same pass takes ~5.5 ms, and integer
products from bytes regrouped by vpermb (no widening) were no faster than the avx512vnni tier
below (measured, not kept).

Built and loaded as the decode-attention kernel is (`layers/decode_kernel.load`: cached on
disk, one binary for any x86-64, chosen by CPUID at run time); where it cannot be built or
loaded the rerank warns once and runs the compiled PyTorch path, the same results to
rounding. With AVX-512 VNNI (the avx512vnni tier, first where the CPU has it) int8 blocks of
16 tokens take integer products, each query head rounded to int16 (its largest element to
16384): the mass of that query, within ~1e-3 relative of the fp32 loops' on random data.
OASISKV_RERANK=compiled chooses the compiled path (no build); OASISKV_ATTENTION does not
switch this kernel: the two are separate choices."""

from __future__ import annotations

from types import ModuleType

import torch

from oasiskv.layers import decode_kernel

SOURCE = decode_kernel.SOURCE.with_name("block_mass.cpp")
ENV = "OASISKV_RERANK"
CHOICES = ("kernel", "compiled")
DEFAULT = "kernel"
ISA = ""  # the instruction set to run ("": the best this CPU has; tests pin others)


def extension() -> ModuleType | None:
    """The built kernel (None: OASISKV_RERANK=compiled, or it could not be built or loaded)."""
    if decode_kernel.choice(ENV, CHOICES, DEFAULT) != "kernel":
        return None
    return decode_kernel.load(SOURCE, "the rerank's block-mass kernel",
                              "reranking with the compiled PyTorch path")


def serves(codes: torch.Tensor) -> ModuleType | None:
    """The kernel where it scores these codes (CPU int8 or 4-bit pairs), else None."""
    if codes.device.type != "cpu" or codes.dtype not in (torch.int8, torch.uint8):
        return None
    return extension()


def candidate_mass_codes(ext: ModuleType, codes: torch.Tensor, rows: torch.Tensor,
                         block_scale: torch.Tensor, q: torch.Tensor,
                         real: torch.Tensor) -> torch.Tensor:
    """`rerank.candidate_mass_codes` by the kernel: codes [rows, d, B] (int8) or [rows, d,
    B/2] (4-bit pairs), rows, block_scale, real [..., c], q [..., G, d] -> [..., c]
    float32, -inf where not real."""
    lead, n = rows.shape[:-1], rows.shape[:-1].numel()

    def flat(t: torch.Tensor, dims: int) -> torch.Tensor:  # [..., *last dims] -> [N, *last]
        return t.reshape(n, *t.shape[t.dim() - dims:]).contiguous()

    mass = ext.block_mass(codes.contiguous(), flat(rows, 1), flat(block_scale.float(), 1),
                          flat(q.float(), 2), flat(real, 1), ISA)  # [N, c]
    return mass.view(*lead, rows.shape[-1])
