"""The --concurrency levels of `bench throughput` and `bench pareto`: request counts, `dense-max`
(per context, the most requests whose whole K/V fits the device budget: the largest
concurrency dense can hold, where the paper compares) and multiples of it (`2x`), each
resolved to a request count with its label."""

from __future__ import annotations

import re

DENSE_MAX = "dense-max"
MULTIPLE = re.compile(r"(\d+(?:\.\d+)?)x")  # a multiple of dense-max: 2x, 1.5x


def parse_concurrency(text: str) -> list[int | str]:
    """"dense-max,2x,8" -> ["dense-max", "2x", 8]. Raises ValueError for anything else (a
    count or multiple of 0, a word, nothing)."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]

    def ok(x: str) -> bool:
        if x == DENSE_MAX:
            return True
        if MULTIPLE.fullmatch(x):
            return float(x[:-1]) > 0
        return x.isdigit() and int(x) > 0

    if not items or not all(ok(x) for x in items):
        raise ValueError(f"--concurrency takes positive integers, {DENSE_MAX} and multiples of "
                         f"it such as 2x, got {text!r}")
    return [x if x == DENSE_MAX or MULTIPLE.fullmatch(x) else int(x) for x in items]


def relative(levels: list[int | str]) -> bool:
    """Whether some level is given relative to dense-max (it or a multiple)."""
    return any(isinstance(x, str) for x in levels)


def resolve(levels: list[int | str], capacity: int) -> dict[int, str]:
    """Requests per level -> its label (dense-max, 2x, or "" for a count), ascending; a level
    met twice keeps dense-max's label, else its first; a multiple is at least 1 request."""
    out: dict[int, str] = {}
    for x in levels:
        if x == DENSE_MAX:
            out[capacity] = DENSE_MAX
        elif isinstance(x, str):
            out.setdefault(max(1, round(float(x[:-1]) * capacity)), x)
        else:
            out.setdefault(x, "")
    return dict(sorted(out.items()))
