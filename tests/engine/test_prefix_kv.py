"""Prefill once, decode many ways: a prefix K/V computed by one engine and handed to another
gives the outputs of a normal prefill; teacher-forced decoding reports the log-probabilities
HF transformers computes for the same continuation."""

import random

import pytest
import torch
import transformers

from oasiskv import LLM, SamplingParams
from oasiskv.eval.fidelity import decode_all

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SPARSE = dict(kv_mode="sparse", top_k=3, f_hbm=0.5)


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 300) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, ids: list[list[int]], params: SamplingParams, kvs=None) -> list:
    kvs = kvs or [None] * len(ids)
    return decode_all(llm.engine, [(p, params, kv) for p, kv in zip(ids, kvs, strict=True)])


@pytest.mark.parametrize("mode", [{}, SPARSE], ids=["dense", "sparse"])
def test_prefix_kv_from_another_engine_gives_the_same_outputs(tiny_llama, mode):
    ids = prompts(3, 90)
    source = LLM(str(tiny_llama), max_num_batched_tokens=32)  # chunked: 3 chunks of 32
    kvs = [source.engine.compute_prefix_kv(p[:-1]) for p in ids]
    assert kvs[0].shape[3] == 89
    ref = run(LLM(str(tiny_llama), **mode), ids, GREEDY)
    llm = LLM(str(tiny_llama), **mode)
    got = run(llm, ids, GREEDY, kvs)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert llm.stats()["prefill_tokens"] == 3  # only each prompt's last token was computed


def test_prefix_kv_survives_preemption(tiny_llama):
    ids = prompts(4, 60)
    kvs = [LLM(str(tiny_llama)).engine.compute_prefix_kv(p[:-1]) for p in ids]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = run(LLM(str(tiny_llama)), ids, params)
    tight = LLM(str(tiny_llama), device_kv_budget="96KiB")  # 12 blocks, 4 requests need 24
    got = run(tight, ids, params, kvs)
    assert tight.stats()["preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_bad_prefix_kv_is_a_clear_error(tiny_llama):
    llm = LLM(str(tiny_llama))
    kv = llm.engine.compute_prefix_kv(list(range(3, 20)))
    with pytest.raises(ValueError, match="covers 17 tokens"):
        llm.engine.add_request(list(range(3, 20)), GREEDY, prefix_kv=kv)
    with pytest.raises(ValueError, match="prefix_kv has shape"):
        llm.engine.add_request(list(range(3, 30)), GREEDY, prefix_kv=kv[:, :1])
    assert llm.generate([list(range(3, 30))], GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("mode", [{}, dict(kv_mode="sparse", top_k=64)], ids=["dense",
                                                                           "sparse-all"])
def test_forced_tokens_score_a_continuation_like_transformers(tiny_llama, mode):
    text = prompts(1, 70)[0]
    prompt, cont = text[:50], text[50:]
    params = SamplingParams(temperature=0, max_tokens=len(cont), ignore_eos=True,
                            logprobs=True, forced_tokens=cont)
    out = LLM(str(tiny_llama), **mode).generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == cont
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([text])).logits[0]
    ref = torch.log_softmax(logits[49:69], -1).gather(1, torch.tensor(cont)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=1e-4)


def test_forced_tokens_are_the_lookahead_drafts_unless_guessed(tiny_llama):
    """Teacher forcing knows the next token: by default it is the draft, so every draft is
    right; forced_drafts="guessed" has the drafter guess it, as in generation."""
    text = prompts(1, 100)[0]
    prompt, cont = text[:64], text[64:]
    params = SamplingParams(temperature=0, max_tokens=len(cont), ignore_eos=True,
                            logprobs=True, forced_tokens=cont)
    sparse = dict(kv_mode="sparse", top_k=2, predictor="lookahead")
    known, guessed = (LLM(str(tiny_llama), **sparse, forced_drafts=d).generate(
        [prompt], params, use_tqdm=False)[0] for d in ("known", "guessed"))
    assert known.token_ids == guessed.token_ids == cont
    assert known.metrics.num_drafts == len(cont) - 1  # every decode step drafted
    assert known.metrics.draft_accuracy == 1.0
    assert guessed.metrics.draft_accuracy < 0.5  # random tokens: rarely guessed
    assert known.logprobs != guessed.logprobs  # the draft's query chose other blocks
    # more drafts are guesses: a known token is the only draft, whatever num_drafts
    two = LLM(str(tiny_llama), **sparse, num_drafts=2).generate([prompt], params,
                                                                use_tqdm=False)[0]
    assert two.logprobs == known.logprobs


def test_forced_tokens_are_validated(tiny_llama):
    with pytest.raises(ValueError, match="exceed max_tokens"):
        SamplingParams(max_tokens=2, forced_tokens=[5, 6, 7])
    llm = LLM(str(tiny_llama))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, forced_tokens=[10**6]),
                     use_tqdm=False)
