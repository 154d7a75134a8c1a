"""Sparse decode: scoring and selection against brute force, working-set invariants on the
engine under random schedules, equality with dense decode when K covers every block."""

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import oasiskv.engine.engine as engine_mod
from oasiskv import LLM, SamplingParams
from oasiskv.config import CacheConfig
from oasiskv.kv.select import (
    block_scores,
    insert_block,
    mixed_queries,
    select_capped_lru,
    select_capped_lru_batch,
    stamp,
    top_k_blocks,
    weighted_scores,
)
from oasiskv.kv.summaries import quantize_keys, round_outward

# ---------------------------------------------------------------- scoring and top-K


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.0])
def test_block_scores_equal_brute_force_bound(alpha):
    torch.manual_seed(0)
    hkv, group, d, n = 3, 3, 8, 11
    q = torch.randn(hkv * group, d)
    keys = torch.randn(n, 16, hkv, d)  # n blocks of 16 tokens
    kmin, kmax = keys.amin(1), keys.amax(1)  # [n, Hkv, d]
    got = block_scores(q, kmin, kmax, alpha)
    want = torch.zeros(hkv, n)
    for g in range(hkv):
        for b in range(n):
            for h in range(g * group, (g + 1) * group):
                c, r = (kmax[b, g] + kmin[b, g]) / 2, (kmax[b, g] - kmin[b, g]) / 2
                want[g, b] += (q[h] @ c + alpha * (q[h].abs() @ r)).item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if alpha == 1.0:  # Quest's bound: per channel the larger of q*kmin and q*kmax
        quest = torch.stack([
            sum(torch.maximum(q[h] * kmin[:, g], q[h] * kmax[:, g]).sum(-1)
                for h in range(g * group, (g + 1) * group)) for g in range(hkv)])
        torch.testing.assert_close(got, quest, rtol=1e-5, atol=1e-5)
        # ...which bounds every real key's score from above
        real = torch.stack([sum(keys[:, :, g] @ q[h] for h in range(g * group, (g + 1) * group))
                            for g in range(hkv)])  # [Hkv, n, 16]
        assert (real.amax(-1) <= got + 1e-4).all()


def test_weighted_scores_of_strided_bf16_summaries_equal_float64():
    """The batched path: bf16 summaries as a strided [layers, R, n, Hkv, d] view of the pool
    (requests side by side), fp32 weights; compiled, it must equal the float64 sums."""
    torch.manual_seed(2)
    layers, R, n, hkv, d, stride = 3, 4, 13, 3, 8, 17
    pool = [torch.randn(layers, R * stride, hkv, d).to(torch.bfloat16) for _ in range(2)]
    lo, hi = (p.as_strided((layers, R, n, hkv, d), (p.stride(0), stride * hkv * d, hkv * d, d,
                                                    1)) for p in pool)
    w_max, w_min = torch.randn(layers, R, hkv, d), torch.randn(layers, R, hkv, d)
    want = (torch.einsum("lrnhd,lrhd->lrhn", hi.double(), w_max.double())
            + torch.einsum("lrnhd,lrhd->lrhn", lo.double(), w_min.double()))
    got = weighted_scores(lo, hi, w_max, w_min)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_top_k_matches_sorting():
    torch.manual_seed(1)
    scores = torch.randn(3, 40)
    for k in (1, 7, 40, 100):
        got = top_k_blocks(scores, k)
        want = torch.argsort(scores, dim=-1, descending=True)[:, :min(k, 40)]
        assert torch.equal(got, want)


# ---------------------------------------------------------------- selection invariants


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_capped_lru_selection_invariants(data):
    k_slots = data.draw(st.integers(1, 8), label="K")
    hkv = data.draw(st.integers(1, 3), label="Hkv")
    cap = data.draw(st.integers(1, k_slots), label="cap")
    head_map = torch.full((k_slots, hkv), -1, dtype=torch.long)
    last_used = torch.zeros((k_slots, hkv), dtype=torch.long)
    n_blocks, seeded = 0, False
    for step in range(1, data.draw(st.integers(1, 25), label="steps") + 1):
        if data.draw(st.booleans(), label="fill"):  # a block fills and enters every head
            insert_block(head_map, last_used, n_blocks, step)
            n_blocks += 1
        if n_blocks == 0:
            continue
        k = min(k_slots, n_blocks)
        predicted = torch.stack([torch.tensor(data.draw(st.permutations(range(n_blocks)),
                                                        label=f"rank{g}")[:k])
                                 for g in range(hkv)])
        before = head_map.clone()
        sel = select_capped_lru(head_map, last_used, predicted, cap if seeded else None, step)
        seeded = seeded or n_blocks > k_slots
        for g in range(hkv):
            held = head_map[:, g][head_map[:, g] >= 0].tolist()
            assert len(held) == len(set(held)) == min(k_slots, n_blocks)  # exactly min(K, n)
            assert all(0 <= b < n_blocks for b in held)
            admitted = int((sel.heads == g).sum())
            if cap is not None and before[:, g].ge(0).sum() == k_slots and seeded:
                assert admitted <= cap
            # hits stay; admissions are the best-ranked misses
            hits = set(before[:, g].tolist()) & set(predicted[g].tolist())
            assert hits <= set(held)
            misses = [b for b in predicted[g].tolist() if b not in before[:, g].tolist()]
            assert sel.blocks[sel.heads == g].tolist() == misses[:admitted]
        assert len(sel.slots) == len(sel.heads) == len(sel.blocks)


