"""The --concurrency levels of `bench throughput` and `bench pareto` (`bench/levels.py`):
parsed, refused, and resolved to request counts with their labels, against hand-computed
values."""

import re

import pytest

from oasiskv.bench.levels import DENSE_MAX, parse_concurrency, relative, resolve


def test_counts_dense_max_and_multiples_parse_in_order():
    assert parse_concurrency(" 1,4, dense-max") == [1, 4, DENSE_MAX]
    assert parse_concurrency("dense-max,2x,8,0.5x") == [DENSE_MAX, "2x", 8, "0.5x"]
    assert relative(parse_concurrency("2x")) and not relative(parse_concurrency("1,4"))


@pytest.mark.parametrize("bad", ["", " , ", "0", "-2", "two", "1,dense", "0x", "0.0x", "x",
                                 "2X", "x2", "-1x", "1.5", "2x,0"])
def test_anything_else_is_refused_naming_the_input(bad):
    with pytest.raises(ValueError, match=re.escape(
            f"--concurrency takes positive integers, dense-max and multiples of it such as 2x, "
            f"got {bad!r}")):
        parse_concurrency(bad)


def test_levels_resolve_to_counts_with_labels_ascending():
    # dense holds 3: 2x = 6, 0.3x = round(0.9) = 1; 8 is a count (no label)
    assert resolve([8, "2x", DENSE_MAX, "0.3x"], 3) == {1: "0.3x", 3: DENSE_MAX, 6: "2x", 8: ""}
    assert list(resolve([8, DENSE_MAX, 1, 3], 3)) == [1, 3, 8]  # ascending, 3 once
    # a count met twice: dense-max's label wins, else the first one given
    assert resolve([3, "1x", DENSE_MAX], 3) == {3: DENSE_MAX}
    assert resolve(["1x", 3], 3) == {3: "1x"}
    assert resolve(["0.1x"], 2) == {1: "0.1x"}  # a multiple is at least one request
