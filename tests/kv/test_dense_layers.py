"""dense_layers=N (sparse mode): the first N layers attend to their whole context from a device
copy of their K/V charged to device_kv_budget; the other layers keep their working sets.

References: dense mode (tokens, and each layer's attention output hooked step by step), the
budget's bytes written out by hand, and a dense engine's tokens for requests that reuse ended
requests' blocks. The tiny models (tests/conftest.py): 2 or 3 layers, 2 KV heads, head_dim 16,
float32, block 16, context 512.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_model_dir

from oasiskv import LLM, SamplingParams
from oasiskv.context import get_context
from oasiskv.engine.invariants import InvariantError

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
KiB = 1024


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory) -> str:
    """A 3-layer tiny model: two dense layers and one sparse one."""
    return str(build_model_dir(tmp_path_factory.mktemp("tiny3"), num_hidden_layers=3))


def prompts(vocab: int, lengths=(5, 30, 47, 90)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def generate(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]


# ---------------------------------------------------------------- equal to dense


@pytest.mark.parametrize("options", [
    {"dense_layers": 1},
    {"dense_layers": 2, "prefetch": "async"},
    {"dense_layers": 1, "speculative": "accept"},  # accepted drafts' K/V: commit_draft
    {"dense_layers": 2, "predictor": "exact", "rerank": 2, "rerank_source": "int8"},
])
def test_k_covering_every_block_equals_dense(tiny3, options):
    kw = dict(max_num_batched_tokens=48, max_num_seqs=4)
    dense = LLM(tiny3, **kw)
    ps = prompts(dense.engine.model_config.vocab_size)
    want = generate(dense, ps)
    sparse = LLM(tiny3, kv_mode="sparse", top_k=16, **kw, **options)  # 256 > 120 tokens
    assert generate(sparse, ps) == want
    stats = sparse.stats()
    assert stats["sparse_wanted"] == stats["sparse_admitted"] > 0
    assert stats["dense_layers"] == options["dense_layers"]
    if "speculative" in options:  # accepted drafts' K/V went to the dense copy too
        assert stats["spec_accepted"] > 0
    sparse.engine.check_invariants()
    assert stats["dense_layer_bytes_used"] == 0  # every request ended: nothing held


def test_given_prefix_kv_reaches_the_dense_copy(tiny3):
    """A prefix's K/V computed elsewhere is written to the dense layers' copy too: the same
    tokens as dense mode prefilling the whole prompt."""
    dense = LLM(tiny3)
    prompt = prompts(dense.engine.model_config.vocab_size, (120,))[0]
    want = generate(dense, [prompt])[0]
    prefix = dense.engine.compute_prefix_kv(prompt[:100])
    sparse = LLM(tiny3, kv_mode="sparse", top_k=16, dense_layers=2)
    e = sparse.engine
    rid = e.add_request(prompt, GREEDY, prefix_kv=prefix)
    e.step()
    e.check_invariants()  # the dense copy holds what the host tier holds
    out = None
    while e.has_unfinished():
        out = next((o for o in e.step() if o.request_id == rid and o.finished), out)
    assert out.token_ids == want


# ---------------------------------------------------------------- dense layers attend densely


def attention_outputs(llm: LLM, prompt: list[int], forced: list[int]) -> list[dict]:
    """Runs one teacher-forced request; per decode step, each layer's attention output of the
    normal row and of its draft row (if any): [{layer: (normal [H*d], draft [H*d] | None)}]."""
    steps: list[dict] = []

    def hook(layer: int):
        def record(module, args, out):  # noqa: ANN001, ANN202
            seq = get_context().seqs[0]
            if seq.num_queries != 1:
                return  # the prefill
            if layer == 0:
                steps.append({})
            draft = out[seq.draft_rows[0]].clone() if seq.draft_rows else None
            steps[-1][layer] = (out[seq.q_start].clone(), draft)
        return record

    handles = [a.register_forward_hook(hook(i))
               for i, a in enumerate(llm.engine.model.attention_layers())]
    params = SamplingParams(max_tokens=len(forced), forced_tokens=forced)
    llm.generate([prompt], params, use_tqdm=False)
    for h in handles:
        h.remove()
    return steps


def test_dense_layers_attend_as_dense_mode_and_the_sparse_layer_does_not(tiny3):
    """3 layers, dense_layers=2, top_k=1 over 12+ blocks: at every decode step layers 0 and 1
    give dense mode's attention output for the step's token, and the lookahead's draft row
    (the next forced token, at the next position) gives what dense mode gives that token at
    the next step: the whole context and its own K/V. Layer 2 (sparse) differs."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 300, (200,), generator=g).tolist()
    forced = torch.randint(3, 300, (24,), generator=g).tolist()
    want = attention_outputs(LLM(tiny3, max_num_batched_tokens=512), prompt, forced)
    got = attention_outputs(LLM(tiny3, kv_mode="sparse", top_k=1, dense_layers=2,
                                max_num_batched_tokens=512), prompt, forced)
    assert len(got) == len(want) == len(forced) - 1  # the first output comes from prefill
    for t, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        for layer in (0, 1):
            normal, draft = g_step[layer]
            torch.testing.assert_close(normal, w_step[layer][0])
            if t + 1 < len(want):
                torch.testing.assert_close(draft, want[t + 1][layer][0])
    diff = max((g_step[2][0] - w_step[2][0]).abs().max().item()
               for g_step, w_step in zip(got, want, strict=True))
    assert diff > 1e-2