def reference_select(head_map, last_used, predicted, cap, step):
    """select_capped_lru_batch for one request, head by head in plain Python."""
    admitted = []
    for g in range(head_map.shape[1]):
        held = head_map[:, g].tolist()
        picks = [b for b in predicted[g].tolist() if b >= 0]
        for slot, b in enumerate(held):
            if b in picks:
                last_used[slot, g] = stamp(step, picks.index(b))
        misses = [b for b in picks if b not in held][:cap]
        # victims: empty slots first, then the least recently selected slots not predicted
        free = sorted((slot for slot, b in enumerate(held) if b not in picks),
                      key=lambda slot: -1 if held[slot] < 0 else int(last_used[slot, g]))
        for slot, b in zip(free, misses, strict=False):
            head_map[slot, g] = b
            last_used[slot, g] = stamp(step, picks.index(b))
            admitted.append((g, slot, b))
    return admitted


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_batched_selection_equals_per_head_reference(data):
    requests = data.draw(st.integers(1, 4), label="R")
    k_slots, hkv = data.draw(st.integers(1, 10), label="K"), data.draw(st.integers(1, 3))
    n_blocks = data.draw(st.integers(1, 30), label="blocks")
    k = min(k_slots, n_blocks)
    head_map = torch.full((requests, k_slots, hkv), -1, dtype=torch.long)
    last_used = torch.zeros_like(head_map)
    predicted = torch.full((requests, hkv, k), -2, dtype=torch.long)
    for r in range(requests):
        real = data.draw(st.integers(1, k), label="picks")  # the rest is padding
        for g in range(hkv):
            held = data.draw(st.lists(st.integers(0, n_blocks - 1), max_size=k_slots,
                                      unique=True), label="held")
            slots = data.draw(st.permutations(range(k_slots)), label="slots")[:len(held)]
            head_map[r, slots, g] = torch.tensor(held, dtype=torch.long)
            last_used[r, slots, g] = torch.tensor(
                data.draw(st.lists(st.integers(0, 50), min_size=len(held), max_size=len(held))),
                dtype=torch.long)
            predicted[r, g, :real] = torch.tensor(
                data.draw(st.permutations(range(n_blocks)), label="rank")[:real])
    caps = torch.tensor(data.draw(st.lists(st.integers(1, k), min_size=requests,
                                           max_size=requests), label="caps"))
    want_map, want_used = head_map.clone(), last_used.clone()
    want = [reference_select(want_map[r], want_used[r], predicted[r], int(caps[r]), 9)
            for r in range(requests)]
    sel = select_capped_lru_batch(head_map, last_used, predicted, caps, step=9)
    assert torch.equal(head_map, want_map) and torch.equal(last_used, want_used)
    m = sel.admitted  # fixed-size candidates; the admitted ones entered
    got = list(zip(sel.requests[m].tolist(), sel.heads[m].tolist(), sel.slots[m].tolist(),
                   sel.blocks[m].tolist(), strict=True))
    assert sorted(got) == sorted((r, *a) for r, adm in enumerate(want) for a in adm)


def test_insert_block_over_layers_equals_layer_by_layer():
    gen = torch.Generator().manual_seed(0)
    head_map = torch.randint(-1, 6, (3, 4, 2), generator=gen)  # [L, K, Hkv]
    head_map[0, 1, 0] = 7  # this head already holds the block: it stays where it is
    last_used = torch.randint(0, 9, (3, 4, 2), generator=gen)
    maps, used = head_map.clone(), last_used.clone()
    before = head_map.clone()
    slots, new = insert_block(head_map, last_used, 7, step=10)  # [L, Hkv] each
    for layer in range(3):
        s, n = insert_block(maps[layer], used[layer], 7, step=10)
        assert torch.equal(s, slots[layer]) and torch.equal(n, new[layer])
    assert torch.equal(head_map, maps) and torch.equal(last_used, used)
    assert int(new.sum()) == 5 and (head_map == 7).sum(1).eq(1).all()
    # the heads that entered it hold it at the returned slot; the one that held it is as it was
    layer, head = new.nonzero(as_tuple=True)
    assert (head_map[layer, slots[layer, head], head] == 7).all()
    assert not new[0, 0] and torch.equal(head_map[0, :, 0], before[0, :, 0])


