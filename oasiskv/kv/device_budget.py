"""How an engine spends `device_kv_budget`: every byte of it is one of the device's KV tensors.

Dense: KV blocks only. Sparse: KV blocks for the requests' slabs (K+2 blocks each) and block
summaries (kmin/kmax of one block in every layer, summary_splits pairs of them, where
selections bound blocks by them: not with rerank=inf or the oracle; and with
rerank_source=int8 the block's int8 key copy) for their histories, tensors whose sizes add up
to at most the budget. With
dense_layers=N the slabs, summaries and key copy cover the other layers only, and each block of
a history also holds the N dense layers' K/V (`kv/dense_layers.py`), charged beside its
summary. The split
follows one request of the engine's longest context: its slab and its summaries in proportion,
so that such requests run out of both together;
summary ids beyond what the host tier can ever use (`summary_cap`) go to the slabs instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.config import ModelConfig


@dataclass(frozen=True)
class DeviceSplit:
    kv_blocks: int  # KV blocks (dense requests' blocks, or sparse slabs)
    summary_ids: int  # block summaries allocated (0 in dense mode)
    summary_room: int  # summary ids the budget has room for beside the slabs, before the cap
    block_bytes: int  # one KV block, every layer, K and V
    summary_bytes: int  # one block's kmin and kmax, every sparse layer and sub-block (and its
    # int8 key copy, and with dense_layers the dense layers' K/V of the block)

    @property
    def allocated(self) -> int:
        return self.kv_blocks * self.block_bytes + self.summary_ids * self.summary_bytes


def summary_bytes(mc: ModelConfig, dtype: torch.dtype, splits: int = 1) -> int:
    """Device bytes of one block's summary: kmin and kmax [L, splits, Hkv, d] in `dtype` (a
    pair per sub-block, summary_splits)."""
    return 2 * mc.num_layers * splits * mc.num_kv_heads * mc.head_dim * dtype.itemsize


def key_copy_bytes(mc: ModelConfig, block_size: int, bits: int = 8) -> int:
    """Device bytes of one block's key copy (rerank_source=int8 or int4): codes
    [L, Hkv, d, B] of `bits` bits and a float32 scale per layer and KV head. Charged with the
    block's summary."""
    return mc.num_layers * mc.num_kv_heads * (block_size * mc.head_dim * bits // 8 + 4)


def dense_layer_bytes(mc: ModelConfig, dense_layers: int, block_size: int,
                      dtype: torch.dtype) -> int:
    """Device bytes of one block's K and V in the first `dense_layers` layers (dense_layers):
    [N, 2, Hkv, B, d] in the KV dtype. Charged with the block's summary."""
    return dense_layers * 2 * mc.num_kv_heads * block_size * mc.head_dim * dtype.itemsize


def split_dense(budget: int, block_bytes: int) -> DeviceSplit:
    blocks = budget // block_bytes
    if blocks == 0:
        raise ValueError(f"device_kv_budget {budget} B leaves no room for one KV block "
                         f"({block_bytes} B)")
    return DeviceSplit(blocks, 0, 0, block_bytes, 0)


def split_sparse(budget: int, block_bytes: int, summary_size: int, slab_blocks: int,
                 request_blocks: int, summary_cap: int) -> DeviceSplit:
    """KV blocks and summary ids under `budget`: slabs of `slab_blocks` and summaries of
    `request_blocks` blocks (a request of the longest context) in proportion, at least one KV
    block; then at most `summary_cap` summaries, the rest of the budget as KV blocks."""
    if summary_size == 0:  # summaries that hold nothing on the device (the oracle's, rerank=inf
        # from host keys): as many ids as the host tier can use, the budget all slabs
        blocks = split_dense(budget, block_bytes).kv_blocks
        return DeviceSplit(blocks, summary_cap, summary_cap, block_bytes, 0)
    per_request = slab_blocks * block_bytes + request_blocks * summary_size
    kv = max(1, budget * slab_blocks // per_request)
    room = (budget - kv * block_bytes) // summary_size
    if room < 1:
        raise ValueError(f"device_kv_budget {budget} B leaves no room for one KV block "
                         f"({block_bytes} B) and one block summary ({summary_size} B)")
    ids = min(room, summary_cap)
    return DeviceSplit((budget - ids * summary_size) // block_bytes, ids, room, block_bytes,
                       summary_size)
