"""Block scoring, per-head top-K prediction and capped-LRU selection (paper §3.1, §3.3.2).

Pure functions over small tensors, so that the predictors (exact now, lookahead later) share
one selection path and tests can compare each step with a brute-force reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oasiskv.compiled import compiled

RANKS = 1 << 20  # more than any K: a stamp's rank part never reaches the next step


def stamp(step: int, rank: torch.Tensor | int = 0) -> torch.Tensor | int:
    """When a slot's block was last selected, as one integer: any pick of a later step is more
    recent, and within a step a better-ranked pick is more recent, so a block that fills at
    the end of a step displaces the step's lowest-ranked pick (never a pinned block)."""
    return step * RANKS + (RANKS - 1) - rank


def summary_weights(q: torch.Tensor, num_kv_heads: int,
                    alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head weights (w_max, w_min) [..., Hkv, d] of a query q [..., H, d] such that a
    block's score is kmax . w_max + kmin . w_min.

    s_b = sum_h (q_h . c_b + alpha |q_h| . r_b) with c = (kmax + kmin) / 2, r = (kmax - kmin) / 2
    is linear in kmax and kmin: w = (sum_h q_h +- alpha sum_h |q_h|) / 2; alpha = 1 gives
    Quest's bound, sum_h relu(q_h) . kmax + min(q_h, 0) . kmin. The summary is shared by a KV
    head's group, so the sum over h moves onto q."""
    qg = q.reshape(*q.shape[:-2], num_kv_heads, -1, q.shape[-1]).float()  # [..., Hkv, G, d]
    total, magnitude = qg.sum(-2), alpha * qg.abs().sum(-2)
    return (total + magnitude) / 2, (total - magnitude) / 2


def largest_split(scores: torch.Tensor, splits: int, dim: int) -> torch.Tensor:
    """Sub-block scores -> block scores: along `dim` (n*splits rows, a block's splits
    consecutive), the largest of each block's. Each sub-block's bound holds for its own
    tokens, so the largest bounds every token of the block (and is at most the whole block's
    bound: the sub-blocks' min/max lie within the block's). splits = 1: unchanged."""
    if splits == 1:
        return scores
    return scores.unflatten(dim, (-1, splits)).amax(dim + 1 if dim >= 0 else dim)


@compiled
def weighted_scores(kmin: torch.Tensor, kmax: torch.Tensor, w_max: torch.Tensor,
                    w_min: torch.Tensor, splits: int = 1) -> torch.Tensor:
    """kmin/kmax [..., n*splits, Hkv, d] (summary_splits rows per block), weights
    [..., Hkv, d] -> scores [..., Hkv, n], each block's the largest of its rows'."""
    # Compiled: one pass that reads each summary once (bf16 summaries, fp32 weights multiply
    # in fp32), at the memory's bandwidth; eager, each product is an fp32 temporary as large
    # as the summaries (7K x 4 requests, 30 layers: 7.8 -> 3.2 ms of a step's selection).
    w_max, w_min = w_max[..., None, :, :], w_min[..., None, :, :]
    scores = torch.mul(kmax, w_max).sum(-1) + torch.mul(kmin, w_min).sum(-1)  # [..., n*S, Hkv]
    return largest_split(scores, splits, -2).transpose(-1, -2)


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 alpha: float = 1.0, splits: int = 1) -> torch.Tensor:
    """s_b = sum_h (q_h . c_b + alpha |q_h| . r_b) over the query heads h of each KV head
    (with splits > 1: the largest over the block's sub-blocks' summaries).

    q [..., H, d] (post-RoPE, one token per leading index); kmin/kmax [..., n*splits, Hkv, d]
    -> scores [..., Hkv, n]."""
    return weighted_scores(kmin, kmax, *summary_weights(q, kmin.shape[-2], alpha), splits)


