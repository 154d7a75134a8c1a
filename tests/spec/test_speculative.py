"""Speculative acceptance: greedy output is exactly the non-speculative one; under sampling the
output distribution is unchanged (rejection sampling)."""

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.layers.sampler import probabilities, verify_draft


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    from scipy.stats import chisquare

    keep = expected > 5  # pool rare outcomes into one cell (if any is possible at all)
    obs, exp = counts[keep], expected[keep]
    if expected[~keep].sum() > 0:
        obs = torch.cat([obs, counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([exp, expected[~keep].sum(0, keepdim=True)])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("draft", [0, 3, 7])
def test_verify_draft_samples_exactly_p(draft):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.9, top_k=6)
    p = probabilities(logits, params)
    g = torch.Generator().manual_seed(draft)
    n = 20_000
    counts = torch.zeros(8)
    accepted = 0
    for _ in range(n):
        token, ok = verify_draft(logits, draft, params, g)
        counts[token] += 1
        accepted += ok
    assert chi_square_p_value(counts, p * n) > 1e-3
    assert accepted / n == pytest.approx(float(p[draft]), abs=0.02)  # acceptance = p(draft)
    assert counts[p == 0].sum() == 0  # top-k still applies


def test_verify_draft_greedy_keeps_only_the_argmax():
    logits = torch.tensor([0.1, 3.0, 0.2])
    greedy = SamplingParams(temperature=0)
    assert verify_draft(logits, 1, greedy, None) == (1, True)
    assert verify_draft(logits, 2, greedy, None) == (1, False)


REPETITIVE = [5, 6, 7, 8, 9] * 8  # prompt lookup drafts are often right


# Exact equality holds where attention is exact: dense, or sparse with K covering every block
# (with smaller K an accepted draft attended the working set chosen for the step before it).
@pytest.mark.parametrize("mode", [{}, {"kv_mode": "sparse", "top_k": 8},
                                  {"kv_mode": "sparse", "top_k": 8, "num_drafts": 2}])
def test_greedy_speculative_equals_plain(tiny_llama, mode):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [REPETITIVE, list(range(3, 70))]
    plain_llm = LLM(str(tiny_llama), **mode)
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama), speculative="accept", drafter="ngram", **mode)
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.stats()
    assert stats["spec_accepted"] > 0  # some steps emitted two tokens...
    assert stats["steps"] < plain_llm.stats()["steps"]  # ...so the batch needed fewer steps
    # a right draft is kept unless the request stopped on it (at most once per request)
    assert 0 <= stats["drafts_right"] - stats["spec_accepted"] <= len(prompts)


def test_sampling_distribution_is_preserved(tiny_llama):
    """Two-sample test on the 2nd and 3rd generated tokens of many seeded runs."""
    runs = 300
    plain_llm = LLM(str(tiny_llama))
    spec_llm = LLM(str(tiny_llama), speculative="accept", drafter="ngram")
    # A prompt that already contains the model's own continuation: lookup drafts are likely.
    greedy = plain_llm.generate([REPETITIVE], SamplingParams(temperature=0, max_tokens=9,
                                                             ignore_eos=True), use_tqdm=False)
    prompt = REPETITIVE + greedy[0].token_ids

    def tokens(llm):
        # random tiny weights give flat logits: a low temperature makes them peaked
        params = [SamplingParams(temperature=0.05, top_k=6, max_tokens=4, ignore_eos=True,
                                 seed=s)
                  for s in range(runs)]
        return torch.tensor([o.token_ids for o in llm.generate([prompt] * runs, params,
                                                                 use_tqdm=False)])

    a, b = tokens(plain_llm), tokens(spec_llm)
    assert spec_llm.stats()["spec_accepted"] > runs // 4  # acceptance really happened
    from scipy.stats import chi2_contingency

    for pos in (1, 2, 3):
        values = torch.cat([a[:, pos], b[:, pos]]).unique()
        table = torch.stack([(a[:, pos, None] == values).sum(0),
                             (b[:, pos, None] == values).sum(0)])
        common = table.sum(0) >= 10  # pool rare tokens into one column
        table = torch.cat([table[:, common], table[:, ~common].sum(1, keepdim=True)], dim=1)
        table = table[:, table.sum(0) > 0]
        assert chi2_contingency(table.numpy()).pvalue > 1e-3
