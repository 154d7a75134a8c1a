"""The decode-host cache over the remote tier: outputs equal the engine without a remote tier
(and dense, when K covers every block), the per-request host budget holds at every step,
evicted blocks come back from the store bit-exactly, misses are fetched in one store call per
layer and step, and a failing store fails only the requests that needed it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import needs_mooncake

from oasiskv import LLM, SamplingParams
from oasiskv.config import CacheConfig
from oasiskv.kv.host_cache import HostCache
from oasiskv.kv.prefix_cache import is_entry
from oasiskv.kv.summaries import quantize_keys, round_outward
from oasiskv.store import BlockKey, RemoteStore, RemoteStoreError

B = 16
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPARSE = dict(kv_mode="sparse", top_k=2, f_hbm=0.5, max_num_seqs=3, max_num_batched_tokens=640)


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


class Recording(RemoteStore):
    """Wraps a store: records each get's keys; gets touching a request id in `failing` raise
    (naming the failed keys, or, with named=False, nothing, like a store that lost its link)."""

    def __init__(self, inner: RemoteStore, failing: tuple[str, ...] = (), named: bool = True):
        super().__init__(inner.block_shape, inner.dtype)
        self.inner, self.failing, self.named = inner, failing, named
        self.gets: list[list[BlockKey]] = []

    def _put(self, keys, blocks):
        self.inner.put_blocks(keys, blocks)

    def _get(self, keys, out):
        self.gets.append(list(keys))
        bad = [k for k in keys if k.namespace.split("-", 1)[1] in self.failing]
        if bad:
            raise RemoteStoreError("injected: the store lost these blocks",
                                   bad if self.named else [])
        self.inner.get_blocks(keys, out)

    def contains(self, keys):
        return self.inner.contains(keys)

    def remove(self, namespace):
        return self.inner.remove(namespace)


def test_make_room_evicts_least_recently_selected_unprotected_prompt_blocks():
    # 8 prompt blocks + 2 generated in host blocks 100..109; room for 3 prompt blocks
    cache = HostCache.create("r", list(range(100, 110)), num_layers=2, num_prompt=8,
                             capacity=3)
    for layer in (0, 1):  # the most recent prompt blocks stay, generated ones always
        assert cache.where[layer].tolist() == [-1] * 5 + [105, 106, 107, 108, 109]
    assert cache.budget == 5 and sorted(cache.owned) == list(range(105, 110))
    cache.touch(0, torch.tensor([[7, 5, -2, 9]]), step=3)  # layer 0: block 6 is now the LRU
    layer0 = torch.tensor([0])

    def protect(*blocks):  # [L, *]: layer 0's working sets; layer 1's are not read
        return torch.tensor([list(blocks), [-1] * len(blocks)])

    slots, evicted = cache.make_room(layer0, torch.tensor([1]), protect(-1))
    assert (slots.tolist(), evicted) == ([106], 1)
    assert cache.where[0, :8].tolist() == [-1, 106, -1, -1, -1, 105, -1, 107]
    assert cache.where[1, 5:8].tolist() == [105, 106, 107]  # other layers untouched
    # block 1 is older than 5 and 7, but protected (in a working set), like 5
    assert cache.make_room(layer0, torch.tensor([2]), protect(5, 1))[1] == 1
    assert cache.where[0, [1, 2, 5, 7]].tolist() == [106, 107, 105, -1]
    with pytest.raises(RuntimeError, match="layer 0: 2 blocks to fetch, 0 free and 0 evict"):
        cache.make_room(torch.tensor([0, 0]), torch.tensor([3, 4]), protect(1, 2, 5))
    cache.forget(layer0, torch.tensor([2]))  # a failed fetch leaves its slot empty
    assert cache.resident(0) == 4 and cache.resident() == cache.peak == 5
    slots, evicted = cache.make_room(layer0, torch.tensor([3]), protect(-1))
    assert (slots.tolist(), evicted) == ([107], 0)


def test_making_room_in_several_layers_at_once_equals_one_layer_at_a_time():
    """A job's remote stage makes room in all its layers in one call: each layer evicts and
    fills as if it were alone, whatever the other layers need."""
    g = torch.Generator().manual_seed(0)
    L, P, C = 4, 20, 6
    caches = [HostCache.create("r", list(range(100, 100 + P + 2)), L, P, C) for _ in range(2)]
    for step in range(1, 4):  # selections give every layer its own LRU order
        picks = torch.randint(0, P, (L, 5), generator=g)
        for cache in caches:
            cache.touch(0, picks, step)
    for cache in caches:  # failed fetches left free slots: more than layers 1 and 3 need
        cache.forget(torch.tensor([1, 3, 3]), torch.tensor([19, 18, 19]))
    protected = torch.randint(-1, P, (L, 4), generator=g)
    incoming = {0: [2, 5, 11], 1: [], 2: [0, 1, 3, 4, 6, 7], 3: [9]}  # layer 2: all C slots
    for layer, blocks in incoming.items():
        keep = [b for b in blocks if caches[0].where[layer, b] < 0]
        incoming[layer] = [b for b in keep if b not in protected[layer].tolist()][:C - 2]
    layers = torch.tensor([layer for layer, bs in incoming.items() for _ in bs])
    blocks = torch.tensor([b for bs in incoming.values() for b in bs])
    slots, evicted = caches[0].make_room(layers, blocks, protected)
    one_by_one, total = [], 0
    for layer, bs in incoming.items():
        if bs:
            s, e = caches[1].make_room(torch.tensor([layer] * len(bs)), torch.tensor(bs),
                                       protected)
            one_by_one.append(s)
            total += e
    assert torch.equal(slots, torch.cat(one_by_one)) and evicted == total > 0
    for name in ("where", "holder"):
        assert torch.equal(getattr(caches[0], name), getattr(caches[1], name))
    assert caches[0].peak == caches[1].peak


def budget(engine, seq, f_host: float) -> int:
    """ceil(f_host*P) prompt blocks, at least the largest working set of a layer (K * Hkv, at
    most P), plus every block from the last complete prompt block to max_context."""
    P = seq.num_prompt_tokens // B
    working_set = engine.config.cache.top_k * engine.model_config.num_kv_heads
    return min(P, max(math.ceil(f_host * P), working_set)) + -(-seq.max_context // B) - P


def check_host_caches(engine, f_host: float) -> None:
    """Every handed-over request owns exactly its budget of host blocks; in every layer the
    summaries (or the key copy, or both) of all its prompt blocks and its resident prompt
    blocks match the store's copy, and every device slot of a working set holds its block: the
    store's copy of a prompt block, the host's of a generated one."""
    sp = engine.sparse
    sp.flush()  # async prefetch: let the step's jobs land
    store = sp.remote.store
    store = getattr(store, "inner", store)
    for seq in engine.scheduler.running:
        cache = seq.host_cache
        if cache is None or cache.error:  # in prefill, or failing after this step
            continue
        assert cache.budget == budget(engine, seq, f_host) == len(seq.host_table)
        P = seq.num_prompt_tokens // B
        for layer in range(cache.where.shape[0]):
            where = cache.where[layer]
            resident = where[where >= 0]
            assert len(resident) <= cache.budget
            assert len(set(resident.tolist())) == len(resident)
            assert set(resident.tolist()) <= set(seq.host_table)
            stored = store.get_blocks([BlockKey(cache.namespace, layer, b) for b in range(P)])
            for b, block in enumerate(stored):  # [2, Hkv, B, d]
                ids = seq.summary_ids[b]  # summaries stay for evicted blocks too
                if sp.cfg.bounds:
                    kmin, kmax = round_outward(block[0].amin(1), block[0].amax(1),
                                               sp.kmin.dtype)
                    assert torch.equal(sp.kmin[layer, ids], kmin)
                    assert torch.equal(sp.kmax[layer, ids], kmax)
                if sp.key_codes is not None:  # [Hkv, B, d] as one layer's one block
                    codes, scales = quantize_keys(block[0][None, :, None], sp.cfg.key_copy_bits)
                    assert torch.equal(sp.key_codes[layer, ids], codes[0, 0])
                    assert torch.equal(sp.key_scales[layer, ids], scales[0, 0])
                if where[b] >= 0:
                    slot = int(where[b]) * B
                    assert torch.equal(sp.host_kv[layer, :, :, slot:slot + B], block)
            ws = seq.working_set
            if ws is None:
                continue
            for s, g in (ws.head_map[layer] >= 0).nonzero().tolist():
                b, dev = int(ws.head_map[layer, s, g]), seq.block_table[s] * B
                slot = sp.device_kv[layer, :, g, dev:dev + B]
                if b < P:  # a partial hand-over's slab arrives without its blocks on the host
                    assert torch.equal(slot, stored[b][:, g])
                    continue
                assert where[b] >= 0, f"generated block {b} is not on the host"
                host = int(where[b]) * B
                assert torch.equal(slot, sp.host_kv[layer, :, g, host:host + B])


def run_checked(llm, prompts, f_host, params=GREEDY, ids=None, prefix_kv=None):
    """Steps the engine to the end, checking the host caches after every step."""
    e = llm.engine
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    prefix_kv = prefix_kv or [None] * len(prompts)
    for rid, p, kv in zip(ids, prompts, prefix_kv, strict=True):
        e.add_request(p, params, request_id=rid, prefix_kv=kv)
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o
        check_host_caches(e, f_host)
    return [outs[i] for i in ids]


# async jobs of one layer (group 1 = half of 2) and of both layers (one store call per step)
@pytest.mark.parametrize("prefetch,group", [("sync", 0), ("async", 0), ("async", 2)])
@pytest.mark.parametrize("f_host", [1.0, 0.25])
def test_outputs_equal_the_engine_without_a_remote_tier(tiny_llama, f_host, prefetch, group):
    prompts = prompts_of([200, 170, 90])
    ref = LLM(str(tiny_llama), prefetch=prefetch, **SPARSE)
    want = ref.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=f_host, prefetch=prefetch,
              prefetch_group=group, **SPARSE)
    got = run_checked(llm, prompts, f_host)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.finish_reason == "length" for o in got)
    stats = llm.stats()
    P = sum(len(p) // B for p in prompts)
    block_bytes = llm.engine.sparse.remote.store.block_bytes
    assert stats["remote_put_bytes"] == P * 2 * block_bytes  # every prompt block, both layers
    assert stats["remote_bytes"] == stats["remote_blocks"] * block_bytes
    if f_host == 1.0:  # the host keeps everything: nothing to fetch back
        assert stats["remote_bytes"] == stats["host_evictions"] == 0
    else:
        assert stats["remote_bytes"] > 0 and stats["host_evictions"] > 0
    # same selections, same traffic between host and device
    for key in ("sparse_predicted", "sparse_hits", "sparse_admitted", "sparse_h2d_bytes"):
        assert stats[key] == ref.stats()[key]
    # the finished requests left the store; their prompt blocks stay as prefix-cache entries
    store = llm.engine.sparse.remote.store
    assert all(map(is_entry, store.namespaces())) and len(store) == P * 2
    assert stats["prefix_put_bytes"] == P * 2 * block_bytes
    llm.close()
    ref.close()


def test_k_covering_every_block_equals_dense(tiny_llama):
    prompts = prompts_of([90, 60, 40], seed=1)
    want = LLM(str(tiny_llama), max_num_seqs=3, max_num_batched_tokens=640).generate(
        prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama), **{**SPARSE, "top_k": 16}, remote_store="inprocess",
              f_host=0.25)  # 16 * 16 tokens > 90 + 40
    got = run_checked(llm, prompts, 0.25)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_prefix_kv_requests_go_to_the_store_too(tiny_llama):
    prompts = prompts_of([200, 150], seed=7)
    donor = LLM(str(tiny_llama)).engine
    prefixes = [donor.compute_prefix_kv(p[:-10]) for p in prompts]
    ref = LLM(str(tiny_llama), **SPARSE).engine
    for i, (p, kv) in enumerate(zip(prompts, prefixes, strict=True)):
        ref.add_request(p, GREEDY, request_id=f"r{i}", prefix_kv=kv)
    want = {}
    while ref.has_unfinished():
        want.update({o.request_id: o.token_ids for o in ref.step() if o.finished})
    llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=0.25, **SPARSE)
    got = run_checked(llm, prompts, 0.25, prefix_kv=prefixes)
    assert [o.token_ids for o in got] == [want["r0"], want["r1"]]
    stats = llm.stats()
    assert stats["prefill_tokens"] == 20  # the prefixes were not computed again...
    assert stats["remote_put_bytes"] == (200 // B + 150 // B) * 2 * (  # ...but stored
        llm.engine.sparse.remote.store.block_bytes)


def test_evicted_blocks_are_fetched_again_in_one_call_per_job(tiny_llama):
    llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=0.1, prefetch="sync",
              **SPARSE)
    e = llm.engine
    store = e.sparse.remote.store = Recording(e.sparse.remote.store)
    # a selection job's remote stage runs (its hook once per layer), then its store calls
    jobs: dict[int, tuple[set[int], set[str]]] = {}  # gets before it -> (layers, requests)
    e.sparse.stage_hooks["remote"] = lambda layer, seqs: (
        jobs.setdefault(len(store.gets), (set(), set()))[0].add(layer),
        jobs[len(store.gets)][1].update(s.host_cache.namespace for s in seqs))
    prompts = prompts_of([240, 230, 250], seed=2)
    run_checked(llm, prompts, 0.1)
    starts = sorted(jobs)
    for start, end in zip(starts, starts[1:] + [len(store.gets)], strict=True):
        layers, rids = jobs[start]
        assert end - start <= 1  # one store call per job...
        for keys in store.gets[start:end]:  # ...for its layers and requests
            assert {k.layer for k in keys} <= layers
            assert {k.namespace for k in keys} <= rids
    # coalesced: sync selects every layer of a step in one job, so one call
    assert any(len({k.namespace for k in keys}) > 1 for keys in store.gets)
    assert any(len({k.layer for k in keys}) > 1 for keys in store.gets)
    fetched = [k for keys in store.gets for k in keys]
    again = {k for k in fetched if fetched.count(k) > 1}
    assert again, "no block was evicted and fetched again"
    stats = llm.stats()
    assert stats["remote_bytes"] == len(fetched) * store.block_bytes == store.bytes_got
    assert stats["host_evictions"] >= len(fetched) - len(set(fetched))
    assert stats["host_cache"] == {}  # all finished
    assert 0 < stats["host_cache_peak_blocks"] <= max(
        budget(e, s, 0.1) for s in [e.make_sequence(p, GREEDY) for p in prompts])


def test_a_small_host_budget_decodes_more_requests_at_once(tiny_llama):
    """Host memory for one request's whole history: with f_host=1 they decode one at a time,
    with f_host=0.25 the host cache of the first leaves room to admit the second."""
    prompts = prompts_of([200, 200, 200], seed=3)  # 12 prompt blocks + 3 more: 15
    ref = LLM(str(tiny_llama), **SPARSE)
    want = [o.token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)]
    per_block = ref.engine.bytes_per_block
    peaks = {}
    for f_host in (1.0, 0.25):
        llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=f_host,
                  host_kv_budget=22 * per_block, **SPARSE)
        e = llm.engine
        for i, p in enumerate(prompts):
            e.add_request(p, GREEDY, request_id=f"r{i}")
        outs, peak = {}, 0
        while e.has_unfinished():
            for o in e.step():
                outs[o.request_id] = o
            peak = max(peak, sum(s.host_cache is not None for s in e.scheduler.running))
        assert [outs[f"r{i}"].token_ids for i in range(3)] == want
        peaks[f_host] = peak
    assert peaks == {1.0: 1, 0.25: 2}  # budgets 15 and 4 + 3 of 22 host blocks


@pytest.mark.parametrize("named", [True, False])
@pytest.mark.parametrize("prefetch", ["sync", "async"])
def test_a_failing_store_fails_only_the_requests_that_needed_it(tiny_llama, named, prefetch):
    prompts = prompts_of([240, 230, 250], seed=4)
    ref = LLM(str(tiny_llama), prefetch=prefetch, **SPARSE)
    want = ref.generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=0.1, prefetch=prefetch,
              **SPARSE)
    e = llm.engine
    store = e.sparse.remote.store = Recording(e.sparse.remote.store, ("bad",), named)
    got = run_checked(llm, prompts, 0.1, ids=["a", "bad", "b"])
    assert any(k.namespace.endswith("-bad") for keys in store.gets for k in keys)  # needed
    assert got[1].finish_reason == "error"
    assert "remote tier" in got[1].error and "injected" in got[1].error
    for o, ref_out in ((got[0], want[0]), (got[2], want[2])):
        assert o.finish_reason == "length" and o.error is None
        assert o.token_ids == ref_out.token_ids
    stats = llm.stats()
    assert stats["requests_failed"] == 1 and stats["step_failures"] == 0
    store.failing = ()  # the engine goes on serving, "bad" included
    again = llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
    assert again.token_ids == want[1].token_ids
    llm.close()
    ref.close()


def test_a_failing_put_fails_only_that_request(tiny_llama):
    class PutFails(Recording):
        def _put(self, keys, blocks):
            if any(k.namespace.endswith("-bad") for k in keys):
                raise RemoteStoreError("injected: no room in the store")
            super()._put(keys, blocks)

    prompts = prompts_of([60, 70], seed=5)
    want = LLM(str(tiny_llama), **SPARSE).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=0.5, **SPARSE)
    llm.engine.sparse.remote.store = PutFails(llm.engine.sparse.remote.store)
    got = run_checked(llm, prompts, 0.5, ids=["ok", "bad"])
    assert got[1].finish_reason == "error" and "storing the prompt" in got[1].error
    assert got[0].token_ids == want[0].token_ids
    assert llm.engine.host_pool.num_used == 0  # the failed request's host blocks came back


@pytest.mark.parametrize("kwargs, match", [
    (dict(remote_store="inprocess", f_host=0.0), "f_host must be in"),
    (dict(remote_store="inprocess", f_host=1.5), "f_host must be in"),
    (dict(f_host=0.5), "needs a remote store"),
    (dict(remote_store="redis://x:1"), "remote_store must be"),
    (dict(remote_store="mooncake://host"), "remote_store must be"),
    (dict(remote_store="inprocess", predictor="oracle"), "oracle reads every key"),
    (dict(remote_store="inprocess", rerank_source="host"),
     "rerank_source=host reads the candidates' keys from the host tier"),
])
def test_bad_remote_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(kv_mode="sparse", **kwargs)
    with pytest.raises(ValueError, match="needs kv_mode=sparse"):
        CacheConfig(remote_store="inprocess")
    assert CacheConfig(kv_mode="sparse", remote_store="mooncake://127.0.0.1:50051", f_host=0.2)


@needs_mooncake
def test_a_mooncake_store_gives_the_same_tokens(tiny_llama, master):
    prompts = prompts_of([200, 170, 90], seed=8)
    want = LLM(str(tiny_llama), **SPARSE).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(tiny_llama), remote_store=f"mooncake://{master.address}", f_host=0.25,
              **SPARSE)
    got = run_checked(llm, prompts, 0.25)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = llm.stats()
    assert stats["remote_bytes"] > 0 and stats["host_evictions"] > 0
    llm.close()


def test_a_shared_prefix_is_read_from_the_store_not_recomputed(tiny_llama):
    shared = prompts_of([160], seed=9)[0]  # 10 complete blocks
    prompts = [shared + tail for tail in prompts_of([30, 45], seed=10)]
    ref = LLM(str(tiny_llama), **SPARSE)
    want = [ref.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    llm = LLM(str(tiny_llama), remote_store="inprocess", f_host=0.25, **SPARSE)
    e = llm.engine
    e.add_request(prompts[0], GREEDY, request_id="first")
    while e.requests["first"].host_cache is None:  # until its prompt is in the store
        e.step()
    e.add_request(prompts[1], GREEDY, request_id="second")
    assert e.counters["prefix_reused_tokens"] == 160
    outs = {}
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    assert [outs["first"].token_ids, outs["second"].token_ids] == want
    assert e.counters["prefill_tokens"] == len(prompts[0]) + len(prompts[1]) - 160
    # the requests left, their prefix-cache entries stay: a later prompt reads all its
    # complete blocks (but the last token's) from the store
    assert llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0].token_ids == want[1]
    assert e.counters["prefix_reused_tokens"] == 160 + (len(prompts[1]) - 1) // 16 * 16
    assert all(map(is_entry, e.remote.store.namespaces()))
