"""`bench serve`'s prompts for one rate: unique Austen passages, or the paper's workload for
prefill-decode disaggregation, groups of requests sharing a prefix.

Groups (--shared-prefix-fraction h, --group-size n, default 4): the n requests of a group start
with the same s = floor(h * input_len) tokens, a passage of the group's own, and go on with
input_len - s tokens of a passage of each request's own. The first request of each group is
sent before the timed trace and waited for (it warms the store: a prefix cache can then serve
the group's prefix to the others); the other n - 1 of every group are the timed trace, in group
order. No passage serves twice, so prompts share nothing but their group's prefix. (A store
reuses whole blocks: floor(s / block_size) of them.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Workload:
    warm: list[list[int]]  # sent first, together, untimed (empty without groups)
    timed: list[list[int]]  # the trace


def shared_len(input_len: int, fraction: float) -> int:
    """Tokens a group's prompts share: floor(fraction * input_len)."""
    if not (0 <= fraction < 1):
        raise ValueError(f"--shared-prefix-fraction must be in [0, 1) (each prompt keeps a "
                         f"token of its own), got {fraction}")
    return math.floor(fraction * input_len)


def check_groups(num_prompts: int, fraction: float | None, group_size: int) -> None:
    if fraction is None:
        return
    shared_len(1, fraction)
    if group_size < 2:
        raise ValueError(f"--group-size must be at least 2 (one warms, the others share), "
                         f"got {group_size}")
    if num_prompts % group_size:
        raise ValueError(f"--num-prompts {num_prompts} is not a multiple of --group-size "
                         f"{group_size}: with --shared-prefix-fraction it counts whole groups")


def passages_needed(num_prompts: int, fraction: float | None, group_size: int) -> int:
    """Passages one rate uses: a prompt each, and with groups a prefix per group as well."""
    return num_prompts if fraction is None else num_prompts + num_prompts // group_size


def group_prompts(passages: list[list[int]], groups: int, size: int, input_len: int,
                  fraction: float) -> list[list[list[int]]]:
    """[groups][size] prompts of input_len tokens: group g's prompt i is passages[g][:s] +
    passages[groups + g * size + i][:input_len - s], s = shared_len(input_len, fraction)."""
    s = shared_len(input_len, fraction)
    need = groups * (size + 1)
    if len(passages) < need or any(len(p) < input_len for p in passages[:need]):
        raise ValueError(f"{groups} groups of {size} need {need} passages of {input_len} "
                         f"tokens, got {len(passages)}")
    own = passages[groups:need]
    return [[passages[g][:s] + own[g * size + i][:input_len - s] for i in range(size)]
            for g in range(groups)]


def make_workload(passages: list[list[int]], num_prompts: int, input_len: int,
                  fraction: float | None = None, group_size: int = 4) -> Workload:
    """One rate's prompts from passages_needed(...) passages of input_len tokens."""
    if fraction is None:
        return Workload([], [list(p) for p in passages[:num_prompts]])
    groups = group_prompts(passages, num_prompts // group_size, group_size, input_len, fraction)
    return Workload([g[0] for g in groups], [p for g in groups for p in g[1:]])
