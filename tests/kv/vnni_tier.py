"""What the rerank kernel's avx512vnni tier computes (`layers/csrc/block_mass.cpp`), for the
tests that compare it with a reference: which inputs take it, and the query it multiplies."""

import torch

from oasiskv.kv import block_mass


def int16_rounded(q: torch.Tensor) -> torch.Tensor:
    """q as the avx512vnni tier multiplies it: each head [..., d] scaled so that its largest
    |element| is 16384 (less where d * 128 * 16384 would pass 2^31), rounded to integers (half
    to even, as nearbyint), scaled back; float32 steps as the kernel's."""
    d = q.shape[-1]
    top = torch.tensor(min(16384.0, float((2**31 - 1) // (d * 128))))
    m = q.abs().amax(-1, keepdim=True)
    return torch.round(q * (top / m)) * (m / top)


def vnni_runs(isa: str, codes: torch.Tensor, d: int) -> bool:
    """Whether the kernel takes the avx512vnni tier's integer products for these inputs."""
    return isa == "avx512vnni" and codes.dtype == torch.int8 and codes.shape[-1] == 16 \
        and d % 2 == 0


def kernel_runs_vnni(codes: torch.Tensor, d: int) -> bool:
    """Whether the rerank's kernel, at the instruction set it picks by default, takes the
    avx512vnni tier for these codes (False where the kernel is not available)."""
    ext = block_mass.extension()
    return ext is not None and vnni_runs(ext.isas()[0], codes, d)


VNNI_TOLERANCE = {"rtol": 1e-2, "atol": 1e-4}  # q rounded to int16: within 1 % of q's mass


def tolerance(vnni: bool, rtol: float, atol: float) -> dict[str, float]:
    """assert_close's tolerances: the given ones, or the VNNI tier's."""
    return VNNI_TOLERANCE if vnni else {"rtol": rtol, "atol": atol}
