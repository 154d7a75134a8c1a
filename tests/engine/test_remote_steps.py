"""`engine/remote_steps.py` at admission: what needs a remote store, prefix reuse (across
engines on one store, after the request that cached it ended), the store's capacity as an
admission limit, and the checks and host budget of a handed-over request (each step's
traffic is covered end to end in tests/disagg and tests/engine/test_faults.py)."""

from __future__ import annotations

import uuid

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.disagg.pd import DisaggregatedLLM
from oasiskv.engine import remote_steps
from oasiskv.kv.host_cache import prompt_capacity
from oasiskv.kv.prefix_cache import is_entry
from oasiskv.kv.remote_tier import open_store

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SPARSE = dict(kv_mode="sparse", top_k=2, f_hbm=0.5, max_num_seqs=3, max_num_batched_tokens=640)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def handoff(tiny_llama):
    pd = DisaggregatedLLM(str(tiny_llama), transfer="partial", **SPARSE)
    pd.generate([prompt(100)], GREEDY, use_tqdm=False)
    h = next(iter(pd.handoffs.values()))
    pd.close()
    return h


def test_a_hand_over_needs_a_remote_store(tiny_llama, handoff):
    for kw in ({}, SPARSE):  # dense; sparse on one node
        engine = LLM(str(tiny_llama), **kw).engine
        with pytest.raises(ValueError, match="a hand-over needs kv_mode=sparse and a "
                                             "remote_store"):
            engine.add_request(prompt(20), GREEDY, transfer="partial")
        with pytest.raises(ValueError, match="a handed-over request needs kv_mode=sparse"):
            engine.add_handoff(handoff, GREEDY)
    remote = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess").engine
    with pytest.raises(ValueError, match=r"transfer must be one of \('partial', 'slab', "
                                         r"'full'\), got 'half'"):
        remote.add_request(prompt(20), GREEDY, transfer="half")
    assert not remote.has_unfinished()


