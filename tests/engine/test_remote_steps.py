"""`engine/remote_steps.py` at admission: what needs a remote store, prefix reuse, and the
checks and host budget of a handed-over request (each step's traffic is covered end to end
in tests/disagg and tests/engine/test_faults.py)."""

from __future__ import annotations

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.disagg.pd import DisaggregatedLLM
from oasiskv.engine import remote_steps
from oasiskv.kv.host_cache import prompt_capacity

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
