"""`engine/kv_tiers.py`: the tensors and pools an engine's KV tiers get, sized by hand from
the tiny model (2 layers, 2 KV heads, head_dim 16, fp32: 8 KiB per 16-token block)."""

from __future__ import annotations

import pytest
import torch

from oasiskv.config import CacheConfig, EngineConfig
from oasiskv.engine.kv_tiers import build_kv_tiers, close_tiers, trace_tiers
from oasiskv.engine.stats import device_tensors
from oasiskv.engine.weights import load_model
from oasiskv.kv.remote_tier import RemoteTier

BLOCK, KiB = 2 * 2 * 2 * 16 * 16 * 4, 1024  # layers x K/V x Hkv x B x d x fp32


class Owner:
    """Stands for the engine: the workers and the store close when it is collected."""


@pytest.fixture(scope="module")
def model(tiny_llama):
    m, mc, _ = load_model(EngineConfig.from_kwargs(model=str(tiny_llama)))
    return m, mc


def build(model, owner=None, **kw):
    """`owner`: keeps the workers alive while it lives (default: a temporary one)."""
    m, mc = model
    cache = CacheConfig(**kw)
    return build_kv_tiers(owner or Owner(), m, cache, mc, torch.float32, torch.device("cpu"),
                          512)


def test_dense_tiers_are_one_device_pool_of_the_budget(model):
    t = build(model, device_kv_budget=64 * BLOCK + BLOCK // 2)
    assert t.bytes_per_block == BLOCK and t.sparse is None and t.host_pool is None
    assert t.pool.num_blocks == 64 and t.device_split.kv_blocks == 64
    assert t.runner.device_kv.shape == (2, 2, 2, 64 * 16, 16)  # [L, K/V, Hkv, slots, d]
    assert t.kv.device is t.pool and t.remote is None


def test_sparse_tiers_hold_slabs_summaries_and_a_host_tier(model):
    t = build(model, kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
              host_kv_budget=1024 * KiB, rerank=0)
    assert t.sparse is not None and t.remote is None
    # one node: a host block per summary id the device holds, at most host_kv_budget's 128
    assert t.host_pool.num_blocks == min(1024 * KiB // BLOCK, t.device_split.summary_ids)
    assert t.runner.host_kv.shape == (2, 2, 2, t.host_pool.num_blocks * 16, 16)
    assert t.sparse.kmin.shape[1] == t.device_split.summary_ids  # one summary per block
    total = sum(x.numel() * x.element_size() for x in device_tensors(t))
    assert 300 * KiB - BLOCK < total <= 300 * KiB


def test_a_remote_store_gets_a_remote_tier_shared_with_sparse(model):
    t = build(model, kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
              host_kv_budget=1024 * KiB, remote_store="inprocess", f_host=0.5)
    assert isinstance(t.remote, RemoteTier) and t.sparse.remote is t.remote
    assert t.kv.summary_pool is not None  # summary ids outlive host blocks


def test_prefault_zeroes_every_pool(model):
    t = build(model, kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
              host_kv_budget=1024 * KiB, prefault_kv=True)
    for pool in device_tensors(t) + [t.runner.host_kv]:
        assert not pool.any()


def test_a_host_budget_under_one_block_is_a_clear_error(model):
    m, mc = model
    cache = CacheConfig(kv_mode="sparse", host_kv_budget=BLOCK - 1)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        build_kv_tiers(Owner(), m, cache, mc, torch.float32, torch.device("cpu"), 512)


def test_a_trace_records_the_pipeline_and_closing_stops_its_workers(model):
    owner = Owner()
    t = build(model, owner, kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
              host_kv_budget=1024 * KiB, prefetch="async")
    t.sparse.pipeline.executor.submit("select", lambda: None).wait()  # running
    tracer = trace_tiers(t.sparse)
    assert t.sparse.pipeline.tracer is tracer and t.sparse.pipeline.executor.tracer is tracer
    assert trace_tiers(None) is not tracer  # dense: a recorder of nothing
    close_tiers(t.sparse, t.remote)
    with pytest.raises(RuntimeError, match="closed"):  # its workers have stopped
        t.sparse.pipeline.executor.submit("select", lambda: None)


def test_host_kv_is_pinned_only_for_a_cuda_engine(model, monkeypatch):
    """A CPU engine on a machine that has CUDA keeps plain host memory: pinning follows the
    engine's device, not what the machine has."""
    from oasiskv.engine import kv_tiers
    from oasiskv.engine.runner import allocate_kv, pins_host_kv

    asked = []

    def record(*args, pin=False, **kw):  # the real pool, unpinned (no CUDA here to pin)
        asked.append(pin)
        return allocate_kv(*args, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kv_tiers, "allocate_kv", record)
    t = build(model, kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
              host_kv_budget=1024 * KiB)
    assert asked == [False, False] and not t.runner.host_kv.is_pinned()
    assert pins_host_kv("cuda") and pins_host_kv(torch.device("cuda:1"))
    assert not pins_host_kv("cpu") and not pins_host_kv("meta")
