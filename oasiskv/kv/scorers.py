"""Block scorers: the stages that rank a selection's blocks, behind one interface.

A scorer maps a selection job (`kv/select_jobs.SelectJob`: its requests, queries [layers, H, d]
each, and layers) and the previous stage's scores to block scores [layers, R, Hkv, n], -inf
past a request's blocks; the predictor (`kv/predictors.py`) chains them and takes the top-K:
- `QuestBound`: each complete block's bound from its summaries (Quest's, or a per-query-head
  aggregation: CacheConfig.score_aggregation), over summary_splits rows a block;
- `Rerank`: each KV head's best c = rerank*K blocks by the previous stage, re-scored by the
  predicting query's attention over their keys (host tier, or the device's int8/int4 copy);
  rerank=inf: every block, as the first stage (no summary bound);
- `AttentionMass` (oracle): every block's share of the step's true attention.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from oasiskv.kv.rerank import rerank_layers
from oasiskv.kv.select import aggregated_scores, block_mass, summary_weights, weighted_scores
from oasiskv.kv.summaries import summary_rows

if TYPE_CHECKING:
    from oasiskv.kv.select_jobs import SelectJob


class BlockScorer(ABC):
    @abstractmethod
    def score(self, job: SelectJob, scores: torch.Tensor | None) -> torch.Tensor:
        """Block scores [layers, R, Hkv, n] of the job's requests (n: its most complete
        blocks), -inf past a request's blocks; `scores`: the previous stage's (None first)."""


def requests_view(pool: torch.Tensor, requests: int, n: int, stride: int,
                  first: int) -> torch.Tensor:
    """Summaries [layers, rows, Hkv, d] of requests whose runs of n rows lie `stride` rows
    apart from row `first`, as one view [layers, requests, n, Hkv, d] (no copy). With
    summary_splits S a request's n blocks are n*S rows (`summaries.summary_rows`)."""
    inner = pool.stride(1)
    return pool.as_strided((pool.shape[0], requests, n, *pool.shape[2:]),
                           (pool.stride(0), stride * inner, *pool.stride()[1:]),
                           pool.storage_offset() + first * inner)


