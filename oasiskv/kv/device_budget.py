"""How an engine spends `device_kv_budget`: every byte of it is one of the device's KV tensors.

Dense: KV blocks only. Sparse: KV blocks for the requests' slabs (K+2 blocks each) and block
summaries (kmin/kmax of one block in every layer, summary_splits pairs of them, and with
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
    per_request = slab_blocks * block_bytes + request_blocks * summary_size
    kv = max(1, budget * slab_blocks // per_request)
    room = (budget - kv * block_bytes) // summary_size
    if room < 1:
        raise ValueError(f"device_kv_budget {budget} B leaves no room for one KV block "
                         f"({block_bytes} B) and one block summary ({summary_size} B)")
    ids = min(room, summary_cap)
    return DeviceSplit((budget - ids * summary_size) // block_bytes, ids, room, block_bytes,
                       summary_size)


def device_tensors(engine) -> list[torch.Tensor]:
    """The device tensors the budget pays for: the KV block pool and, sparse, kmin and kmax
    (and the int8 key copy: codes and scales; the dense layers' K/V)."""
    tensors = [engine.runner.device_kv]
    if engine.runner.dense_kv is not None:
        tensors.append(engine.runner.dense_kv)
    if engine.sparse is not None:
        tensors += [engine.sparse.kmin, engine.sparse.kmax]
        if engine.sparse.key_codes is not None:
            tensors += [engine.sparse.key_codes, engine.sparse.key_scales]
    return tensors


def device_memory(engine) -> dict:
    """stats(): the device bytes allocated (the tensors themselves), those that running
    requests hold now, and the peak (sum of the KV and summary pools' own peaks)."""
    split, kv = engine.device_split, engine.kv
    ids = kv.summary_pool if kv.sparse else None
    used = kv.device.num_used * split.block_bytes
    peak = kv.device.peak_used * split.block_bytes
    if ids is not None:
        used += ids.num_used * split.summary_bytes
        peak += ids.peak_used * split.summary_bytes
    out = {"device_kv_budget": engine.config.cache.device_kv_budget,
           "device_bytes_allocated": sum(t.numel() * t.element_size()
                                         for t in device_tensors(engine)),
           "device_bytes_used": used, "device_peak_bytes": peak}
    if ids is not None:
        out.update(summary_ids_total=split.summary_ids, summary_ids_used=ids.num_used,
                   summary_ids_peak=ids.peak_used, summary_bytes_per_block=split.summary_bytes)
        splits = engine.config.cache.summary_splits
        if splits > 1:  # part of summary_bytes_per_block: kmin/kmax of every sub-block
            rows = engine.sparse.kmin  # [L, ids * splits, Hkv, d]
            out.update(summary_splits=splits, summary_minmax_bytes_per_block=2 * splits * (
                rows[:, 0].numel() * rows.element_size()))
        copy = [engine.sparse.key_codes, engine.sparse.key_scales]
        if copy[0] is not None:  # part of summary_bytes_per_block
            out.update(key_copy_bytes_per_block=sum(t[:, 0].numel() * t.element_size()
                                                    for t in copy),
                       key_copy_bytes=sum(t.numel() * t.element_size() for t in copy))
        dense = engine.runner.dense_kv  # [N, 2, Hkv, ids * B, d], part of it too
        if dense is not None:
            per_block = dense[:, :, :, :kv.device.block_size].numel() * dense.element_size()
            out.update(dense_layers=dense.shape[0], dense_layer_bytes_per_block=per_block,
                       dense_layer_bytes=dense.numel() * dense.element_size(),
                       dense_layer_bytes_used=ids.num_used * per_block)
    return out
