"""The decode linears in bfloat16 by a hand-written CPU kernel (`layers/csrc/gemv_bf16.cpp`):
y = x @ W^T (+ bias) for a few rows, on CPUs with AVX-512 BF16 (vdpbf16ps), summed in fp32
and rounded once to bf16 as oneDNN does. At 1-6 rows oneDNN's packed bf16 linear reads the
weights at ~15-20 GB/s; the kernel streams them once per call, every row's sums in registers:
SmolLM2-135M's step of linears (296 MB) 10.8 ms vs 16.3 at one row, 11.4 vs 15.0 at 6, 16.8 vs
21.9 at 16 (2-core Zen 4; batch-1 7K dense TPOT 33 -> 24-25 ms;
docs/results/2026-12-07-linear-kernel.md).

The weight is packed once at load (`pack`, from `Linear.pack`) into blocks of 16 output rows
with K in pairs, [Nb, Kp/2, 16, 2]: one vector is a pair of K for 16 outputs, so one
vdpbf16ps adds 16 outputs' partial sums (no horizontal reductions) and a block is read in
order. That copy is kept beside oneDNN's (prefill, more than MAX_ROWS rows, still uses it).

Built and loaded as the decode-attention kernel is (`decode_kernel.load`: cached on disk, one
binary for any x86-64, the kernel's function compiled for AVX-512 BF16 and run only where
CPUID has it). Where the CPU lacks AVX-512 BF16, or the build or load fails (warned once),
or OASISKV_LINEAR=onednn when the model is packed, `Linear` runs exactly as before (oneDNN's
packed weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from oasiskv.layers import decode_kernel

SOURCE = decode_kernel.SOURCE.with_name("gemv_bf16.cpp")
ENV = "OASISKV_LINEAR"
CHOICES = ("kernel", "onednn")
DEFAULT = "kernel"
MAX_ROWS = 16  # the kernel serves up to this many rows (more: oneDNN; scripts/bench_linear.py)
BLOCK = 16  # output rows a packed block interleaves (one vector of fp32 sums)


@dataclass
class Packed:
    weight: torch.Tensor  # [Nb, Kp/2, 16, 2] bf16
    bias: torch.Tensor | None  # [Nb * 16] float32
    n: int  # outputs
    k: int  # inputs (Kp: k rounded up to even)
    ext: ModuleType  # the loaded kernel


def extension() -> ModuleType | None:
    """The built kernel where this CPU runs it (None: OASISKV_LINEAR=onednn, no AVX-512 BF16,
    or it could not be built or loaded)."""
    if decode_kernel.choice(ENV, CHOICES, DEFAULT) != "kernel":
        return None
    ext = decode_kernel.load(SOURCE, "the bf16 linear kernel",
                             "running the linears with oneDNN")
    return ext if ext is not None and "avx512bf16" in ext.isas() else None


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> Packed | None:
    """The weight [N, K] in the kernel's layout, or None where the kernel does not serve it
    (not bf16 on the CPU, or no kernel here)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    ext = extension()
    if ext is None:
        return None
    n, k = weight.shape
    nb, kp = -(-n // BLOCK), k + k % 2
    w = F.pad(weight.detach(), (0, kp - k, 0, nb * BLOCK - n))  # [Nb*16, Kp], zeros past
    w = w.view(nb, BLOCK, kp // 2, 2).transpose(1, 2).contiguous()  # [Nb, Kp/2, 16, 2]
    b = None if bias is None else F.pad(bias.detach().float(), (0, nb * BLOCK - n))
    return Packed(w, b, n, k, ext)


def serves(packed: Packed | None, x: torch.Tensor) -> bool:
    """Whether the kernel computes this call: a packed weight, bf16 rows, at most MAX_ROWS."""
    return (packed is not None and x.dtype == torch.bfloat16
            and x.numel() <= MAX_ROWS * x.shape[-1] and not torch.is_grad_enabled())


def linear(packed: Packed, x: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N] bf16 by the kernel (packed from `pack`)."""
    rows = x.reshape(-1, packed.k)  # [M, K]
    if packed.k % 2:  # a zero column: the last pair's second value
        rows = F.pad(rows, (0, 1))
    out = packed.ext.gemv(rows.contiguous(), packed.weight, packed.bias, packed.n)  # [M, N]
    return out.view(*x.shape[:-1], packed.n)