# ---------------------------------------------------------------- the device budget


def engine_for(path: str, **kw):  # noqa: ANN201
    """Counted by hand without the rerank's key copy (rerank=0; charged in test_scoring)."""
    return LLM(path, kv_mode="sparse", top_k=2, max_num_seqs=16, max_num_batched_tokens=1024,
               rerank=0, **kw).engine


def test_the_dense_copy_is_charged_per_block_of_each_history(tiny_llama):
    """tiny_llama, dense_layers=1: layer 0's K/V of a block, 1 x 2 (K, V) x 2 KV heads x 16
    tokens x 16 x 4 B = 4096 B, sits beside the block's summary (kmin/kmax of the one sparse
    layer in bfloat16: 2 x 2 x 16 x 2 = 128 B); a slab block holds the sparse layer only (4096
    B). One request of 40 + 8 tokens (3 blocks) holds its slab of 4 blocks and 3 blocks of
    summaries and dense copy: its dense layer's whole context, 1 x 48 x 2 x 2 x 16 x 4 B."""
    e = engine_for(tiny_llama, dense_layers=1, device_kv_budget=256 * KiB,
                   host_kv_budget=1024 * KiB)
    dense_kv, host_kv = e.runner.dense_kv, e.runner.host_kv
    assert dense_kv.shape == (1, 2, 2, e.kv.summary_pool.num_blocks * 16, 16)
    # a tensor of its own, not the host tier read in place; layer 0 reads it
    assert dense_kv.untyped_storage().data_ptr() != host_kv.untyped_storage().data_ptr()
    layer0 = e.model.attention_layers()[0].pools
    assert "device" not in layer0
    assert layer0["dense"][0].untyped_storage().data_ptr() == \
        dense_kv.untyped_storage().data_ptr()
    s = e.stats()
    assert s["dense_layer_bytes_per_block"] == 4096 and s["kv_bytes_per_block"] == 4096
    assert s["summary_bytes_per_block"] == 128 + 4096
    total = sum(t.numel() * t.element_size() for t in
                (e.runner.device_kv, e.sparse.kmin, e.sparse.kmax, dense_kv))
    assert s["device_bytes_allocated"] == total <= 256 * KiB
    e.add_request(list(range(10, 50)), SamplingParams(max_tokens=8, ignore_eos=True))
    e.step()
    s = e.stats()
    assert s["dense_layer_bytes_used"] == 1 * 48 * 2 * 2 * 16 * 4
    assert s["device_bytes_used"] == 4 * 4096 + 3 * (128 + 4096)
    while e.has_unfinished():
        e.step()
    assert e.stats()["dense_layer_bytes_used"] == e.stats()["device_bytes_used"] == 0


def first_step_running(e, requests: int) -> int:  # noqa: ANN001
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(requests):
        e.add_request(list(range(10 + i, 50 + i)), params)  # 40 + 8 tokens: 3 blocks
    e.step()
    e.check_invariants()
    return len(e.scheduler.running)


