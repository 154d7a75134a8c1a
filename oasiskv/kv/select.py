"""Block scoring, per-head top-K prediction and capped-LRU selection (paper §3.1, §3.3.2).

Pure functions over small tensors, so that the predictors (exact now, lookahead later) share
one selection path and tests can compare each step with a brute-force reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 alpha: float = 1.0) -> torch.Tensor:
    """s_b = sum_h (q_h . c_b + alpha |q_h| . r_b) over the query heads h of each KV head.

    q [H, d] (post-RoPE, one token); kmin/kmax [n, Hkv, d] -> scores [Hkv, n].
    The block summary is shared by a KV head's group, so the sum over h moves onto q.
    """
    n, hkv, d = kmin.shape
    qg = q.view(hkv, -1, d).float()  # [Hkv, G, d]
    kmin, kmax = kmin.float(), kmax.float()
    if alpha == 1.0:  # Quest's bound: relu(q).kmax + min(q, 0).kmin, two matmuls per KV head
        pos, neg = qg.clamp(min=0).sum(1), qg.clamp(max=0).sum(1)  # [Hkv, d]
        return torch.einsum("gd,ngd->gn", pos, kmax) + torch.einsum("gd,ngd->gn", neg, kmin)
    center, radius = (kmax + kmin) / 2, (kmax - kmin) / 2
    return (torch.einsum("gd,ngd->gn", qg.sum(1), center)
            + alpha * torch.einsum("gd,ngd->gn", qg.abs().sum(1), radius))


def top_k_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[Hkv, n] -> [Hkv, min(k, n)] block indices, best first."""
    return torch.topk(scores, min(k, scores.shape[-1]), dim=-1, sorted=True).indices


@dataclass
class Selection:
    """What one (request, layer) selection changed. Admissions are parallel 1-D tensors."""

    slots: torch.Tensor  # [A] slot receiving a block
    heads: torch.Tensor  # [A] KV head
    blocks: torch.Tensor  # [A] logical block admitted
    predicted: int  # blocks predicted, summed over heads
    hits: int  # predicted blocks already resident
    wanted: int  # predicted blocks not resident (admitted or left out by the cap)


def select_capped_lru(head_map: torch.Tensor, last_used: torch.Tensor, predicted: torch.Tensor,
                      cap: int | None, step: int) -> Selection:
    """Updates head_map / last_used ([K, Hkv], -1 = empty slot) in place for `predicted`
    ([Hkv, k], best first). Hits are marked used; up to `cap` misses per head (all when cap is
    None: seeding) enter, best first, each replacing an empty slot or else the least recently
    selected block outside the predicted set. Misses beyond the cap stay out this step.
    All heads at once: a few small tensor ops instead of a loop over heads."""
    same = head_map.T[:, :, None] == predicted[:, None, :]  # [Hkv, K, k]
    is_hit = same.any(dim=2)  # [Hkv, K] slot holds a predicted block
    is_miss = ~same.any(dim=1)  # [Hkv, k] predicted block not resident
    last_used.T[is_hit] = step
    miss_rank = torch.cumsum(is_miss, dim=1) - 1  # order of each miss within its head
    admit = is_miss & (miss_rank < (cap if cap is not None else predicted.shape[1]))
    # Victims: empty slots first, then the least recently selected non-predicted blocks; each
    # head has at least as many as misses (K - hits >= k - hits).
    age = torch.where(head_map.T < 0, -1, last_used.T).masked_fill(is_hit, torch.iinfo(
        last_used.dtype).max)  # [Hkv, K]
    victims = torch.argsort(age, dim=1, stable=True)  # [Hkv, K]
    heads, cols = admit.nonzero(as_tuple=True)  # by head, then score order
    slots = victims[heads, miss_rank[heads, cols]]
    blocks = predicted[heads, cols]
    head_map[slots, heads] = blocks
    last_used[slots, heads] = step
    return Selection(slots, heads, blocks, predicted.numel(), int(is_hit.sum()),
                     int(is_miss.sum()))


def insert_block(head_map: torch.Tensor, last_used: torch.Tensor, block: int,
                 step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block that just filled enters every head's working set, replacing an empty slot or the
    head's least recently selected block. Returns (slots, heads) that received it; a head
    that already holds the block (a retried step) keeps it where it is."""
    age = torch.where(head_map < 0, torch.full_like(last_used, -1), last_used)  # [K, Hkv]
    slots = torch.argmin(age, dim=0)  # first minimum: deterministic
    heads = torch.arange(head_map.shape[1])
    new = ~(head_map == block).any(dim=0)
    slots, heads = slots[new], heads[new]
    head_map[slots, heads] = block
    last_used[slots, heads] = step
    return slots, heads