def test_a_handed_over_request_continues_with_its_budget(tiny_llama, handoff):
    engine = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess", f_host=0.5).engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seq = remote_steps.handoff_sequence(engine, handoff, params)
    P = handoff.num_prompt_tokens // 16
    max_context = handoff.num_prompt_tokens + 10
    # the host cache's share of the prompt (f_host, at least the working sets) + the rest
    want = prompt_capacity(0.5, P, 2 * 2) + -(-max_context // 16) - P
    assert seq.host_budget == want and seq.max_context == max_context
    assert seq.token_ids == handoff.token_ids and seq.handoff is handoff
    assert seq.num_computed_tokens == handoff.num_computed_tokens
    assert not engine.requests  # not added yet


@pytest.mark.parametrize("kw, match", [
    (dict(top_k=3), "has working sets of top_k 2, this engine's top_k is 3"),
    (dict(block_size=8), "block 16; this engine has 2 x 2 x 16, block 8"),
])
def test_a_hand_over_from_another_setting_is_refused(tiny_llama, handoff, kw, match):
    engine = LLM(str(tiny_llama), **{**SPARSE, **kw}, remote_store="inprocess").engine
    with pytest.raises(ValueError, match=match):
        remote_steps.handoff_sequence(engine, handoff, GREEDY)


def test_a_hand_over_with_nothing_left_to_decode_is_refused(tiny_llama, handoff):
    engine = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess").engine
    done = SamplingParams(max_tokens=len(handoff.token_ids) - handoff.num_prompt_tokens)
    with pytest.raises(ValueError, match="nothing left to decode"):
        remote_steps.handoff_sequence(engine, handoff, done)


def test_reuse_prefix_reads_complete_prompt_blocks_from_the_store(tiny_llama):
    llm = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess", f_host=0.5)
    e = llm.engine
    shared = prompt(64, seed=3)  # 4 complete blocks
    e.add_request(shared + prompt(10, seed=4), GREEDY, request_id="first")
    while e.requests["first"].host_cache is None:
        e.step()
    seq = e.make_sequence(shared + prompt(20, seed=5), GREEDY)
    remote_steps.reuse_prefix(e, seq)
    assert seq.num_computed_tokens == 64 and e.counters["prefix_reused_tokens"] == 64
    want = LLM(str(tiny_llama)).engine.compute_prefix_kv(shared)  # dense, computed anew
    torch.testing.assert_close(seq.prefix_kv, want, atol=1e-5, rtol=1e-5)
    handed = e.make_sequence(shared + prompt(20, seed=5), GREEDY)
    handed.handoff = object()  # a hand-over brings its own K/V: nothing is reused
    remote_steps.reuse_prefix(e, handed)
    assert handed.num_computed_tokens == 0 and handed.prefix_kv is None


def shared_store(name: str, capacity_blocks: int | None = None):
    """The tiny model's `inprocess://NAME` store, opened first (to set its capacity: room for
    that many prompt blocks, both layers); keep it referenced while the engines use it."""
    store = open_store(name, (2, 2, 16, 16), torch.float32)
    if capacity_blocks is not None:
        store.capacity_bytes = capacity_blocks * 2 * store.block_bytes
    return store


def test_a_prefix_one_engine_cached_is_reused_by_another_after_its_request_ended(tiny_llama):
    name = f"inprocess://pc-{uuid.uuid4().hex[:8]}"
    store = shared_store(name)
    shared = prompt(80, seed=11)  # 5 complete blocks
    prompts = [shared + prompt(30, seed=12), shared + prompt(25, seed=13)]
    ref = LLM(str(tiny_llama), **SPARSE)  # no store: every prompt computed
    want = [ref.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    first = LLM(str(tiny_llama), **SPARSE, remote_store=name, f_host=0.5)
    assert first.generate([prompts[0]], GREEDY, use_tqdm=False)[0].token_ids == want[0]
    # its request ended: what stays is the prefix cache, its 6 complete prompt blocks
    assert len(store.namespaces()) == 6 and all(map(is_entry, store.namespaces()))
    assert first.stats()["prefix_cache_bytes"] == 6 * 2 * store.block_bytes
    second = LLM(str(tiny_llama), **SPARSE, remote_store=name, f_host=0.5)
    assert second.generate([prompts[1]], GREEDY, use_tqdm=False)[0].token_ids == want[1]
    e = second.engine
    assert e.counters["prefix_reused_tokens"] == 80
    assert e.counters["prefill_tokens"] == len(prompts[1]) - 80  # the rest only
    assert first.engine.counters["prefix_reused_tokens"] == 0
    # the second cached only the block the first had not: 6 + 1 entries
    assert len(store.namespaces()) == 7 and len(e.remote.prefix.lru) == 1
    first.engine.check_invariants()
    e.check_invariants()


def test_a_prompt_the_full_store_cannot_take_fails_clearly_and_alone(tiny_llama):
    name = f"inprocess://full-{uuid.uuid4().hex[:8]}"
    store = shared_store(name, capacity_blocks=8)
    llm = LLM(str(tiny_llama), **SPARSE, remote_store=name, prefix_cache_bytes=0)
    big, small = prompt(100, seed=1), prompt(60, seed=2)  # 6 and 3 complete blocks
    ref = LLM(str(tiny_llama), **SPARSE)
    want = [ref.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in (big, small)]
    e = llm.engine
    e.add_request(big, GREEDY, request_id="big")
    e.add_request(small, GREEDY, request_id="small")
    outs = {}
    while e.has_unfinished():
        outs.update({o.request_id: o for o in e.step() if o.finished})
        e.check_invariants()
    assert outs["big"].token_ids == want[0] and outs["big"].finish_reason == "length"
    fail = outs["small"]
    assert fail.finish_reason == "error" and fail.retryable
    assert "remote store is full" in fail.error
    assert f"capacity {8 * 2 * store.block_bytes} bytes" in fail.error
    assert not store.namespaces()  # nothing of either is left
    # once the store has room again the same prompt goes through
    assert llm.generate([small], GREEDY, use_tqdm=False)[0].token_ids == want[1]
    # a prompt larger than the whole store is refused at admission
    with pytest.raises(ValueError, match=f"need {9 * 2 * store.block_bytes} bytes of the "
                                         f"remote store, whose capacity is"):
        e.add_request(prompt(150, seed=3), GREEDY)
