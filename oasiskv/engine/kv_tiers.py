"""Building an engine's KV tiers: the device tensors (dense blocks, or sparse slabs, block
summaries, key copy and dense layers' K/V) that together take at most device_kv_budget bytes
(`kv/device_budget.py`), in sparse mode the host tier, the remote store under it and the
`SparseKV` that moves blocks between them, the runner over all of them, and the warm-ups that
compile the block scoring before the first request."""

from __future__ import annotations

import logging
import math
import time
import weakref
from dataclasses import dataclass

import torch

from oasiskv.config import CacheConfig, ModelConfig, parse_bytes
from oasiskv.engine.runner import ModelRunner, allocate_kv, pins_host_kv
from oasiskv.engine.stats import device_tensors
from oasiskv.kv import row_copy, select_kernel, summaries
from oasiskv.kv.blocks import BlockPool, KVAllocator
from oasiskv.kv.dense_layers import allocate_dense_kv, check_dense_layers, sparse_layers
from oasiskv.kv.device_budget import (
    DeviceSplit,
    dense_layer_bytes,
    key_copy_bytes,
    split_dense,
    split_sparse,
    summary_bytes,
)
from oasiskv.kv.prefix_cache import model_fingerprint
from oasiskv.kv.remote_tier import RemoteTier, open_store
from oasiskv.kv.rerank import warm_up_rerank
from oasiskv.kv.residency import SparseKV
from oasiskv.kv.scorers import warm_up_scores
from oasiskv.kv.summaries import warm_up_key_copy
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.prefetch.executor import make_executor
from oasiskv.prefetch.pipeline import PrefetchPipeline
from oasiskv.prefetch.trace import Tracer

log = logging.getLogger(__name__)


@dataclass
class KVTiers:
    bytes_per_block: int  # one block of every layer's K/V (a host block in sparse mode)
    device_split: DeviceSplit  # how device_kv_budget is shared out
    pool: BlockPool  # device blocks (sparse: the slabs' blocks)
    kv: KVAllocator
    runner: ModelRunner
    sparse: SparseKV | None = None  # sparse mode: working sets, summaries, host tier
    host_pool: BlockPool | None = None  # sparse mode: the host tier's blocks
    remote: RemoteTier | None = None  # sparse mode with a remote_store


def build_kv_tiers(owner: object, model: LlamaForCausalLM, cache: CacheConfig,
                   mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                   max_model_len: int) -> KVTiers:
    """The tiers of `cache` for `model`; their workers and store close when `owner` (the
    engine) is collected."""
    block = cache.block_size
    bytes_per_block = mc.kv_bytes_per_token(dtype) * block
    check_dense_layers(cache.dense_layers, mc)
    if cache.kv_mode == "dense":
        split = split_dense(cache.device_kv_budget, bytes_per_block)
        device_kv = allocate_kv(mc, split.kv_blocks, block, dtype, device)
        pool = BlockPool(split.kv_blocks, block)
        tiers = KVTiers(bytes_per_block, split, pool, KVAllocator(pool),
                        ModelRunner(model, device_kv, block))
    else:
        tiers = _build_sparse(owner, model, cache, mc, dtype, device, max_model_len,
                              bytes_per_block)
    if cache.prefault_kv:
        t0 = time.perf_counter()
        pools = device_tensors(tiers) + ([] if tiers.sparse is None else
                                         [tiers.runner.host_kv])
        for pool in pools:
            pool.zero_()
        log.info("prefaulted %.2f GiB of KV pools in %.1f s",
                 sum(p.numel() * p.element_size() for p in pools) / 2**30,
                 time.perf_counter() - t0)
    return tiers