@pytest.mark.parametrize("dense_layers, budget, blocks, ids, running", [
    # 256 KiB split as a whole-context request (32 blocks): without dense layers (as in
    # test_device_budget.py) a slab of 4 x 8192 B and 32 summaries of 256 B: 25 KV blocks
    # and room for 224 summaries, capped to the host tier's 128; then 28 KV blocks, 7 slabs
    (0, 256, 28, 128, 7),
    # dense_layers=1: 4 x 4096 + 32 x (128 + 4096) = 151552 B a request; KV blocks
    # 262144 * 4 // 151552 = 6, room for (262144 - 6 x 4096) // 4224 = 56 summaries (under
    # the host's 128), KV blocks (262144 - 56 x 4224) // 4096 = 6: one slab at a time
    (1, 256, 6, 56, 1),
    # 512 KiB: without dense layers 51 KV blocks, room for 416 summaries, capped to 128, then
    # 60 KV blocks: 15 slabs (all 10 requests); dense_layers=1: 524288 * 4 // 151552 = 13 KV
    # blocks, room for (524288 - 13 x 4096) // 4224 = 111 summaries, then
    # (524288 - 111 x 4224) // 4096 = 13 KV blocks: 3 slabs
    (0, 512, 60, 128, 10),
    (1, 512, 13, 111, 3),
])
def test_dense_layers_admit_what_the_budget_holds_beside_their_copy(tiny_llama, dense_layers,
                                                                     budget, blocks, ids,
                                                                     running):
    e = engine_for(tiny_llama, dense_layers=dense_layers, device_kv_budget=budget * KiB,
                   host_kv_budget=1024 * KiB)
    assert (e.pool.num_blocks, e.sparse.kmin.shape[1]) == (blocks, ids)
    assert first_step_running(e, 10) == running


# ---------------------------------------------------------------- invariants: nothing leaks


def test_random_finishes_and_aborts_leave_no_dense_blocks_behind(tiny3):
    """Requests end at random (finished or aborted, mid-prefill or mid-decode) while new ones
    take their blocks: the invariants hold after every step (the dense copy equals the host
    tier for every running request's computed tokens), the requests that finish give dense
    mode's tokens (no stale K/V of an ended request in their blocks), and at the end nothing
    is held."""
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    kw = dict(max_num_batched_tokens=64, max_num_seqs=3)
    sparse = LLM(tiny3, kv_mode="sparse", top_k=16, dense_layers=2, device_kv_budget="4MiB",
                 host_kv_budget="2MiB", **kw)
    e = sparse.engine
    todo = [(torch.randint(3, 300, (rng.randint(5, 120),), generator=g).tolist(),
             SamplingParams(temperature=0, max_tokens=rng.randint(2, 25), ignore_eos=True))
            for _ in range(14)]
    dense = LLM(tiny3, **kw)
    want = {str(i): dense.generate([p], sp, use_tqdm=False)[0].token_ids
            for i, (p, sp) in enumerate(todo)}
    done, aborted, added = {}, set(), 0
    while added < len(todo) or e.has_unfinished():
        while added < len(todo) and len(e.requests) < 4:
            e.add_request(*todo[added], request_id=str(added))
            added += 1
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        live = list(e.requests)
        if live and rng.random() < 0.08:
            rid = rng.choice(live)
            e.abort(rid)
            aborted.add(rid)
        e.check_invariants()
    finished = {rid: t for rid, t in done.items() if rid not in aborted}
    assert len(aborted) >= 2 and len(finished) >= 6
    assert all(t == want[rid] for rid, t in finished.items())
    s = sparse.stats()
    assert s["dense_layer_bytes_used"] == s["device_bytes_used"] == s["host_blocks_used"] == 0


def test_invariants_name_a_stale_dense_copy_and_an_uncharged_one(tiny3):
    sparse = LLM(tiny3, kv_mode="sparse", top_k=2, dense_layers=2, device_kv_budget="1MiB")
    e = sparse.engine
    e.add_request(list(range(10, 60)), GREEDY)
    for _ in range(3):
        e.step()
    e.check_invariants()
    seq = next(iter(e.requests.values()))
    slot = seq.host_table[1] * 16 + 3  # a computed token's
    dense_kv = e.runner.dense_kv
    kept = dense_kv[1, 0, :, slot].clone()
    dense_kv[1, 0, :, slot] += 1  # a write that missed the copy
    with pytest.raises(InvariantError, match="dense layers' device copy differs"):
        e.check_invariants()
    dense_kv[1, 0, :, slot] = kept
    e.check_invariants()
    e.runner.dense_kv = torch.zeros(2, 2, 2, dense_kv.shape[3] + 16 * 512, 16)  # uncharged
    with pytest.raises(InvariantError, match="more than device_kv_budget.*\n.*summary ids"):
        e.check_invariants()
    e.runner.dense_kv = dense_kv
    while e.has_unfinished():
        e.step()
    e.check_invariants()