def test_a_filled_block_displaces_the_lowest_ranked_pick_of_the_step():
    head_map = torch.full((4, 2), -1, dtype=torch.long)
    last_used = torch.zeros((4, 2), dtype=torch.long)
    predicted = torch.tensor([[5, 1, 7, 3], [2, 6, 0, 4]])  # [Hkv, k] best first
    select_capped_lru(head_map, last_used, predicted, None, step=3)
    insert_block(head_map, last_used, 9, step=3)
    for g, worst in enumerate((3, 4)):
        held = set(head_map[:, g].tolist())
        assert held == set(predicted[g].tolist()) - {worst} | {9}
    # a later step's hit is more recent than any pick of this step, whatever its rank
    select_capped_lru(head_map, last_used, torch.tensor([[7], [0]]), 1, step=4)
    insert_block(head_map, last_used, 10, step=4)
    assert 7 in head_map[:, 0].tolist() and 0 in head_map[:, 1].tolist()


# ---------------------------------------------------------------- engine: sparse vs dense


def run(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def capture_logits(monkeypatch):
    """Records each request's sampled logits rows, through the engine's sampler call."""
    seen: dict[str, list[torch.Tensor]] = {}
    real = engine_mod.sample

    def spy(logits, params, generators):
        spy.rows.append(logits.clone())
        return real(logits, params, generators)

    spy.rows = []
    monkeypatch.setattr(engine_mod, "sample", spy)
    return spy, seen


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_sparse_with_k_covering_all_blocks_equals_dense(tiny_llama, monkeypatch, test_device):
    """On OASISKV_TEST_DEVICE (conftest): sparse with every block selected is dense."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(max_num_batched_tokens=48, max_num_seqs=4, device=test_device)
    dense = LLM(str(tiny_llama), **kw)
    prompts = prompts_of([5, 30, 47, 90], dense.engine.model_config.vocab_size)
    spy, _ = capture_logits(monkeypatch)
    ref = run(dense, prompts, params)
    ref_rows = spy.rows
    spy.rows = []
    sparse = LLM(str(tiny_llama), kv_mode="sparse", top_k=16, **kw)  # 16*16 > 90+40 tokens
    got = run(sparse, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert len(spy.rows) == len(ref_rows)
    for a, b in zip(spy.rows, ref_rows, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    stats = sparse.stats()
    assert stats["sparse_wanted"] == stats["sparse_admitted"] > 0  # never capped
    assert stats["sparse_hits"] > 0


def check_working_sets(engine):
    """Every running sparse request: each (slot, head) of its slab holds exactly the host
    block its head map names; each head holds min(K, complete blocks) distinct blocks."""
    engine.sparse.flush()  # async prefetch: let the step's jobs land
    sp, B, K = engine.sparse, engine.pool.block_size, engine.config.cache.top_k
    for seq in engine.scheduler.running:
        # every complete block of the history has its summary (where selections bound blocks
        # by them) and its key copy (where one is kept), prefill or decode alike
        for b in range(seq.num_computed_tokens // B):
            host, ids = seq.host_table[b], seq.summary_ids[b]
            keys = sp.host_kv[:, 0, :, host * B:(host + 1) * B]  # [L, Hkv, B, d]
            if sp.cfg.bounds:
                kmin, kmax = round_outward(keys.amin(2), keys.amax(2), sp.kmin.dtype)
                assert torch.equal(sp.kmin[:, ids], kmin) and torch.equal(sp.kmax[:, ids], kmax)
            if sp.key_codes is not None:  # [L, 1 block, Hkv, d, B]
                codes, scales = quantize_keys(keys[:, :, None], sp.cfg.key_copy_bits)
                assert torch.equal(sp.key_codes[:, ids], codes[:, 0])
                assert torch.equal(sp.key_scales[:, ids], scales[:, 0])
        ws = seq.working_set
        if ws is None:
            continue
        n_full = seq.num_computed_tokens // B
        for layer in range(ws.head_map.shape[0]):
            for g in range(ws.head_map.shape[2]):
                held = [b for b in ws.head_map[layer, :, g].tolist() if b >= 0]
                assert len(held) == len(set(held)) == min(K, n_full)
                for s, b in enumerate(ws.head_map[layer, :, g].tolist()):
                    if b < 0:
                        continue
                    dev = seq.block_table[s] * B
                    host = seq.host_table[b] * B
                    assert torch.equal(sp.device_kv[layer, :, g, dev:dev + B],
                                       sp.host_kv[layer, :, g, host:host + B])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
# a 1-token prefill chunk that samples nothing (budget split) is prefill, not decode
@example(lengths=[31, 16], top_k=1, f_hbm=0.25, max_tokens=2, seqs=2)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4),
       top_k=st.integers(1, 4), f_hbm=st.sampled_from([0.25, 0.5, 1.0]),
       max_tokens=st.integers(1, 40), seqs=st.integers(1, 3))
def test_working_set_invariants_under_random_schedules(tiny_llama, lengths, top_k, f_hbm,
                                                       max_tokens, seqs):
    # sync prefetch: each step's counters and working sets are complete when step() returns
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=top_k, f_hbm=f_hbm, prefetch="sync",
              max_num_batched_tokens=32, max_num_seqs=seqs)
    e = llm.engine
    cap = math.ceil(f_hbm * top_k)
    cfg = e.model_config
    head_block_bytes = 2 * 16 * cfg.head_dim * 4
    fill_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * 16 * cfg.head_dim * 4
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts_of(lengths, cfg.vocab_size, seed=sum(lengths)):
        e.add_request(p, params)
    token_bytes = fill_bytes // 16
    while e.has_unfinished():
        before = {id(s): (s.num_computed_tokens, s.working_set is None,
                          s.working_set is not None and all(s.working_set.seeded))
                  for s in list(e.scheduler.running) + list(e.scheduler.waiting)}
        seqs = list(e.scheduler.running) + list(e.scheduler.waiting)
        e.step()
        step = e.sparse.last_step
        check_working_sets(e)
        # a decode: one output token (every prompt token, even alone in a chunk, is prefill)
        decodes = [(s, *before[id(s)]) for s in seqs
                   if s.num_computed_tokens == before[id(s)][0] + 1 == s.num_tokens - 1
                   and before[id(s)][0] >= s.num_prompt_tokens]
        # hand-computed bytes: each admission moves one head's K+V slice of one block; a first
        # decode loads the active block's tokens; each filled block goes to the host whole,
        # any other decoded token alone (write-through)
        first_loads = sum(pos % 16 for _, pos, fresh, _ in decodes if fresh)
        assert step.h2d_bytes == step.admitted * head_block_bytes + first_loads * token_bytes
        fills = sum((pos + 1) % 16 == 0 for _, pos, _, _ in decodes)
        assert step.d2h_bytes == fills * fill_bytes + (len(decodes) - fills) * token_bytes
        seeded = [d for d in decodes if d[3]]
        if seeded and len(seeded) == len(decodes):
            assert step.admitted <= cap * cfg.num_kv_heads * cfg.num_layers * len(seeded)


@pytest.mark.parametrize("predictor", ["lookahead", "exact"])
def test_sink_and_recent_blocks_stay_in_every_working_set(tiny_llama, predictor):
    sink, recent = 2, 1
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=4, f_hbm=0.25, sink_blocks=sink,
              recent_blocks=recent, predictor=predictor, max_num_seqs=2)
    e = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for p in prompts_of([100, 130], e.model_config.vocab_size):
        e.add_request(p, params)
    checked = 0
    while e.has_unfinished():
        e.step()
        check_working_sets(e)
        for seq in e.scheduler.running:
            if seq.working_set is None:
                continue
            n_full = seq.num_computed_tokens // 16
            pinned = set(range(sink)) | set(range(n_full - recent, n_full))
            for layer_map in seq.working_set.head_map:  # [K, Hkv]
                for g in range(layer_map.shape[1]):
                    assert pinned <= set(layer_map[:, g].tolist())
            checked += 1
    assert checked > 40


def test_pinned_blocks_must_leave_room_for_selection():
    with pytest.raises(ValueError, match="sink_blocks \\+ recent_blocks"):
        CacheConfig(kv_mode="sparse", top_k=4, sink_blocks=2, recent_blocks=2)


def test_one_token_prefill_chunks_summarize_the_blocks_they_complete(tiny_llama):
    """With a 2-token step budget and one request decoding, the other is prefilled one token
    per step: the chunks that complete a block must still write its summary. (The exact
    predictor makes the output independent of chunking: with lookahead, the extra decode-path
    step of the last prompt token changes the working-set history.)"""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    long = prompts_of([40], 300, seed=5)[0]
    sparse = dict(kv_mode="sparse", top_k=1, predictor="exact")
    alone = run(LLM(str(tiny_llama), **sparse), [long], params)[0]
    llm = LLM(str(tiny_llama), max_num_batched_tokens=2, **sparse)
    e = llm.engine
    e.add_request([3, 4], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    rid = e.add_request(long, params)
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            outs[o.request_id] = o
        check_working_sets(e)
    assert outs[rid].token_ids == alone.token_ids


def test_small_budgets_make_requests_wait_and_lose_nothing(tiny_llama):
    """Sparse requests reserve their host history and one slab at admission: with budgets for
    one request at a time, the others wait (no preemption, which would recompute and lose the
    working-set history) and every output equals the large-budget run."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = prompts_of([60, 45, 70], 300, seed=3)
    big = LLM(str(tiny_llama), kv_mode="sparse", top_k=2, max_num_batched_tokens=32, rerank=0)
    want = run(big, prompts, params)
    per_block = big.engine.bytes_per_block
    # host: up to 100 tokens = 7 blocks per request -> one at a time; device: one slab (3
    # blocks) plus one block for the summaries of up to 16 blocks -> one at a time
    small = LLM(str(tiny_llama), kv_mode="sparse", top_k=2, max_num_batched_tokens=32,
                host_kv_budget=8 * per_block, device_kv_budget=7 * per_block,
                rerank=0)  # counted without the key copy
    peak_running = 0
    e = small.engine
    ids = [e.add_request(p, params) for p in prompts]
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            outs[o.request_id] = o
        peak_running = max(peak_running, len(e.scheduler.running))
    assert [outs[i].token_ids for i in ids] == [o.token_ids for o in want]
    assert peak_running == 1 and small.stats()["preemptions"] == 0


def test_dense_small_device_budget_preempts_and_loses_nothing(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = prompts_of([60, 45, 70], 300, seed=3)
    want = run(LLM(str(tiny_llama)), prompts, params)
    per_block = LLM(str(tiny_llama)).engine.bytes_per_block
    small = LLM(str(tiny_llama), device_kv_budget=12 * per_block, max_num_batched_tokens=32)
    assert [o.token_ids for o in run(small, prompts, params)] == [o.token_ids for o in want]
    assert small.stats()["preemptions"] > 0


@pytest.mark.parametrize("speculative", ["off", "accept"])
def test_a_reset_mid_block_reloads_the_generated_tokens_from_the_host(tiny_llama, speculative):
    """A prefetch stage failing for one request fails its batch's step and drops the working
    sets of all the batch's requests; the innocent ones reload their active block from the
    host, which must hold the tokens they generated in it so far (and an accepted draft's). K
    covers every block: the outputs must equal dense."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = prompts_of([40, 50, 70], 320, seed=6)
    want = LLM(str(tiny_llama)).generate([prompts[0], prompts[2]], params, use_tqdm=False)
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=16, max_num_seqs=3,
              speculative=speculative)
    e = llm.engine

    def fault(layer, seqs):
        if any(s.request_id == "bad" and s.num_output_tokens >= 7 for s in seqs):
            raise OSError("injected fetch fault")

    e.sparse.stage_hooks["select"] = fault
    for rid, p in zip(["a", "bad", "c"], prompts, strict=True):
        e.add_request(p, params, request_id=rid)
    outs = {}
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    assert outs["bad"].finish_reason == "error" and e.counters["step_failures"] >= 2
    assert [outs["a"].token_ids, outs["c"].token_ids] == [o.token_ids for o in want]


def test_mixed_queries_are_the_probability_weighted_mean_of_the_drafts():
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])  # [m=2, H=1, d=2]

    def mixed(queries, weights):  # one request
        return mixed_queries(queries[None], [weights])[0]

    assert torch.equal(mixed(q, [3.0, 1.0]), torch.tensor([[0.75, 0.5]]))
    assert torch.equal(mixed(q, [0.3, 0.1]), torch.tensor([[0.75, 0.5]]))  # normalised
    assert torch.equal(mixed(q, None), torch.tensor([[0.5, 1.0]]))  # no weights: equal
    assert torch.equal(mixed(q[:1], [0.2]), q[0])  # one draft: its own query
    # a batch: each request its own weights, in one pass
    both = mixed_queries(torch.stack([q, q]), [[3.0, 1.0], None])
    assert torch.equal(both, torch.tensor([[[0.75, 0.5]], [[0.5, 1.0]]]))
