"""Drafters' unit behaviour, and drafts riding along in the engine."""

import pytest
import torch
from conftest import KnownAndDecoy
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv import LLM, SamplingParams
from oasiskv.spec.drafters import (
    NgramDrafter,
    ResyncDrafter,
    SelfDrafter,
    _fill,
    make_drafter,
    sampling_weights,
)


def logits_favouring(*tokens, vocab=50):
    out = torch.zeros(vocab)
    for rank, t in enumerate(tokens):
        out[t] = 10.0 - rank
    return out


def test_self_takes_the_draft_rows_argmax_and_top_n():
    d = SelfDrafter()
    assert d.propose([1, 2, 3], logits_favouring(7, 9), prev_draft=4) == [7]
    assert d.propose([1, 2, 3], logits_favouring(7, 9), prev_draft=4, num=2) == [7, 9]


def test_drafters_weigh_their_guesses_by_their_probabilities():
    logits = logits_favouring(7, 9)
    p = torch.softmax(logits, -1)
    guesses, probs = SelfDrafter().propose_weighted([1, 2, 3], logits, prev_draft=4, num=2)
    assert guesses == [7, 9] and probs == pytest.approx([float(p[7]), float(p[9])])
    assert NgramDrafter().propose_weighted([5, 6, 5], None, None) == ([6], None)  # it has none
    # resync: the self chain's probabilities while in sync, none after a miss (lookup)
    assert ResyncDrafter().propose_weighted([4, 5], logits, prev_draft=5)[1] is not None
    assert ResyncDrafter().propose_weighted([4, 5, 4], logits, prev_draft=7) == ([5], None)


def test_self_without_draft_logits_falls_back_to_lookup_then_repetition():
    d = SelfDrafter()
    assert d.propose([5, 6, 5], None, None) == [6]  # "5" was followed by 6
    assert d.propose([5, 6, 7], None, None) == [7]  # nothing matches: repeat the newest


def test_ngram_prefers_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 4, 2, 3, 8, 1, 2, 3]
    # last 3 = (1, 2, 3): its earlier occurrence at 0 was followed by 9
    assert NgramDrafter().propose(tokens, None, None) == [9]
    # last 2 = (2, 3): latest earlier occurrence (at 5) was followed by 8
    assert NgramDrafter(sizes=(2,)).propose(tokens, None, None) == [8]
    # two guesses: the 3-gram's and then the 2-gram's
    assert NgramDrafter().propose(tokens, None, None, num=2) == [9, 8]


def lookup_reference(tokens, sizes=(3, 2, 1), num=1):
    """Prompt lookup by brute force: for each size, the token after the latest earlier
    occurrence of the last `size` tokens; padded as the drafter pads (`_fill`)."""
    guesses = []
    for n in sizes:
        tail = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tail]
        if len(tokens) > n and starts:
            guesses.append(tokens[starts[-1] + n])
            if len(set(guesses)) >= num:
                break
    return _fill(guesses, tokens, num)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 3))
def test_ngram_equals_brute_force_lookup_as_a_request_grows(tokens, num):
    """One request's growing token list (its cached array extended call by call), and a fresh
    drafter on the whole list, both equal the brute-force lookup."""
    d = NgramDrafter()
    for end in range(1, len(tokens) + 1, 3):
        assert d.propose(tokens[:end], None, None, num, "r") == lookup_reference(tokens[:end],
                                                                                 num=num)
    assert NgramDrafter().propose(tokens, None, None, num) == lookup_reference(tokens, num=num)
    d.release("r")
    assert d.propose([4, 4, 4], None, None, 1, "r") == [4]  # a new request, same id


def test_ngram_rebuilds_a_request_array_that_no_longer_matches():
    d = NgramDrafter()
    assert d.propose([1, 2], None, None, 1, "r") == [2]
    assert d.propose([5, 6, 5], None, None, 1, "r") == [6]  # not [1, 2, 5]: rebuilt


def test_ngram_falls_back_to_the_self_draft():
    assert NgramDrafter().propose([1, 2, 3], logits_favouring(11), None) == [11]


def test_resync_switches_to_lookup_after_a_miss():
    d = ResyncDrafter()
    tokens = [4, 5, 6, 4, 5]
    right, wrong = 5, 7  # the previous draft vs the token that came
    assert d.propose(tokens, logits_favouring(20), prev_draft=right) == [20]  # self chain
    assert d.propose(tokens, logits_favouring(20), prev_draft=wrong) == [6]  # lookup: 4 5 -> 6


def test_unknown_drafter_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown drafter 'eagle'"):
        make_drafter("eagle")


