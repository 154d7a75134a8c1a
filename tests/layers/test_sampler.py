"""The sampler against hand-computed distributions: greedy, temperature, top-k, top-p; on
OASISKV_TEST_DEVICE (conftest's `test_device`), with generators of that device."""

import math
from collections import Counter

import pytest
import torch

from oasiskv.layers.sampler import sample, sample_one, verify_draft
from oasiskv.sampling_params import SamplingParams

DRAWS = 3000


@pytest.fixture(autouse=True)
def on_test_device(test_device):
    """Every tensor these tests make lives on the test device."""
    with torch.device(test_device):
        yield


def draws(logits: torch.Tensor, params: SamplingParams, n: int = DRAWS,
          seed: int = 0) -> list[int]:
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    return [sample_one(logits, params, gen) for _ in range(n)]


def draw(logits: torch.Tensor, params: SamplingParams, n: int = DRAWS, seed: int = 0) -> Counter:
    return Counter(draws(logits, params, n, seed))


def assert_frequencies(counts: Counter, probs: dict[int, float], n: int = DRAWS) -> None:
    """Each kept token's frequency is within 5 standard deviations of its probability."""
    for token, p in probs.items():
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[token] / n - p) <= 5 * sd + 1e-9, (token, counts[token] / n, p)


def shuffled_logits(probs: list[float], order: list[int]) -> torch.Tensor:
    """Logits whose softmax puts probs[i] on token order[i] (tokens not sorted by id)."""
    logits = torch.full((len(probs),), float("-inf"))
    logits[order] = torch.log(torch.tensor(probs))
    return logits


# 8 tokens with distinct probabilities, deliberately not in id order.
PROBS = [0.30, 0.22, 0.16, 0.12, 0.09, 0.06, 0.03, 0.02]
ORDER = [5, 2, 7, 0, 3, 6, 1, 4]  # ORDER[i] is the i-th most likely token


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_the_k_most_likely(k):
    logits = shuffled_logits(PROBS, ORDER)
    counts = draw(logits, SamplingParams(temperature=1.0, top_k=k))
    kept = set(ORDER[:k])
    assert set(counts) == kept  # every one of the k is drawn, nothing else ever is
    mass = sum(PROBS[:k])
    assert_frequencies(counts, {ORDER[i]: PROBS[i] / mass for i in range(k)})


def test_top_k_off_keeps_everything():
    logits = shuffled_logits(PROBS, ORDER)
    for k in (-1, 0, 8, 100):
        counts = draw(logits, SamplingParams(temperature=1.0, top_k=k), n=4000)
        assert set(counts) == set(range(8))


# Hand-computed: probs 0.5, 0.3, 0.15, 0.05 on tokens 3, 0, 2, 1. The kept set is the
# smallest prefix (by probability) whose mass reaches p.
TOP_P_PROBS = [0.5, 0.3, 0.15, 0.05]
TOP_P_ORDER = [3, 0, 2, 1]


@pytest.mark.parametrize("p, kept", [
    (0.3, {3}),            # 0.5 >= 0.3
    (0.49, {3}),
    (0.6, {3, 0}),         # 0.5 < 0.6 <= 0.8
    (0.9, {3, 0, 2}),      # 0.8 < 0.9 <= 0.95
    (0.97, {3, 0, 2, 1}),  # 0.95 < 0.97
    (1.0, {3, 0, 2, 1}),
])
def test_top_p_keeps_smallest_prefix_reaching_p(p, kept):
    logits = shuffled_logits(TOP_P_PROBS, TOP_P_ORDER)
    counts = draw(logits, SamplingParams(temperature=1.0, top_p=p))
    assert set(counts) == kept
    mass = sum(pr for pr, t in zip(TOP_P_PROBS, TOP_P_ORDER, strict=True) if t in kept)
    assert_frequencies(counts, {t: pr / mass for pr, t in zip(TOP_P_PROBS, TOP_P_ORDER,
                                                                strict=True) if t in kept})


def test_top_k_then_top_p():
    # top_k=3 renormalises 0.30/0.22/0.16 to 0.441/0.324/0.235; top_p=0.7 then keeps two.
    logits = shuffled_logits(PROBS, ORDER)
    counts = draw(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert set(counts) == {ORDER[0], ORDER[1]}


def test_temperature_scales_logits():
    # p ∝ exp(logit / T): with logits log(0.8), log(0.2) and T=0.5, p = 0.64/0.68, 0.04/0.68.
    logits = torch.log(torch.tensor([0.8, 0.2]))
    counts = draw(logits, SamplingParams(temperature=0.5))
    assert_frequencies(counts, {0: 0.64 / 0.68, 1: 0.04 / 0.68})
    counts = draw(logits, SamplingParams(temperature=2.0))
    z = math.sqrt(0.8) + math.sqrt(0.2)
    assert_frequencies(counts, {0: math.sqrt(0.8) / z, 1: math.sqrt(0.2) / z})


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    greedy = SamplingParams(temperature=0)
    expected = [int(i) for i in logits.max(dim=-1).indices]
    assert sample(logits, [greedy] * 6, [None] * 6) == expected
    assert [sample_one(row, greedy, None) for row in logits] == expected
    # A greedy row in a mixed batch is still its argmax; greedy ignores top-k/top-p.
    mixed = [greedy, SamplingParams(temperature=1.0, seed=1)] * 3
    gens = [None, torch.Generator(device=logits.device).manual_seed(1)] * 3
    out = sample(logits, mixed, gens)
    assert out[0::2] == expected[0::2]
    odd = SamplingParams(temperature=0, top_k=2, top_p=0.1)
    assert sample(logits, [odd] * 6, [None] * 6) == expected


def test_seeded_generator_reproduces():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3), device="cpu").to(
        torch.get_default_device())
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=40)
    assert draws(logits, params, n=50, seed=9) == draws(logits, params, n=50, seed=9)
    assert draws(logits, params, n=50, seed=9) != draws(logits, params, n=50, seed=10)


def test_verify_draft_keeps_the_distribution(test_device):
    """Speculative verification of a fixed draft on the test device: the kept-or-resampled
    token is distributed as p (p(draft) = 0.30 here), the draft kept with probability p."""
    logits = shuffled_logits(PROBS, ORDER)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator(device=test_device).manual_seed(0)
    out = [verify_draft(logits, ORDER[0], params, gen) for _ in range(DRAWS)]
    assert logits.device.type == torch.device(test_device).type
    assert_frequencies(Counter(t for t, _ in out), {ORDER[i]: PROBS[i] for i in range(8)})
    assert all(kept == (t == ORDER[0]) for t, kept in out)
