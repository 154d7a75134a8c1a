"""The paired bootstrap interval: exact on constant differences, close to the normal-theory
interval on many samples, and wider for fewer samples."""

import math
import random

import pytest

from oasiskv.eval.fidelity import summarize
from oasiskv.eval.metrics import paired_bootstrap_ci


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