@pytest.mark.parametrize("predictor", ["lookahead", "previous", "exact"])
@pytest.mark.parametrize("drafter, num", [("self", 1), ("ngram", 1), ("resync", 2)])
def test_every_predictor_and_drafter_equals_dense_when_k_covers_all(tiny_llama, predictor,
                                                                     drafter, num):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(50, 61)) * 3]
    dense = LLM(str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=8, predictor=predictor,
              drafter=drafter, num_drafts=num)
    sparse = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in sparse] == [o.token_ids for o in dense]
    stats = llm.stats()
    if predictor == "lookahead":  # every decode step has its draft row (from ngram at first)
        assert stats["drafts"] == sum(len(o.token_ids) - 1 for o in sparse)
        assert 0 <= stats["drafts_right"] <= stats["drafts"]
        # each request counts its own drafts
        assert [o.metrics.num_drafts for o in sparse] == [len(o.token_ids) - 1 for o in sparse]
        assert sum(o.metrics.num_drafts_right for o in sparse) == stats["drafts_right"]
    else:
        assert stats["drafts"] == 0


def test_the_draft_chain_goes_on_from_the_draft_that_was_right(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = list(range(3, 40))
    dense = LLM(str(tiny_llama)).generate([prompt], params, use_tqdm=False)[0].token_ids
    decoy = next(t for t in range(5, 100) if t not in dense)
    # K covers every block: attention is exact, so a right draft row computes what the next
    # step computes
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=8, num_drafts=2)
    spy = llm.engine.drafter = KnownAndDecoy(len(prompt), dense, decoy, decoy_first=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == dense
    chained = [c for c in spy.calls if c[1] is not None]
    assert len(chained) == len(dense) - 2  # every decode step but the last proposes
    for tokens, logits, prev in chained:
        # the second draft was right, so the chain continues from its row: its draft and its
        # logits, whose argmax is the next greedy token
        assert prev == tokens[-1]
        assert int(logits.argmax()) == dense[len(tokens) - len(prompt)]
    assert llm.stats()["drafts_right"] == 0  # the first draft never was


def test_the_lookahead_mixes_drafts_by_their_chance_of_being_taken(tiny_llama):
    """Greedy: the first draft alone predicts, so a second one (the decoy) changes nothing the
    lookahead selects: the same tokens and traffic as one draft. Sampled: the drafts' mean,
    weighted by p^(1/T), so a decoy of probability 0 changes nothing, an equally likely one
    does."""
    prompt = [(7 * i) % 90 + 3 for i in range(100)]  # 6 blocks of 16, K=2: selections matter
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    dense = LLM(str(tiny_llama)).generate([prompt], greedy, use_tqdm=False)[0].token_ids
    decoy = next(t for t in range(5, 100) if t not in dense)

    def run(params, num, probs):
        llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=2, f_hbm=1.0, num_drafts=num)
        llm.engine.drafter = KnownAndDecoy(len(prompt), dense, decoy, False, probs)
        out = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        stats = llm.stats()
        assert stats["drafts"] > 0
        return out, stats["sparse_hits"], stats["sparse_admitted"], stats["sparse_h2d_bytes"]

    assert run(greedy, 1, None) == run(greedy, 2, None) == run(greedy, 2, [0.5, 0.5])
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    one = run(sampled, 1, None)
    assert one == run(sampled, 2, [0.9, 0.0]) != run(sampled, 2, [0.5, 0.5])


def test_sampling_weights_by_hand():
    assert sampling_weights([0.6, 0.3, 0.1], 3, 0.0) == [1.0, 0.0, 0.0]  # greedy: the first
    assert sampling_weights(None, 2, 0.0) == [1.0, 0.0]
    assert sampling_weights([0.5, 0.25], 2, 0.5) == [1.0, 0.25]  # (p / p_0)^(1/T)
    assert sampling_weights([0.5, 0.25], 2, 1.0) == [1.0, 0.5]
    assert sampling_weights(None, 2, 0.7) is None  # no probabilities: equal weights


def test_model_drafter_with_the_target_as_its_own_draft_is_always_right(tiny_llama):
    """The same weights as draft model: every draft is the target's greedy next token, so
    speculative acceptance keeps them all and the output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(3, 40)), list(range(60, 75))]
    plain = LLM(str(tiny_llama)).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), speculative="accept", drafter="model",
              draft_model=str(tiny_llama))
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["drafts"] > 0 and stats["drafts_right"] == stats["drafts"]
    assert [o.metrics.draft_accuracy for o in spec] == [1.0, 1.0]
    assert not llm.engine.drafter.seqs  # finished requests released their draft KV
    assert llm.engine.drafter.engine.pool.num_used == 0


def test_model_drafter_needs_a_model_with_the_same_vocabulary(tiny_llama, tmp_path):
    from conftest import build_model_dir

    other = build_model_dir(tmp_path, "llama", vocab_size=400)
    with pytest.raises(ValueError, match="must share the tokenizer"):
        LLM(str(tiny_llama), speculative="accept", drafter="model", draft_model=str(other))
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(str(tiny_llama), speculative="accept", drafter="model")
