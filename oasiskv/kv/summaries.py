"""Compressed keys: per block and KV head, the elementwise min and max of its post-RoPE keys."""

import torch


def summarize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [..., Hkv, n, B, d] (n whole blocks) -> kmin, kmax, each [..., n, Hkv, d]."""
    return keys.amin(dim=-2).transpose(-3, -2), keys.amax(dim=-2).transpose(-3, -2)


def round_outward(kmin: torch.Tensor, kmax: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """kmin, kmax in `dtype`, kmin rounded down and kmax up where `dtype` is coarser, so that
    the summary still bounds every key of its block (Quest's score stays an upper bound)."""
    lo, hi = kmin.to(dtype), kmax.to(dtype)
    if torch.finfo(dtype).eps <= torch.finfo(kmin.dtype).eps:
        return lo, hi
    lo = torch.where(lo.to(kmin.dtype) > kmin, torch.nextafter(lo, lo.new_tensor(-torch.inf)),
                     lo)
    hi = torch.where(hi.to(kmax.dtype) < kmax, torch.nextafter(hi, hi.new_tensor(torch.inf)),
                     hi)
    return lo, hi


def quantize_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 key copy: keys [..., Hkv, n, B, d] -> codes [..., n, Hkv, B, d] (int8) and
    scales [..., n, Hkv] (float32), one scale per block and KV head: its largest |key| / 127,
    so that codes * scale is within scale / 2 of every key (rounded to nearest)."""
    keys = keys.float()
    scales = keys.abs().amax(dim=(-2, -1)) / 127  # [..., Hkv, n]
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block
    codes = torch.round(keys / safe[..., None, None]).clamp_(-127, 127).to(torch.int8)
    return codes.transpose(-4, -3), scales.transpose(-2, -1)


def dequantize_keys(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., B, d] (int8), scales [...] -> float32 keys [..., B, d]."""
    return codes.float() * scales[..., None, None]
