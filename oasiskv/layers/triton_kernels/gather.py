"""The block-head gather into the slab, in Triton: one program per (block-head, K or V) copies
a block of B token rows of one KV head from the host tier to its slab slot on the device. The
host tier is pinned memory, which the GPU reads in place through unified addressing (the
paper's gather), so one launch moves every selected block-head with no staging copy.
`layers/block_gather.py` calls it on CUDA and holds its PyTorch reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather(dst_ptr, d_ls, d_cs, d_hs, d_ss,  # [L, 2, Hkv, slots, d] the device KV
            src_ptr, s_ls, s_cs, s_hs, s_ss,  # [L, 2, Hkv, slots, d] the host KV
            items_ptr,  # [n, 4] int64: layer, KV head, first source slot, first target slot
            B, d, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # int64 offsets: a tier passes 2^31 elements
    c = tl.program_id(1).to(tl.int64)  # 0: K, 1: V
    layer = tl.load(items_ptr + i * 4)
    head = tl.load(items_ptr + i * 4 + 1)
    src = tl.load(items_ptr + i * 4 + 2)
    dst = tl.load(items_ptr + i * 4 + 3)
    t = tl.arange(0, BLOCK_B)
    dd = tl.arange(0, BLOCK_D)
    ok = (t < B)[:, None] & (dd < d)[None, :]
    x = tl.load(src_ptr + layer * s_ls + c * s_cs + head * s_hs + (src + t)[:, None] * s_ss
                + dd[None, :], mask=ok)
    tl.store(dst_ptr + layer * d_ls + c * d_cs + head * d_hs + (dst + t)[:, None] * d_ss
             + dd[None, :], x, mask=ok)


def gather(device_kv: torch.Tensor, host_kv: torch.Tensor, items: torch.Tensor,
           block_size: int) -> None:
    """device_kv/host_kv [L, 2, Hkv, slots, d] (last dim contiguous), items [n, 4] int64 on the
    device: copies host_kv[l, :, h, s:s+B] to device_kv[l, :, h, t:t+B] for each (l, h, s, t)."""
    if device_kv.stride(-1) != 1 or host_kv.stride(-1) != 1:
        raise ValueError("gather: the KV's last dim must be contiguous")
    n, d = items.shape[0], device_kv.shape[-1]
    if n == 0:
        return
    _gather[(n, 2)](device_kv, *device_kv.stride()[:4], host_kv, *host_kv.stride()[:4], items,
                    block_size, d, BLOCK_B=triton.next_power_of_2(block_size),
                    BLOCK_D=triton.next_power_of_2(d))
