"""`engine/drafting.py`: which drafter an engine gets, forced tokens, counting, accepting and
proposing drafts, each against a hand-written expectation (the end-to-end behaviour of drafts
and speculative acceptance is in tests/spec)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from oasiskv import SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.engine import drafting
from oasiskv.engine.weights import load_model
from oasiskv.sequence import Sequence
from oasiskv.spec.drafters import Drafter, NgramDrafter, SelfDrafter


class Scripted(Drafter):
    """Proposes `guesses` with `probs` (or raises them), recording each call."""

    name = "scripted"

    def __init__(self, guesses, probs=None):
        self.guesses, self.probs, self.calls = guesses, probs, []

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        self.calls.append((list(tokens), draft_logits, prev_draft, num, request_id))
        if isinstance(self.guesses, Exception):
            raise self.guesses
        return self.guesses[:num], self.probs


def seq_of(outputs: list[int], draft_tokens=(), **params) -> Sequence:
    prompt = [3, 4, 5]
    seq = Sequence("r", prompt + outputs, len(prompt), SamplingParams(**params))
    seq.draft_tokens = list(draft_tokens)
    return seq


def engine_of(drafter=None, forced_drafts="guessed", num_drafts=1):
    return SimpleNamespace(
        counters={"drafts": 0, "drafts_right": 0, "decode_tokens": 0, "spec_accepted": 0},
        drafter=drafter, speculative=True,
        config=SimpleNamespace(spec=SimpleNamespace(forced_drafts=forced_drafts,
                                                    num_drafts=num_drafts)),
        runner=SimpleNamespace(committed=[], commit_draft=lambda s: None),
        _generator=lambda seq: torch.Generator().manual_seed(0))


def test_the_engine_gets_a_drafter_only_where_a_draft_is_read(tiny_llama):
    def built(**kw):
        config = EngineConfig.from_kwargs(model=str(tiny_llama), **kw)
        model, mc, _ = load_model(config)
        return drafting.build_drafter(config, mc, model, make_engine=None)

    assert built() is None  # dense, no speculation
    assert built(kv_mode="sparse", predictor="previous") is None
    assert isinstance(built(kv_mode="sparse", drafter="ngram"), NgramDrafter)  # lookahead
    assert isinstance(built(speculative="accept", drafter="self"), SelfDrafter)


def test_forced_tokens_are_taken_in_order_then_none():
    forced = [7, 8]
    assert drafting.forced_token(seq_of([], forced_tokens=forced)) == 7
    assert drafting.forced_token(seq_of([7], forced_tokens=forced)) == 8
    assert drafting.forced_token(seq_of([7, 8], forced_tokens=forced)) is None
    assert drafting.forced_token(seq_of([])) is None


def test_count_adds_a_draft_and_whether_it_was_right():
    engine = engine_of()
    right, wrong = seq_of([9], draft_tokens=[9, 2]), seq_of([9], draft_tokens=[2, 9])
    drafting.count(engine, right, 9)
    assert engine.counters["drafts"] == engine.counters["drafts_right"] == 1
    drafting.count(engine, wrong, 9)
    assert engine.counters["drafts"] == 2 and engine.counters["drafts_right"] == 1
    assert (right.metrics.num_drafts, right.metrics.num_drafts_right) == (1, 1)
    assert (wrong.metrics.num_drafts, wrong.metrics.num_drafts_right) == (1, 0)


def test_accept_commits_the_draft_and_advances_one_token():
    engine = engine_of(Scripted([1]))
    engine.drafter.observed = []
    engine.drafter.observe = lambda rid, start, f: engine.drafter.observed.append((start, f))
    committed = []
    engine.runner.commit_draft = committed.append
    seq = seq_of([9], draft_tokens=[9])
    seq.num_computed_tokens = 3
    feats = torch.arange(6.0).view(2, 3)  # [rows, F]: the accepted row first
    drafting.accept(engine, seq, feats)
    assert committed == [seq] and seq.num_computed_tokens == 4
    assert engine.counters["decode_tokens"] == engine.counters["spec_accepted"] == 1
    assert engine.drafter.observed[0][0] == 3
    assert torch.equal(engine.drafter.observed[0][1], feats[:1])


def test_propose_chains_from_the_draft_row_that_was_right():
    drafter = Scripted([11, 12], probs=[0.5, 0.25])
    engine = engine_of(drafter, num_drafts=2)
    seq = seq_of([6], draft_tokens=[5, 6], temperature=1.0)
    rows = torch.stack([torch.full((4,), 1.0), torch.full((4,), 2.0)])  # [drafts, V]
    drafting.propose(engine, seq, 6, accepted=False, draft_row=rows)
    tokens, chain, prev, num, rid = drafter.calls[0]
    assert torch.equal(chain, rows[1]) and prev == 6 and num == 2 and rid == "r"
    assert seq.draft_tokens == [11, 12] and seq.draft_weights == [1.0, 0.5]
    drafting.propose(engine, seq, 13, accepted=True, draft_row=rows)  # accepted: no chain
    assert drafter.calls[1][1] is None and drafter.calls[1][2] == 11  # the first: a miss


def test_a_known_next_token_is_the_draft_and_a_failing_drafter_drafts_nothing():
    engine = engine_of(Scripted([11]), forced_drafts="known")
    seq = seq_of([7], forced_tokens=[7, 8])
    drafting.propose(engine, seq, 7, accepted=False, draft_row=None)
    assert seq.draft_tokens == [8] and not engine.drafter.calls
    failing = engine_of(Scripted(RuntimeError("boom")))
    seq = seq_of([7], draft_tokens=[7])
    drafting.propose(failing, seq, 7, accepted=False, draft_row=None)
    assert seq.draft_tokens == [] and seq.draft_weights is None


def test_verify_reports_an_error_for_its_request_alone():
    engine = engine_of()
    seq = seq_of([1], draft_tokens=[4], temperature=0)
    logits = torch.zeros(8)
    logits[4] = 5.0
    assert drafting.verify(engine, logits, seq) == (4, True)  # greedy: the draft is the argmax
    logits[4], logits[2] = 0.0, 5.0
    assert drafting.verify(engine, logits, seq) == (2, False)
    seq.draft_tokens = []  # no draft to verify: an IndexError, returned
    token, accepted = drafting.verify(engine, logits, seq)
    assert isinstance(token, IndexError) and accepted is False


@pytest.mark.parametrize("fails", [False, True])
def test_release_drops_the_requests_state_and_never_raises(fails):
    released = []

    class Releasing(Scripted):
        def release(self, request_id):
            if fails:
                raise RuntimeError("gone")
            released.append(request_id)

    drafting.release(Releasing([1]), seq_of([]))
    assert released == ([] if fails else ["r"])
