"""Compressed keys: per block and KV head, the elementwise min and max of its post-RoPE keys."""

import torch


def summarize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [Hkv, n, B, d] (n whole blocks) -> kmin, kmax, each [n, Hkv, d]."""
    return keys.amin(dim=2).transpose(0, 1), keys.amax(dim=2).transpose(0, 1)
