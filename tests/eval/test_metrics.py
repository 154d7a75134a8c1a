"""The figures on hand-made inputs: the paired bootstrap interval (exact on constant
differences, close to the normal-theory interval on many samples, wider for fewer samples),
recall, churn and attention mass."""

import math
import random

import pytest
import torch

from oasiskv.eval.fidelity import summarize
from oasiskv.eval.metrics import (
    block_mass,
    captured_mass,
    churn,
    paired_bootstrap_ci,
    recall,
)


def mean_diff(x, y):
    return x.mean(-1) - y.mean(-1)


def test_constant_differences_give_a_point_interval():
    a = [3.0, 3.5, 4.2, 3.1]
    assert paired_bootstrap_ci([v + 0.25 for v in a], a, mean_diff) == pytest.approx((0.25, 0.25))


def test_many_samples_match_the_normal_interval():
    rng = random.Random(0)
    d = [rng.gauss(0.1, 1.0) for _ in range(2000)]
    lo, hi = paired_bootstrap_ci(d, [0.0] * len(d), mean_diff)
    m = sum(d) / len(d)
    se = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d))
    assert lo == pytest.approx(m - 1.96 * se, abs=0.15 * se)
    assert hi == pytest.approx(m + 1.96 * se, abs=0.15 * se)


def test_pairing_removes_the_spread_shared_by_both_settings():
    rng = random.Random(1)
    base = [rng.gauss(3.5, 0.5) for _ in range(16)]  # per-prompt difficulty, shared
    a = [v + 0.02 + rng.gauss(0, 0.005) for v in base]
    lo, hi = paired_bootstrap_ci(a, base, mean_diff)
    m = (sum(a) - sum(base)) / len(a)
    assert 0 < lo <= m <= hi and hi - lo < 0.01  # unpaired, the 0.5 spread would swamp 0.02


def test_ppl_rows_carry_the_ratio_interval():
    dense = [{"nll": v, "tokens": [1, 2]} for v in (3.0, 3.4, 3.9)]
    sparse = [{"nll": v["nll"] + 0.01, "tokens": [1, 3]} for v in dense]
    rows = summarize("ppl", [], {"dense": dense, "sparse": sparse})
    ratio = math.exp(0.01)
    assert rows[1]["ppl_ratio"] == pytest.approx(ratio)
    assert (rows[1]["ppl_ratio_lo"], rows[1]["ppl_ratio_hi"]) == pytest.approx((ratio, ratio))
    assert rows[1]["ppl_ratio_ci"] == f"{ratio:.4f} [{ratio:.4f}, {ratio:.4f}]"
    assert rows[1]["agreement"] == 0.5


def test_recall_and_churn_on_hand_made_sets():
    pred = torch.tensor([[0, 1, 2], [3, 4, 5]])
    exact = torch.tensor([[1, 2, 7], [5, 6, 7]])
    assert recall(pred, exact).tolist() == pytest.approx([2 / 3, 1 / 3])
    assert churn(exact, pred).tolist() == pytest.approx([1 / 3, 2 / 3])
    assert churn(pred, pred).tolist() == [0.0, 0.0]


def test_block_mass_and_captured_mass_on_hand_made_attention():
    # 1 KV head, 2 query heads, d=1, B=2, scale 1. Head 0 has q=1 and keys (0, 0, ln2, ln4):
    # probabilities 1/8, 1/8, 2/8, 4/8 -> blocks (1/4, 3/4). Head 1 has q=0: uniform (1/2, 1/2).
    q = torch.tensor([[1.0], [0.0]])
    keys = torch.tensor([[[0.0], [0.0], [math.log(2)], [math.log(4)]]])
    mass = block_mass(q, keys, 1.0, 2)
    torch.testing.assert_close(mass, torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    assert captured_mass(mass, torch.tensor([[1]])).tolist() == pytest.approx([0.75, 0.5])
    assert captured_mass(mass, torch.tensor([[0, 1]])).tolist() == pytest.approx([1.0, 1.0])
