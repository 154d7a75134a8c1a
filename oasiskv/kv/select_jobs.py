"""The stages of one step's working-set selection for a batch's sparse requests, in one layer
or in a run of layers at once: predict (scores + per-head top-K), select (capped LRU, head maps
updated), remote (with a remote store: admitted blocks missing from the host caches, fetched in
one call for the run; on one node nothing to do), local (one gather host -> device slots).
`kv/residency.py` creates them; the prefetch pipeline (`prefetch/`, which knows nothing of KV)
runs them in order, inline or in workers."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from oasiskv.kv.rerank import rerank_layers
from oasiskv.kv.select import (
    aggregated_scores,
    block_mass,
    select_capped_lru_batch,
    summary_weights,
    weighted_scores,
)
from oasiskv.kv.summaries import summary_rows

if TYPE_CHECKING:
    from oasiskv.kv.residency import SparseKV, StepDecode


def pinned_blocks(lengths: torch.Tensor, n: int, sink: int, recent: int) -> torch.Tensor:
    """[R, n] True for each request's first `sink` and last `recent` complete blocks: they
    score +inf, so top-K always keeps them (and, once resident, they are always hits)."""
    idx = torch.arange(n)[None, :]
    real = idx < lengths[:, None]
    return real & ((idx < sink) | (idx >= lengths[:, None] - recent))


def requests_view(pool: torch.Tensor, requests: int, n: int, stride: int,
                  first: int) -> torch.Tensor:
    """Summaries [layers, rows, Hkv, d] of requests whose runs of n rows lie `stride` rows
    apart from row `first`, as one view [layers, requests, n, Hkv, d] (no copy). With
    summary_splits S a request's n blocks are n*S rows (`summaries.summary_rows`)."""
    inner = pool.stride(1)
    return pool.as_strided((pool.shape[0], requests, n, *pool.shape[2:]),
                           (pool.stride(0), stride * inner, *pool.stride()[1:]),
                           pool.storage_offset() + first * inner)


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


