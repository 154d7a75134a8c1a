"""`engine/stats.py`: the engine's figures against hand-computed sizes of the tiny model
(2 layers, 2 KV heads, head_dim 16, fp32: 8 KiB per 16-token block) and its own counters."""

from __future__ import annotations

from oasiskv import LLM, SamplingParams
from oasiskv.engine.stats import device_memory, device_tensors, engine_stats, host_cache_stats

BLOCK, KiB = 2 * 2 * 2 * 16 * 16 * 4, 1024
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
SPARSE = dict(kv_mode="sparse", top_k=2, f_hbm=0.5, device_kv_budget=300 * KiB,
              host_kv_budget=1024 * KiB)


def test_dense_stats_count_blocks_bytes_and_tokens(tiny_llama):
    llm = LLM(str(tiny_llama), device_kv_budget=64 * BLOCK)
    llm.generate([list(range(3, 40))], GREEDY, use_tqdm=False)  # 37 tokens + 5
    s = engine_stats(llm.engine)
    assert s == llm.stats()
    assert s["kv_bytes_per_block"] == BLOCK and s["kv_blocks_total"] == 64
    assert s["kv_blocks_used"] == 0 and s["kv_peak_blocks"] == 3  # 41 of 42 tokens have K/V
    assert s["kv_peak_bytes"] == 3 * BLOCK
    assert s["prefill_tokens"] == 37 and s["decode_tokens"] == 4
    assert s["requests_added"] == s["requests_finished"] == 1
    assert s["device_bytes_allocated"] == 64 * BLOCK and s["device_kv_budget"] == 64 * BLOCK
    assert "host_blocks_total" not in s and "remote_bytes" not in s


def test_sparse_stats_add_the_host_tier_and_its_traffic(tiny_llama):
    llm = LLM(str(tiny_llama), **SPARSE)
    llm.generate([list(range(3, 100))], GREEDY, use_tqdm=False)
    e = llm.engine
    s = llm.stats()
    assert s["host_blocks_total"] == e.host_pool.num_blocks
    assert s["host_peak_bytes"] == e.host_pool.peak_used * BLOCK > 0
    assert s["slab_bytes"] == (2 + 2) * s["kv_bytes_per_block"]  # K=2, active, drafts
    assert s["sparse_h2d_bytes"] == e.sparse.counters.h2d_bytes
    total = sum(t.numel() * t.element_size() for t in device_tensors(e))
    assert device_memory(e)["device_bytes_allocated"] == total <= 300 * KiB
    assert "host_cache_peak_blocks" not in s  # no remote store


def test_host_cache_stats_follow_the_running_requests(tiny_llama):
    llm = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess", f_host=0.5)
    e = llm.engine
    e.add_request(list(range(3, 100)), GREEDY, request_id="a")
    while e.requests["a"].host_cache is None:
        e.step()
    h = e.requests["a"].host_cache
    s = host_cache_stats(e)
    assert s["host_cache"] == {"a": {"blocks": h.resident(), "peak": h.peak,
                                     "budget": h.budget}}
    assert s["host_cache_peak_blocks"] == h.peak > 0  # no request has finished yet
    assert llm.stats()["remote_put_bytes"] == 6 * 2 * BLOCK // 2  # 6 complete blocks x layers
    while e.has_unfinished():
        e.step()
    s = llm.stats()
    assert s["host_cache"] == {} and s["host_cache_peak_blocks"] == e.host_cache_peak >= h.peak
