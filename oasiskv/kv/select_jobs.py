"""The stages of one step's working-set selection for a batch's sparse requests, in one layer
or in a run of layers at once: predict (scores + per-head top-K), select (capped LRU, head maps
updated), remote (with a remote store: admitted blocks missing from the host caches, fetched in
one call for the run; on one node nothing to do), local (one gather host -> device slots).
`kv/residency.py` creates them; the prefetch pipeline (`prefetch/`, which knows nothing of KV)
runs them in order, inline or in workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasiskv.kv.select import select_capped_lru_batch

if TYPE_CHECKING:
    from oasiskv.kv.residency import SparseKV
    from oasiskv.kv.working_set import StepDecode


def pinned_blocks(lengths: torch.Tensor, n: int, sink: int, recent: int) -> torch.Tensor:
    """[R, n] True for each request's first `sink` and last `recent` complete blocks: they
    score +inf, so top-K always keeps them (and, once resident, they are always hits)."""
    idx = torch.arange(n)[None, :]
    real = idx < lengths[:, None]
    return real & ((idx < sink) | (idx >= lengths[:, None] - recent))


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
        """Scores every request's complete blocks with its query (the predictor's scorers in
        turn, pinned blocks +inf after each); per-head top-K."""
        self._hook("predict")
        if not self.picks:
            return
        kv, K = self.kv, self.kv.cfg.top_k
        n = self.ids.shape[1]
        pinned = None
        if kv.cfg.sink_blocks or kv.cfg.recent_blocks:
            pinned = pinned_blocks(self.lengths, n, kv.cfg.sink_blocks,
                                   kv.cfg.recent_blocks)[:, None, :]  # [R, 1, n]
        scores = None
        for scorer in kv.predictor.scorers:
            scores = scorer.score(self, scores)  # [layers, R, Hkv, n]
            if pinned is not None:
                scores.masked_fill_(pinned, float("inf"))
        top = torch.topk(scores, min(K, n), dim=-1, sorted=True).indices  # [layers, R, Hkv, k]
        real = torch.arange(top.shape[-1]) < self.lengths.clamp(max=K)[:, None]  # [R, k]
        self.predicted = top.masked_fill(~real[:, None, :], -2)

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
        cap = kv.fetch_cap
        caps = torch.tensor([[cap if ws.seeded[layer] else k for ws in wss]
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