def head_weights(q: torch.Tensor, num_kv_heads: int,
                 alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """summary_weights per query head, not summed over the group: (w_max, w_min)
    [..., Hkv, G, d] of q [..., H, d], so that query head h's score of a block is
    kmax . w_max + kmin . w_min (alpha = 1: Quest's bound relu(q_h) . kmax + min(q_h, 0) . kmin)."""
    qg = q.reshape(*q.shape[:-2], num_kv_heads, -1, q.shape[-1]).float()  # [..., Hkv, G, d]
    magnitude = alpha * qg.abs()
    return (qg + magnitude) / 2, (qg - magnitude) / 2


@compiled
def head_log_probs(kmin: torch.Tensor, kmax: torch.Tensor, w_max: torch.Tensor,
                   w_min: torch.Tensor, past: torch.Tensor, scale: torch.Tensor,
                   splits: int = 1) -> torch.Tensor:
    """Each query head's scores, normalised over the request's blocks: log softmax over n of
    scale * (kmax . w_max + kmin . w_min). kmin/kmax [..., n*splits, Hkv, d] (a block's score:
    its sub-blocks' largest, per query head, before the softmax), weights [..., Hkv, G, d]
    (head_weights), past [..., n] True for a block that is not the request's (-inf: another
    request's summaries in a batch view), scale [...] (the attention scale, per layer) ->
    [..., Hkv, G, n]."""
    # compiled as weighted_scores is: one pass over the summaries, G products per element;
    # one reduction over d of both products (two: 1.3x slower at SmolLM2's shapes)
    w_max, w_min = w_max[..., None, :, :, :], w_min[..., None, :, :, :]
    scores = (kmax[..., None, :] * w_max + kmin[..., None, :] * w_min).sum(-1)  # [..., n*S, Hkv, G]
    scores = largest_split(scores, splits, -3)  # [..., n, Hkv, G]
    logits = scores.movedim(-3, -1) * scale[..., None, None, None]
    return torch.log_softmax(logits.masked_fill(past[..., None, None, :], float("-inf")), dim=-1)


@compiled
def group_logsumexp(logp: torch.Tensor) -> torch.Tensor:
    """[..., Hkv, G, n] -> [..., Hkv, n]: log of the sum of the group's probabilities
    (compiled: eager, a third of softmax-sum's scoring time; fused into head_log_probs, slower
    still)."""
    return torch.logsumexp(logp, dim=-2)


def aggregated_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                      past: torch.Tensor, scale: torch.Tensor, aggregation: str,
                      alpha: float = 1.0, splits: int = 1) -> torch.Tensor:
    """GQA-aware block scores: each query head h of a KV head's group scores the blocks by its
    own bound, normalises them into a distribution over the request's blocks (softmax at the
    attention scale, so that a head with large norms does not decide for the group), and the
    group combines them: softmax-sum, the sum of the heads' probabilities; softmax-max, the
    largest. Returned as logs (log of the sum, log of the max: the same ranking, and no ties
    where a probability underflows to 0); -inf past a request's blocks. q [..., H, d],
    kmin/kmax [..., n*splits, Hkv, d], past [..., n], scale [...] -> [..., Hkv, n]."""
    logp = head_log_probs(kmin, kmax, *head_weights(q, kmin.shape[-2], alpha), past, scale,
                          splits)
    if aggregation == "softmax-sum":
        return group_logsumexp(logp)
    if aggregation == "softmax-max":
        return logp.amax(dim=-2)
    raise ValueError(f"unknown score aggregation {aggregation!r}")


def block_mass(q: torch.Tensor, keys: torch.Tensor, scale: float,
               block_size: int) -> torch.Tensor:
    """Softmax attention of one token over complete blocks, summed per block (the oracle
    predictor's scores, the recall tool's attention mass): q [H, d],
    keys [Hkv, n*B, d] -> [H, n] (each row sums to 1)."""
    hkv, t, d = keys.shape
    qg = q.view(hkv, -1, d).float()
    probs = torch.softmax(torch.matmul(qg, keys.float().transpose(1, 2)) * scale, dim=-1)
    return probs.view(hkv, qg.shape[1], t // block_size, block_size).sum(-1).reshape(q.shape[0],
                                                                                     -1)