class SelectJob:
    """The four stages of one step's selection in a run of layers, batched over the requests
    and the layers: picks hold each request's queries [len(layers), H, d]. Batching the layers
    turns 30 rounds of small tensor ops (and, with a remote store, 30 store calls) into one or
    two."""

    def __init__(self, kv: SparseKV, layers: list[int],
                 picks: list[tuple[StepDecode, torch.Tensor]], step: int) -> None:
        if layers != list(range(layers[0], layers[0] + len(layers))):
            raise ValueError(f"a selection's layers must be one run, got {layers}")
        self.kv, self.layers, self.step = kv, layers, step
        self.run = slice(layers[0], layers[-1] + 1)
        # only requests with complete blocks select; working sets captured now (a request
        # may end, and drop its working set, while the job runs)
        self.picks = [(d, q) for d, q in picks if len(d.summary_ids)]
        self.working_sets = [d.seq.working_set for d, _ in self.picks]
        self.caches = [d.seq.host_cache for d, _ in self.picks]  # remote store: host caches
        self.ids = self.lengths = self.slabs = None  # [R, n], [R], [R, K+1]
        if self.picks:
            self.ids, self.lengths, self.slabs = kv.batch_tensors([d for d, _ in self.picks])
        self.predicted = None
        self.requests = self.blocks = None  # [A] admissions: request, logical block
        self.layer_of = None  # [A] admission's layer, as an index into `layers`
        self.heads = self.dst = self.src = None  # [A] KV head, device token slot, host slot

    def _hook(self, stage: str) -> None:
        hook = self.kv.stage_hooks.get(stage)
        if hook is not None:
            for layer in self.layers:
                hook(layer, [d.seq for d, _ in self.picks])

    def predict(self) -> None:
        """Scores every request's complete blocks with its query; per-head top-K."""
        self._hook("predict")
        if not self.picks:
            return
        kv, K = self.kv, self.kv.cfg.top_k
        n = self.ids.shape[1]
        scores = (self._attention_mass(n) if kv.cfg.predictor == "oracle"
                  else self._summary_scores(n))  # [layers, R, Hkv, n]
        pinned = None
        if kv.cfg.sink_blocks or kv.cfg.recent_blocks:
            pinned = pinned_blocks(self.lengths, n, kv.cfg.sink_blocks,
                                   kv.cfg.recent_blocks)[:, None, :]  # [R, 1, n]
            scores.masked_fill_(pinned, float("inf"))
        if kv.cfg.reranks:
            scores = self._rerank(scores)
            if pinned is not None:
                scores.masked_fill_(pinned, float("inf"))
        top = torch.topk(scores, min(K, n), dim=-1, sorted=True).indices  # [layers, R, Hkv, k]
        real = torch.arange(top.shape[-1]) < self.lengths.clamp(max=K)[:, None]  # [R, k]
        self.predicted = top.masked_fill(~real[:, None, :], -2)

    def _summary_scores(self, n: int) -> torch.Tensor:
        """Each request's block scores over its complete blocks' summaries in each layer:
        [layers, R, Hkv, n], -inf past a request's blocks."""
        kv, R, S = self.kv, len(self.picks), self.kv.cfg.summary_splits
        kmin, kmax = kv.kmin[self.run], kv.kmax[self.run]  # [layers, summary ids * S, Hkv, d]
        hkv, alpha = kmin.shape[2], kv.cfg.score_alpha
        stride = self._summary_stride(n, kmin.shape[1] // S)
        aggregation = kv.cfg.score_aggregation
        scales = self._scales(kmin)  # [layers]
        if stride:  # equal strides: the batch's summaries are one view, scored in one call
            first = self.picks[0][0].summary_start
            lo, hi = (requests_view(x, R, n * S, stride * S, first * S) for x in (kmin, kmax))
            queries = torch.stack([q for _, q in self.picks], 1)  # [layers, R, H, d]
            past = torch.arange(n)[None, :] >= self.lengths[:, None]  # another request's
            if aggregation != "sum":  # per query head, normalised over each request's blocks
                return aggregated_scores(queries, lo, hi, past, scales[:, None], aggregation,
                                         alpha, S)
            weights = summary_weights(queries, hkv, alpha)
            scores = weighted_scores(lo, hi, *weights, S)  # weights [layers, R, Hkv, d]
            return scores.masked_fill_(past[:, None, :], float("-inf"))
        scores = torch.full((len(self.layers), R, hkv, n), float("-inf"))
        for r, (d, q) in enumerate(self.picks):
            m = len(d.summary_ids)
            if d.summary_start is not None:  # one run of summaries: a view, no gather
                run = slice(d.summary_start * S, (d.summary_start + m) * S)
                lo, hi = kmin[:, run], kmax[:, run]
            else:
                rows = summary_rows(d.summary_ids, S)
                lo, hi = kmin.index_select(1, rows), kmax.index_select(1, rows)
            # the request's own weights [layers, Hkv, d], strided as warm_up_scores compiled
            # for (a slice of the batch's would not be)
            if aggregation != "sum":
                past = torch.zeros(m, dtype=torch.bool)
                scores[:, r, :, :m] = aggregated_scores(q, lo, hi, past, scales, aggregation,
                                                        alpha, S)
                continue
            scores[:, r, :, :m] = weighted_scores(lo, hi, *summary_weights(q, hkv, alpha), S)
        return scores

    def _scales(self, kmin: torch.Tensor) -> torch.Tensor:
        """The attention scale of each of the job's layers, [layers] (1/sqrt(d) when the
        engine gave none)."""
        scales = self.kv.scales or [kmin.shape[-1] ** -0.5] * (self.run.stop)
        return torch.tensor([scales[layer] for layer in self.layers], dtype=torch.float32)

    def _rerank(self, scores: torch.Tensor) -> torch.Tensor:
        """The best rerank*K blocks by summary score, re-scored by the predicting query's
        attention over their keys in the host tier (one node: a summary id is a host block)
        or the device's int8 copy, all the job's layers at once: [layers, R, Hkv, n]."""
        kv, B = self.kv, self.kv.cfg.block_size
        c = math.ceil(kv.cfg.rerank * kv.cfg.top_k)
        queries = torch.stack([q for _, q in self.picks], 1)  # [layers, R, H, d]
        scales = torch.tensor([kv.scales[layer] for layer in self.layers])
        if kv.key_codes is not None:  # [layers, summary ids, Hkv, d, B], scales [.., Hkv]
            return rerank_layers(scores, queries, scales, c, self.ids, kv.key_codes[self.run],
                                 kv.key_scales[self.run])
        keys = kv.host_kv[self.run, 0].unflatten(2, (-1, B)).transpose(1, 2)  # [.., n, Hkv, B, d]
        return rerank_layers(scores, queries, scales, c, self.ids, keys)

    def _attention_mass(self, n: int) -> torch.Tensor:
        """oracle: each complete block's share of the step's true attention (over complete
        blocks), summed over the KV head's query heads: [layers, R, Hkv, n], -inf past a
        request's blocks. Reads every key from the host tier (one node: a summary id is a host
        block)."""
        kv, B = self.kv, self.kv.cfg.block_size
        hkv = kv.host_kv.shape[2]
        scores = torch.full((len(self.layers), len(self.picks), hkv, n), float("-inf"))
        for j, layer in enumerate(self.layers):
            keys = kv.host_kv[layer][0]  # [Hkv, host slots, d]
            for r, (d, q) in enumerate(self.picks):
                slots = (d.summary_ids[:, None] * B + torch.arange(B)).flatten()
                mass = block_mass(q[j], keys.index_select(1, slots), kv.scales[layer], B)
                scores[j, r, :, :len(d.summary_ids)] = mass.view(hkv, -1, len(d.summary_ids)
                                                                 ).sum(1)
        return scores

    def _summary_stride(self, n: int, num_ids: int) -> int:
        """The distance between consecutive requests' summary runs when it is one stride of
        at least `n` (requests reserved side by side: `BlockPool.take_run`), else 0."""
        starts = [d.summary_start for d, _ in self.picks]
        if len(starts) < 2 or None in starts:
            return 0
        stride = starts[1] - starts[0]
        ok = (stride >= n and starts[-1] + n <= num_ids
              and all(s == starts[0] + i * stride for i, s in enumerate(starts)))
        return stride if ok else 0

    def select(self) -> None:
        """Hits stay; up to the cap of misses replace LRU victims (head maps updated)."""
        self._hook("select")
        if self.predicted is None:
            return
        kv, K, R = self.kv, self.kv.cfg.top_k, len(self.picks)
        wss = self.working_sets
        # (layer, request) pairs are the batch: [layers, R, K, Hkv], flattened as views
        head_map = torch.stack([ws.head_map[self.run] for ws in wss], 1)
        last_used = torch.stack([ws.last_used[self.run] for ws in wss], 1)
        k = self.predicted.shape[-1]
        caps = torch.tensor([[kv.fetch_cap if ws.seeded[layer] else k for ws in wss]
                             for layer in self.layers])  # [layers, R]
        sel = select_capped_lru_batch(head_map.flatten(0, 1), last_used.flatten(0, 1),
                                      self.predicted.flatten(0, 1), caps.flatten(), self.step)
        for i, ws in enumerate(wss):
            ws.head_map[self.run], ws.last_used[self.run] = head_map[:, i], last_used[:, i]
            past_k = int(self.lengths[i]) > K
            for layer in self.layers:
                ws.seeded[layer] = ws.seeded[layer] or past_k
            if self.caches[i] is not None:  # the host cache's LRU follows the selections
                self.caches[i].touch(self.layers[0], self.predicted[:, i].flatten(1), self.step)
        kv._count(predicted=int(sel.predicted.sum()), hits=int(sel.hits.sum()),
                  wanted=int(sel.wanted.sum()), admitted=len(sel.slots))
        self.layer_of, self.requests = sel.requests // R, sel.requests % R
        self.blocks, self.heads = sel.blocks, sel.heads
        self.dst = self.slabs[self.requests, sel.slots]

    def remote(self) -> None:
        """Where each admission's block is on the host. One node: its host block is its
        summary id. Remote store: blocks missing from a request's host cache in a layer are
        fetched, all requests' and layers' in one store call; a request whose fetch failed
        loses its admissions (the engine fails it after the step)."""
        self._hook("remote")
        if self.heads is None or len(self.heads) == 0:
            return
        kv = self.kv
        if kv.remote is None:
            self.src = self.ids[self.requests, self.blocks] * kv.cfg.block_size
            return
        wants = []
        layers = self.layer_of + self.layers[0]  # [A]
        for r, cache in enumerate(self.caches):
            if cache is None:
                raise RuntimeError(f"request {self.picks[r][0].seq.request_id} decodes "
                                   "without a host cache (its prompt never went to the store)")
            mine = self.requests == r
            if mine.any():
                wants.append((cache, layers[mine], self.blocks[mine],
                               self.working_sets[r].head_map.flatten(1)))
        got = kv.remote.fetch(wants)
        kv._count(remote_bytes=got.bytes, remote_blocks=got.blocks,
                  host_evictions=got.evictions)
        host = torch.empty_like(self.blocks)  # [A]
        for r, cache in enumerate(self.caches):
            mine = self.requests == r
            host[mine] = cache.where[layers[mine], self.blocks[mine]]
        ok = host >= 0  # -1: the fetch failed
        self.layer_of, self.heads, self.dst = self.layer_of[ok], self.heads[ok], self.dst[ok]
        self.src = host[ok] * kv.cfg.block_size

    def local(self) -> None:
        """One vectorised gather of per-head block slices, host -> device slots."""
        self._hook("local")
        if self.heads is None or len(self.heads) == 0:
            return
        kv, B = self.kv, self.kv.cfg.block_size
        _, _, hkv, slots, d = kv.device_kv.shape
        # both pools as rows of one head's block ([L * 2 * Hkv * blocks, B*d]): one
        # index_select and one index_copy_ of whole rows, 1.7x faster than indexing tokens
        device, host = kv.device_kv.view(-1, B * d), kv.host_kv.view(-1, B * d)
        head = ((self.layer_of + self.layers[0]) * 2 + torch.arange(2)[:, None]) * hkv + \
            self.heads  # [2 (K, V), A]
        src = (head * (kv.host_kv.shape[3] // B) + self.src // B).flatten()
        dst = (head * (slots // B) + self.dst // B).flatten()
        rows = host.index_select(0, src.to(host.device))
        device.index_copy_(0, dst.to(device.device), rows.to(device.device))
        kv._count(h2d_bytes=len(self.heads) * kv.block_bytes_per_head)