def _build_sparse(owner: object, model: LlamaForCausalLM, cache: CacheConfig, mc: ModelConfig,
                  dtype: torch.dtype, device: torch.device, max_model_len: int,
                  bytes_per_block: int) -> KVTiers:
    block = cache.block_size
    host_blocks = cache.host_kv_budget // bytes_per_block
    if host_blocks == 0:
        raise ValueError(f"host_kv_budget {cache.host_kv_budget} B is smaller than one "
                         f"KV block ({bytes_per_block} B)")
    one_node = cache.remote_store == "none"
    summary_dtype = cache.summary_torch_dtype(dtype)
    n_dense = cache.dense_layers  # the slabs, summaries, key copy: the other layers'
    smc = sparse_layers(mc, n_dense)
    # Summary ids the host tier can use: one node, one per host block (its id); with a
    # remote store they outlive host blocks: enough for every request that host caches
    # at f_host could hold (a budget >= f_host * history).
    split = split_sparse(
        cache.device_kv_budget, smc.kv_bytes_per_token(dtype) * block,
        (summary_bytes(smc, summary_dtype, cache.summary_splits) if cache.bounds else 0)
        + (key_copy_bytes(smc, block, cache.key_copy_bits) if cache.key_copy else 0)
        + dense_layer_bytes(mc, n_dense, block, dtype),
        cache.slab_blocks, -(-max_model_len // block),
        host_blocks if one_node else math.ceil(host_blocks / cache.f_host))
    if one_node and split.summary_ids < host_blocks:
        log.info("host tier: %d of host_kv_budget's %d blocks, the most whose "
                 "summaries device_kv_budget holds beside the slabs",
                 split.summary_ids, host_blocks)
        host_blocks = split.summary_ids
    device_kv = allocate_kv(smc, split.kv_blocks, block, dtype, device)
    pool = BlockPool(split.kv_blocks, block)
    host_kv = allocate_kv(mc, host_blocks, block, dtype, pin=pins_host_kv(device))
    host_pool = BlockPool(host_blocks, block)
    remote = build_remote(owner, cache, mc, dtype, host_kv, model)
    kv = KVAllocator(pool, host_pool, slab_blocks=cache.slab_blocks,
                     summaries=None if remote is None else BlockPool(split.summary_ids, block),
                     summary_room=split.summary_room)
    summary = (smc.num_layers, split.summary_ids, mc.num_kv_heads, mc.head_dim)
    # kmin/kmax: no rows where no selection reads them (rerank=inf, oracle)
    rows = (smc.num_layers, split.summary_ids * cache.summary_splits if cache.bounds else 0,
            *summary[2:])
    executor = make_executor(cache.prefetch, device)
    weakref.finalize(owner, executor.close)  # no worker outlives the engine
    sparse = SparseKV(cache, device_kv, host_kv[n_dense:] if n_dense else host_kv,
                      torch.empty(rows, dtype=summary_dtype, device=device),
                      torch.empty(rows, dtype=summary_dtype, device=device),
                      PrefetchPipeline(executor), remote=remote,
                      scales=[a.scale for a in model.attention_layers()][n_dense:])
    if cache.key_copy:  # int4: two codes a byte
        bits = cache.key_copy_bits
        sparse.key_codes = torch.empty(
            (*summary[:3], mc.head_dim, block * bits // 8), device=device,
            dtype=torch.int8 if bits == 8 else torch.uint8)
        sparse.key_scales = torch.empty(summary[:3], device=device)
    dense_kv = allocate_dense_kv(mc, n_dense, split.summary_ids, block, dtype, device)
    runner = ModelRunner(model, device_kv, block, host_kv, sparse, dense_kv)
    warm_up(sparse, cache, mc)
    return KVTiers(bytes_per_block, split, pool, kv, runner, sparse, host_pool, remote)


def build_remote(owner: object, cache: CacheConfig, mc: ModelConfig, dtype: torch.dtype,
                 host_kv: torch.Tensor, model: LlamaForCausalLM) -> RemoteTier | None:
    """The remote tier over `cache.remote_store` (None without one); its prefix cache's
    entries are keyed to the model's fingerprint."""
    store = open_store(cache.remote_store,
                       (2, mc.num_kv_heads, cache.block_size, mc.head_dim), dtype,
                       parse_bytes(cache.remote_lend))
    if store is None:
        return None
    weakref.finalize(owner, store.close)
    return RemoteTier(store, host_kv, cache.block_size, cache.f_host,
                      cache.top_k * mc.num_kv_heads,
                      prefix_cache_bytes=parse_bytes(cache.prefix_cache_bytes),
                      seed=model_fingerprint(model, dtype))


def warm_up(sparse: SparseKV, cache: CacheConfig, mc: ModelConfig) -> None:
    """Compiles the block scoring (where the predictor bounds blocks by their summaries), the
    rerank and the key copy's quantization for these shapes, and loads the CPU row-copy kernel
    (a first build takes ~20 s), so that no request waits for a compile."""
    t0 = time.perf_counter()
    if cache.bounds:  # the predictor bounds blocks by summaries (not rerank=inf, not oracle)
        warm_up_scores(sparse.kmin, cache.score_aggregation, mc.num_heads // mc.num_kv_heads,
                       cache.summary_splits)
    if cache.reranks:  # its second stage, over the keys it reads
        keys = (sparse.key_codes if cache.key_copy else  # the host tier as the device reads it
                sparse.host_view[:, 0].unflatten(2, (-1, cache.block_size)).transpose(1, 2))
        warm_up_rerank(keys, mc.num_heads)
    if cache.key_copy:
        warm_up_key_copy(sparse.host_view, cache.block_size, cache.key_copy_bits)
    if sparse.device_kv.device.type == "cpu":  # the selection, the local stage's copy and
        select_kernel.extension()  # the key copy's quantizer: built here, not in a step
        row_copy.extension()
        if cache.key_copy:
            summaries.extension()
    log.info("compiled the block scoring in %.1f s", time.perf_counter() - t0)


def close_tiers(sparse: SparseKV | None, remote: RemoteTier | None) -> None:
    """Stops the prefetch workers (pending jobs finish first) and closes the store."""
    if sparse is not None:
        sparse.flush()
        sparse.pipeline.close()
        if remote is not None:
            remote.close()


def trace_tiers(sparse: SparseKV | None) -> Tracer:
    """A Chrome trace recorder of the prefetch pipeline and the foreground layers (sparse
    mode; dense: one that records nothing)."""
    tracer = Tracer()
    if sparse is not None:
        sparse.pipeline.tracer = sparse.pipeline.executor.tracer = tracer
    return tracer
