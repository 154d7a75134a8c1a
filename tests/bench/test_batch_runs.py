"""The batch-run machinery of `bench throughput` and `bench pareto` (`bench/batch_runs.py`):
capacities, budgets and medians against hand-computed values."""

import pytest

from oasiskv.bench.batch_runs import (
    auto_host_budget,
    dense_capacity,
    median_run,
    token_gap_percentiles,
)
from oasiskv.config import EngineConfig


def test_token_gap_percentiles_by_hand():
    # gaps 1, 2, 3 s (one request) and 0.5 s (another): sorted 0.5, 1, 2, 3; the median
    # lies halfway between 1 and 2, p99 at 0.99 * 3 = 2.97 positions: 2 + 0.97 * (3 - 2)
    p50, p99 = token_gap_percentiles([[0, 1, 3, 6], [10, 10.5], [7]])
    assert p50 == pytest.approx(1500) and p99 == pytest.approx(2970)
    assert token_gap_percentiles([[1.0], []]) == (None, None)



def test_dense_capacity_is_whole_requests_of_the_block_pool():
    config = EngineConfig.from_kwargs(device_kv_budget="1MiB", block_size=16)
    # 1 KiB per token: 64 blocks of 16 KiB; a request of 100 + 20 tokens takes 8 blocks
    assert dense_capacity(config, 1024, 100, 20) == 8
    assert dense_capacity(config, 1024, 100, 29) == 7  # 129 tokens: 9 blocks each
    assert dense_capacity(config, 1024, 1020, 10) == 0


def test_auto_host_budget_holds_every_history_with_a_tenth_to_spare():
    # 3 requests of 100 + 20 tokens: 8 blocks each and one more, 16 tokens of 10 bytes
    assert auto_host_budget(3, 100, 20, 16, 10) == int(1.1 * 3 * 9 * 16 * 10)


def test_median_run_is_the_lower_middle_with_every_runs_tps():
    runs = [{"tps": 3.0, "i": 0}, {"tps": 1.0, "i": 1}, {"tps": 2.0, "i": 2}, {"tps": 4.0, "i": 3}]
    m = median_run(runs)
    assert m["i"] == 2 and m["repeats"] == 4 and m["tps_runs"] == [3.0, 1.0, 2.0, 4.0]
    assert m["tps_range"] == "1-4"
    assert median_run(runs[:3])["i"] == 2
