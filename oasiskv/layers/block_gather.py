"""The block-head gather into the slab: the selected (layer, KV head, block) K/V from the host
tier into their slab slots, B token rows each. On CUDA, with the host tier pinned (or on the
device), one Triton launch (`triton_kernels/gather.py`) reads them in place; elsewhere the
PyTorch indexing below (the kernel's reference) does.
"""

from __future__ import annotations

import torch

from oasiskv.layers import triton_kernels


def gather_block_heads_torch(device_kv: torch.Tensor, host_kv: torch.Tensor,
                             layers: torch.Tensor, heads: torch.Tensor, src: torch.Tensor,
                             dst: torch.Tensor, block_size: int) -> None:
    """The reference: device_kv[l, :, h, t:t+B] = host_kv[l, :, h, s:s+B] for each item
    (l, h, s, t) of layers/heads/src/dst [n] (token slots)."""
    host, dev = host_kv.device, device_kv.device
    arange_b = torch.arange(block_size, device=host)
    ls, hs, s, t = (x.to(host) for x in (layers, heads, src, dst))
    rows = host_kv[ls[:, None], :, hs[:, None], s[:, None] + arange_b]  # [n, B, 2, d]
    device_kv[ls[:, None].to(dev), :, hs[:, None].to(dev), (t[:, None] + arange_b).to(dev)] = \
        rows.to(dev)


def triton_serves(device_kv: torch.Tensor, host_kv: torch.Tensor) -> bool:
    """The GPU can read the host tier in place: CUDA device, host tier pinned or on the GPU."""
    return device_kv.device.type == "cuda" and (host_kv.is_cuda or host_kv.is_pinned())


def gather_block_heads(device_kv: torch.Tensor, host_kv: torch.Tensor, layers: torch.Tensor,
                       heads: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                       block_size: int) -> None:
    """device_kv [L, 2, Hkv, device slots, d], host_kv [L, 2, Hkv, host slots, d]; for each i,
    K and V of layer layers[i], KV head heads[i], token slots src[i]..src[i]+B-1 of the host
    go to token slots dst[i].. of the device (int64 [n] each, on either device)."""
    if not len(layers):
        return
    kernels = triton_kernels.load("gather") if triton_serves(device_kv, host_kv) else None
    if kernels is None:
        gather_block_heads_torch(device_kv, host_kv, layers, heads, src, dst, block_size)
        return
    items = torch.stack([layers, heads, src, dst], 1).to(device_kv.device, torch.int64)  # [n, 4]
    kernels.gather(device_kv, host_kv, items, block_size)
