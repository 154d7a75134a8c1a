"""An engine's figures: its counters with the KV pools' occupancy (`LLMEngine.stats`), the
sparse tiers' traffic, the remote store's host caches, and the device memory the KV tensors
take against device_kv_budget (`device_memory`, also read by the server's metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine
    from oasiskv.engine.kv_tiers import KVTiers


def engine_stats(engine: LLMEngine) -> dict:
    """`LLMEngine.stats()`: counters, scheduler and pools (sparse: the tiers' counters)."""
    used = engine.pool.num_used
    block_bytes = engine.device_split.block_bytes  # sparse: a slab block, its sparse layers
    sparse = {}
    if engine.sparse is not None:
        engine.sparse.flush()  # count the jobs still in flight
        c = engine.sparse.counters
        sparse = {f"sparse_{k}": v for k, v in vars(c).items()}
        host, per_block = engine.host_pool, engine.bytes_per_block
        sparse.update(host_blocks_used=host.num_used, host_blocks_total=host.num_blocks,
                      host_bytes_held=host.num_used * per_block,
                      host_peak_bytes=host.peak_used * per_block,
                      slab_bytes=engine.config.cache.slab_blocks * block_bytes,
                      fetch_cap=engine.sparse.fetch_cap)
        if engine.remote is not None:
            sparse.update(host_cache_stats(engine))
    return {**engine.counters, **sparse,
            "preemptions": engine.scheduler.num_preemptions,
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "kv_blocks_used": used,
            "kv_blocks_total": engine.pool.num_blocks,
            "kv_bytes_held": used * block_bytes,
            "kv_peak_blocks": engine.pool.peak_used,
            "kv_peak_bytes": engine.pool.peak_used * block_bytes,
            "kv_bytes_per_block": block_bytes, **device_memory(engine)}


def host_cache_stats(engine: LLMEngine) -> dict:
    """Remote store traffic and, per running request with a host cache, its blocks on the
    decode host (fullest layer, generated blocks included), peak and budget."""
    c = engine.sparse.counters
    caches = {s.request_id: s.host_cache for s in engine.scheduler.running if s.host_cache}
    peak = max([engine.host_cache_peak] + [h.peak for h in caches.values()])
    prefix = engine.remote.prefix
    return {"remote_bytes": c.remote_bytes, "remote_put_bytes": c.remote_put_bytes,
            "prefix_put_bytes": c.prefix_put_bytes, "prefix_cache_bytes": prefix.bytes_held,
            "prefix_cache_evictions": prefix.evictions,
            "remote_blocks": c.remote_blocks, "host_evictions": c.host_evictions,
            "host_cache_peak_blocks": peak,
            "host_cache": {rid: {"blocks": h.resident(), "peak": h.peak,
                                 "budget": h.budget} for rid, h in caches.items()}}


def device_tensors(engine: LLMEngine | KVTiers) -> list[torch.Tensor]:
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


def device_memory(engine: LLMEngine) -> dict:
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
            rows = engine.sparse.kmin  # [L, ids * splits (none: rerank=inf), Hkv, d]
            row = rows.shape[0] * rows.shape[2] * rows.shape[3] * rows.element_size()
            out.update(summary_splits=splits, summary_minmax_bytes_per_block=2 * splits * (
                row if engine.config.cache.bounds else 0))
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