def rerank_by_mass(scores: torch.Tensor, q: torch.Tensor, keys_of: Callable[[torch.Tensor],
                   torch.Tensor], scale: float, block_size: int, c: int) -> torch.Tensor:
    """Scores [..., Hkv, n] -> the best c blocks of each KV head re-scored by q's softmax
    attention over their keys, summed over the block and the head's query heads (the mass
    the `oracle` ranks by, within the candidates); -inf elsewhere and for candidates that were
    -inf (past a request's blocks). q [..., H, d]; keys_of(candidates [..., Hkv, c]) returns
    their keys [..., Hkv, c*B, d]. A summary bound is loose; the keys are not."""
    top = torch.topk(scores, min(c, scores.shape[-1]), dim=-1)  # [..., Hkv, c]
    keys = keys_of(top.indices)
    hkv, d = keys.shape[-3], keys.shape[-1]
    qg = q.reshape(*q.shape[:-2], hkv, -1, d).to(keys.dtype)  # [..., Hkv, G, d]
    # keys as the long side of the product, in their own dtype (as attention computes its
    # scores): on CPU 3x faster than [G, d] x [d, c*B] in fp32
    logits = torch.matmul(keys, qg.transpose(-1, -2)).float() * scale  # [..., Hkv, c*B, G]
    real = (top.values > float("-inf")).repeat_interleave(block_size, dim=-1)
    probs = torch.softmax(logits.masked_fill(~real[..., None], float("-inf")), dim=-2)
    mass = probs.unflatten(-2, (-1, block_size)).sum((-2, -1))  # [..., Hkv, c]
    mass = mass.masked_fill(top.values == float("-inf"), float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter_(-1, top.indices, mass)


def draft_weights(weights: list[list[float] | None], m: int,
                  counts: list[int] | None = None) -> torch.Tensor:
    """mixed_queries' weights [R, m] (float32, on the host) of one list per request (None:
    equal weights) over its counts[r] rows (default m); the rows past them weigh 0."""
    counts = counts or [m] * len(weights)
    return torch.tensor([(ws or [1.0] * n) + [0.0] * (m - n)
                         for ws, n in zip(weights, counts, strict=True)], dtype=torch.float32)


def mixed_queries(queries: torch.Tensor,
                  weights: list[list[float] | None] | torch.Tensor) -> torch.Tensor:
    """Each request's drafts' queries [R, m, H, d] -> one per request [R, H, d]: their mean
    weighted by how likely each draft is to be the next token (`spec.drafters.
    sampling_weights`, one list per request; None: equal weights; or `draft_weights`' tensor
    of them, on the queries' device), so that the selection covers what the next step may
    need, likely guesses first. One pass for the batch."""
    if queries.shape[1] == 1:
        return queries[:, 0]
    m = queries.shape[1]
    if not isinstance(weights, torch.Tensor):
        weights = draft_weights(weights, m)
    w = weights.to(queries.device, queries.dtype)  # [R, m]
    return (w[..., None, None] * queries).sum(1) / w.sum(1)[:, None, None]


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
    (One request, its admissions compacted on the host: tools and tests.)"""
    caps = torch.tensor([predicted.shape[1] if cap is None else cap], device=predicted.device)
    b = select_capped_lru_batch(head_map[None], last_used[None], predicted[None], caps, step)
    m = b.admitted
    return Selection(b.slots[m], b.heads[m], b.blocks[m], int(b.predicted[0]), int(b.hits[0]),
                     int(b.wanted[0]))


@dataclass
class BatchSelection:
    """select_capped_lru_batch's candidate admissions, R * Hkv * c of them (c: the largest
    cap), as parallel 1-D tensors by request, head, then score order, `admitted` True for those
    that entered (a fixed size: no count comes back to the host); per-request counts."""

    requests: torch.Tensor  # [A] which request
    slots: torch.Tensor  # [A]
    heads: torch.Tensor  # [A]
    blocks: torch.Tensor  # [A]
    admitted: torch.Tensor  # [A] bool
    predicted: torch.Tensor  # [R]
    hits: torch.Tensor  # [R]
    wanted: torch.Tensor  # [R]


def select_capped_lru_batch(head_map: torch.Tensor, last_used: torch.Tensor,
                            predicted: torch.Tensor, caps: torch.Tensor, step: int,
                            num_blocks: int | None = None,
                            max_cap: int | None = None) -> BatchSelection:
    """select_capped_lru for R requests at once, a few tensor ops for the whole batch, none
    of which reads a tensor back to the host (given num_blocks).

    head_map / last_used [R, K, Hkv] (updated in place), predicted [R, Hkv, k] best first,
    padded with -2 where a request has fewer than k blocks; caps [R] admissions per head, at
    most max_cap (default k); num_blocks: more than any predicted block (default: read from
    `predicted`, a host read-back)."""
    R, hkv, k = predicted.shape
    dev = predicted.device
    hm, lu = head_map.transpose(1, 2), last_used.transpose(1, 2)  # [R, Hkv, K] views
    valid = predicted >= 0
    # Tables indexed by logical block instead of comparing every slot with every pick: at
    # K = 512 the [K, k] comparison was a third of a decode step. Empty slots, padding and
    # resident blocks past num_blocks (never predicted) point at one extra column, cleared
    # before it is read.
    if num_blocks is None:
        num_blocks = int(predicted.max()) + 1
    none = num_blocks
    slot_blocks = torch.where((hm >= 0) & (hm < none), hm, none)  # [R, Hkv, K]
    picks = torch.where(valid, predicted, none)  # [R, Hkv, k]
    ranks = torch.arange(k, device=dev)
    rank_of = torch.full((R, hkv, none + 1), -1, dtype=torch.long, device=dev)
    rank_of.scatter_(-1, picks, ranks.expand_as(picks).contiguous())
    rank_of[..., none] = -1
    hit_rank = rank_of.gather(-1, slot_blocks)  # [R, Hkv, K] rank of the slot's block, or -1
    is_hit = hit_rank >= 0  # slot holds a predicted block
    resident = torch.zeros_like(rank_of, dtype=torch.bool).scatter_(-1, slot_blocks, True)
    resident[..., none] = False
    is_miss = ~resident.gather(-1, picks) & valid  # [R, Hkv, k] predicted block not resident
    lu[...] = torch.where(is_hit, stamp(step, hit_rank), lu)
    # Each head's first c misses by score (c: the largest cap), the j-th into the head's j-th
    # victim: empty slots first, then the least recently selected non-predicted blocks; each
    # head has at least as many as misses (K - hits >= k - hits). Candidates past a head's
    # misses or its request's cap write back what their slot holds.
    c = k if max_cap is None else min(max_cap, k)
    cols = torch.argsort((~is_miss).to(torch.uint8), dim=-1, stable=True)[..., :c]  # [R, Hkv, c]
    admit = (ranks[:c] < is_miss.sum(-1, keepdim=True)) & (ranks[:c] < caps[:, None, None])
    age = torch.where(hm < 0, -1, lu).masked_fill(is_hit, torch.iinfo(lu.dtype).max)
    slots = torch.argsort(age, dim=-1, stable=True)[..., :c]  # [R, Hkv, c] victims
    blocks = predicted.gather(-1, cols)
    hm.scatter_(-1, slots, torch.where(admit, blocks, hm.gather(-1, slots)))
    lu.scatter_(-1, slots, torch.where(admit, stamp(step, cols), lu.gather(-1, slots)))
    requests = torch.arange(R, device=dev)[:, None, None].expand_as(slots)
    heads = torch.arange(hkv, device=dev)[None, :, None].expand_as(slots)
    return BatchSelection(requests.flatten(), slots.flatten(), heads.flatten(), blocks.flatten(),
                          admit.flatten(), valid.sum((1, 2)), is_hit.sum((1, 2)),
                          is_miss.sum((1, 2)))


def insert_block(head_map: torch.Tensor, last_used: torch.Tensor, block: int,
                 step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block that just filled enters every head's working set ([..., K, Hkv], e.g. one per
    layer), replacing an empty slot or the head's least recently selected block. Returns, per
    (..., head), the slot that received it [..., Hkv] and whether it entered [..., Hkv] (a head
    that already holds the block, a retried step, keeps it where it is); no host read-back."""
    age = torch.where(head_map < 0, torch.full_like(last_used, -1), last_used)  # [..., K, Hkv]
    slots = torch.argmin(age, dim=-2, keepdim=True)  # [..., 1, Hkv] first minimum
    new = ~(head_map == block).any(dim=-2, keepdim=True)  # [..., 1, Hkv]
    head_map.scatter_(-2, slots, torch.where(new, block, head_map.gather(-2, slots)))
    last_used.scatter_(-2, slots, torch.where(new, stamp(step), last_used.gather(-2, slots)))
    return slots.squeeze(-2), new.squeeze(-2)