class QuestBound(BlockScorer):
    """Each request's block scores over its complete blocks' summaries in each layer."""

    def score(self, job: SelectJob, scores: torch.Tensor | None) -> torch.Tensor:
        kv, R, S = job.kv, len(job.picks), job.kv.cfg.summary_splits
        n = job.ids.shape[1]
        kmin, kmax = kv.kmin[job.run], kv.kmax[job.run]  # [layers, summary ids * S, Hkv, d]
        hkv, alpha = kmin.shape[2], kv.cfg.score_alpha
        stride = self.stride(job, n, kmin.shape[1] // S)
        aggregation = kv.cfg.score_aggregation
        scales, dev = job.scales, kmin.device  # [layers]
        if stride:  # equal strides: the batch's summaries are one view, scored in one call
            first = job.picks[0][0].summary_start
            lo, hi = (requests_view(x, R, n * S, stride * S, first * S) for x in (kmin, kmax))
            queries = torch.stack([q for _, q in job.picks], 1)  # [layers, R, H, d]
            past = torch.arange(n, device=dev)[None, :] >= job.lengths[:, None]  # not its own
            if aggregation != "sum":  # per query head, normalised over each request's blocks
                return aggregated_scores(queries, lo, hi, past, scales[:, None], aggregation,
                                         alpha, S)
            weights = summary_weights(queries, hkv, alpha)
            out = weighted_scores(lo, hi, *weights, S)  # weights [layers, R, Hkv, d]
            return out.masked_fill_(past[:, None, :], float("-inf"))
        out = torch.full((len(job.layers), R, hkv, n), float("-inf"), device=dev)
        for r, (d, q) in enumerate(job.picks):
            m = len(d.summary_ids)
            if d.summary_start is not None:  # one run of summaries: a view, no gather
                run = slice(d.summary_start * S, (d.summary_start + m) * S)
                lo, hi = kmin[:, run], kmax[:, run]
            else:
                rows = summary_rows(job.ids[r, :m], S)  # the device's copy of its ids
                lo, hi = kmin.index_select(1, rows), kmax.index_select(1, rows)
            # the request's own weights [layers, Hkv, d], strided as warm_up_scores compiled
            # for (a slice of the batch's would not be)
            if aggregation != "sum":
                past = torch.zeros(m, dtype=torch.bool, device=dev)
                out[:, r, :, :m] = aggregated_scores(q, lo, hi, past, scales, aggregation,
                                                     alpha, S)
                continue
            out[:, r, :, :m] = weighted_scores(lo, hi, *summary_weights(q, hkv, alpha), S)
        return out

    @staticmethod
    def stride(job: SelectJob, n: int, num_ids: int) -> int:
        """The distance between consecutive requests' summary runs when it is one stride of
        at least `n` (requests reserved side by side: `BlockPool.take_run`), else 0."""
        starts = [d.summary_start for d, _ in job.picks]
        if len(starts) < 2 or None in starts:
            return 0
        stride = starts[1] - starts[0]
        ok = (stride >= n and starts[-1] + n <= num_ids
              and all(s == starts[0] + i * stride for i, s in enumerate(starts)))
        return stride if ok else 0


class Rerank(BlockScorer):
    """The best `candidates` blocks by the previous stage, re-scored by the predicting query's
    attention over their keys in the host tier (one node: a summary id is a host block) or the
    device's int8/int4 copy, all the job's layers at once."""

    def __init__(self, candidates: int | None) -> None:
        self.candidates = candidates  # c = ceil(rerank * K) per KV head; None: every block

    def score(self, job: SelectJob, scores: torch.Tensor | None) -> torch.Tensor:
        kv, B, n = job.kv, job.kv.cfg.block_size, job.ids.shape[1]
        c = n if self.candidates is None else self.candidates
        if scores is None:  # the first stage: each request's complete blocks, no shortlist
            past = torch.arange(n, device=job.ids.device) >= job.lengths[:, None]  # [R, n]
            hkv = kv.host_view.shape[2]
            scores = torch.zeros(len(job.layers), len(job.picks), hkv, n, device=job.ids.device)
            scores.masked_fill_(past[:, None, :], float("-inf"))
        queries = torch.stack([q for _, q in job.picks], 1)  # [layers, R, H, d]
        scales = job.scales  # [layers]
        if kv.key_codes is not None:  # [layers, summary ids, Hkv, d, B], scales [.., Hkv]
            return rerank_layers(scores, queries, scales, c, job.ids, kv.key_codes[job.run],
                                 kv.key_scales[job.run])
        # the host tier's keys where the device reads them (`transfers.device_view`)
        keys = kv.host_view[job.run, 0].unflatten(2, (-1, B)).transpose(1, 2)  # [.., n, Hkv, B, d]
        return rerank_layers(scores, queries, scales, c, job.ids, keys)


class AttentionMass(BlockScorer):
    """oracle: each complete block's share of the step's true attention (over complete
    blocks), summed over the KV head's query heads. Reads every key from the host tier (one
    node: a summary id is a host block)."""

    def score(self, job: SelectJob, scores: torch.Tensor | None) -> torch.Tensor:
        kv, B, n = job.kv, job.kv.cfg.block_size, job.ids.shape[1]
        hkv, dev = kv.host_view.shape[2], job.ids.device
        out = torch.full((len(job.layers), len(job.picks), hkv, n), float("-inf"), device=dev)
        for j, layer in enumerate(job.layers):
            keys = kv.host_view[layer][0]  # [Hkv, host slots, d]
            for r, (d, q) in enumerate(job.picks):
                m = len(d.summary_ids)
                slots = (job.ids[r, :m, None] * B + torch.arange(B, device=dev)).flatten()
                mass = block_mass(q[j], keys.index_select(1, slots), kv.scales[layer], B)
                out[j, r, :, :m] = mass.view(hkv, -1, m).sum(1)
        return out


def rerank_candidates(rerank: float, top_k: int) -> int | None:
    """Candidates per KV head of a rerank of `rerank` (CacheConfig.rerank) times K; None for
    rerank=inf (every block)."""
    return None if math.isinf(rerank) else math.ceil(rerank * top_k)


def warm_up_scores(kmin: torch.Tensor, aggregation: str = "sum", group: int = 1,
                   splits: int = 1) -> None:
    """Compiles the block scoring (`weighted_scores`) for the shapes selections pass: one layer
    (a request's first step, a per-layer job) or a run of layers (sync's step end), a batch's
    summaries as one strided view or one request's alone; so that no request's step waits for
    it. kmin: a summary pool [L, summary ids, Hkv, d] (its kind of tensor). Tensor kinds, grad
    mode, aliasing and equal sizes are all guards of the compiled code, so the inputs are views
    of normal tensors taken in inference mode, as in a step, with sizes unlike each other.
    With a score aggregation other than sum, its per-head scoring (`aggregated_scores`) instead,
    for queries of `group` heads per KV head (a size of 1 is a guard too), and `splits`
    summary rows per block (summary_splits)."""
    L, _, hkv, d = kmin.shape
    S = splits
    pools = [torch.zeros(L, 61 * S, hkv, d, dtype=kmin.dtype, device=kmin.device)
             for _ in range(2)]  # 61 ids a layer: not a multiple of the requests' stride
    with torch.inference_mode():
        for layers in sorted({1, L}):
            # 5 x 7 ids, 11 apart
            batch = [requests_view(x[:layers], 5, 7 * S, 11 * S, 0) for x in pools]
            for lo, hi in (batch, [x[:layers, :7 * S] for x in pools]):
                q = torch.zeros(*lo.shape[:-3], hkv * group, d, device=kmin.device)
                if aggregation == "sum":
                    weighted_scores(lo, hi, *summary_weights(q, hkv), S)
                    continue
                past = torch.zeros((*lo.shape[:-3], 7), dtype=torch.bool, device=kmin.device)
                scale = torch.ones(lo.shape[:-3], device=kmin.device)
                if lo.dim() == 5:  # the batch view: scales [layers, 1], past [R, n]
                    past, scale = past[0], scale[:, :1]
                else:  # one request: scales [layers], past [n]
                    past = past[0]
                aggregated_scores(q, lo, hi, past, scale, aggregation, 1.0, S)
