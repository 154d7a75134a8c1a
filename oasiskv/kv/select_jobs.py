"""The stages of one step's working-set selection for a batch's sparse requests, in one layer
or in a run of layers at once: predict (scores + per-head top-K), select (capped LRU, head maps
updated), remote (with a remote store: admitted blocks missing from the host caches, fetched in
one call for the run; on one node nothing to do), local (one gather host -> device slots).
`kv/residency.py` creates them; the prefetch pipeline (`prefetch/`, which knows nothing of KV)
runs them in order, inline or in workers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasiskv.kv import select_kernel
from oasiskv.kv.row_copy import copy_rows
from oasiskv.kv.select import BatchSelection, select_capped_lru_batch
from oasiskv.kv.transfers import upload

if TYPE_CHECKING:
    from oasiskv.kv.residency import SparseKV
    from oasiskv.kv.working_set import StepDecode


def pinned_blocks(lengths: torch.Tensor, n: int, sink: int, recent: int) -> torch.Tensor:
    """[R, n] True for each request's first `sink` and last `recent` complete blocks: they
    score +inf, so top-K always keeps them (and, once resident, they are always hits)."""
    idx = torch.arange(n, device=lengths.device)[None, :]
    real = idx < lengths[:, None]
    return real & ((idx < sink) | (idx >= lengths[:, None] - recent))



def compacts(device: torch.device) -> bool:
    """Whether the local stage reads back which candidates were admitted and copies only
    those: on the CPU, where the step is the host's own work and a read-back stops nothing
    (the fixed-size copy reads and writes every candidate's rows: with it a 7K x 6 sparse
    step on a 2-core EPYC took 124-134 ms, without 114-116, with the batched draft queries);
    on CUDA a read-back would serialise the prefetch streams with the foreground."""
    return device.type == "cpu"

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
        self.ids = self.lengths = self.slabs = None  # [R, n], [R], [R, K+1] on the device
        # What the stages need of the host's bookkeeping is read here, on the foreground,
        # so that no stage reads a tensor back or builds one from Python data (on CUDA each
        # would stop the host until the device caught up). Every earlier job of these layers
        # has run by now (each layer waited for its own before its attention), so `seeded`
        # is what the select stage would read.
        self.counts = [len(d.summary_ids) for d, _ in self.picks]  # complete blocks each
        self.caps = None  # [layers, R] admissions per head (uncapped until seeded)
        self.max_cap = 0
        if self.picks:
            self.ids, self.lengths, self.slabs = kv.batch_tensors([d for d, _ in self.picks])
            K, cap = kv.cfg.top_k, kv.fetch_cap
            k = min(K, self.ids.shape[1])
            caps = [[cap if ws.seeded[layer] else k for ws in self.working_sets]
                    for layer in layers]
            self.max_cap = min(k, max(map(max, caps)))
            self.caps = upload(torch.tensor(caps), kv.kmin.device)
            self.scales = kv.layer_scales(layers)  # [layers]
        self.predicted = None
        self.requests = self.blocks = None  # [A] candidate admissions: request, logical block
        self.layer_of = None  # [A] candidate's layer, as an index into `layers`
        self.heads = self.dst = self.src = None  # [A] KV head, device token slot, host slot
        self.admitted = None  # [A] which candidates entered (the rest are not copied)

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
        k, real = min(K, n), self.lengths.clamp(max=K)  # [R] each request's picks
        if (ext := select_kernel.serves(scores)) is not None:
            self.predicted = ext.top_blocks(scores.float().flatten(0, -2).contiguous(), real,
                                            scores.shape[2], k).view(*scores.shape[:3], k)
            return
        top = torch.topk(scores, k, dim=-1, sorted=True).indices  # [layers, R, Hkv, k]
        past = torch.arange(k, device=top.device) >= real[:, None]  # [R, k]
        self.predicted = top.masked_fill(past[:, None, :], -2)

    def select(self) -> None:
        """Hits stay; up to the cap of misses replace LRU victims (head maps updated)."""
        self._hook("select")
        if self.predicted is None:
            return
        kv, K, R = self.kv, self.kv.cfg.top_k, len(self.picks)
        wss = self.working_sets
        maps, used = [ws.head_map for ws in wss], [ws.last_used for ws in wss]
        if (ext := select_kernel.serves(self.predicted, *maps, *used)) is not None:  # in place
            sel = BatchSelection(*ext.select_lru(maps, used, self.layers[0], self.predicted,
                                                 self.caps, self.step, self.ids.shape[1],
                                                 self.max_cap))
        else:  # (layer, request) pairs are the batch: [layers, R, K, Hkv], flattened as views
            head_map = torch.stack([m[self.run] for m in maps], 1)
            last_used = torch.stack([u[self.run] for u in used], 1)
            sel = select_capped_lru_batch(head_map.flatten(0, 1), last_used.flatten(0, 1),
                                          self.predicted.flatten(0, 1), self.caps.flatten(),
                                          self.step, self.ids.shape[1], self.max_cap)
            for i, ws in enumerate(wss):
                ws.head_map[self.run], ws.last_used[self.run] = head_map[:, i], last_used[:, i]
        for i, ws in enumerate(wss):
            past_k = self.counts[i] > K
            for layer in self.layers:
                ws.seeded[layer] = ws.seeded[layer] or past_k
            if self.caches[i] is not None:  # the host cache's LRU follows the selections
                self.caches[i].touch(self.layers[0], self.predicted[:, i].flatten(1), self.step)
        self.admitted = sel.admitted
        kv._count(predicted=sel.predicted.sum(), hits=sel.hits.sum(), wanted=sel.wanted.sum(),
                  admitted=sel.admitted.sum())
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
            self.src = self.ids[self.requests, self.blocks.clamp(min=0)] * kv.cfg.block_size
            return
        # A remote store is a host-side call: the admissions are compacted on the host here
        # (one read-back per job, in this stage only; one node never takes this path).
        keep = self.admitted
        self.layer_of, self.requests, self.blocks = (self.layer_of[keep], self.requests[keep],
                                                     self.blocks[keep])
        self.heads, self.dst, self.admitted = self.heads[keep], self.dst[keep], self.admitted[keep]
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
        self.admitted = self.admitted[ok]
        self.src = host[ok] * kv.cfg.block_size

    def local(self) -> None:
        """One vectorised gather of per-head block slices, host -> device slots: the
        candidates that were not admitted copy their slot's own rows back (a fixed-size copy
        whose indices never come back to the host; on CUDA the gather reads the pinned host
        pool through unified addressing, `transfers.device_view`). On the CPU only the
        admitted are copied (`compacts`)."""
        self._hook("local")
        if self.heads is None or len(self.heads) == 0:
            return
        kv, B = self.kv, self.kv.cfg.block_size
        _, _, hkv, slots, d = kv.device_kv.shape
        # both pools as rows of one head's block ([L * 2 * Hkv * blocks, B*d]): one
        # index_select and one index_copy_ of whole rows, 1.7x faster than indexing tokens
        device, host = kv.device_kv.view(-1, B * d), kv.host_rows
        dev = device.device
        head = ((self.layer_of + self.layers[0]) * 2 + torch.arange(2, device=dev)[:, None]) \
            * hkv + self.heads  # [2 (K, V), A]
        src = (head * (kv.host_kv.shape[3] // B) + self.src // B).flatten()
        dst = (head * (slots // B) + self.dst // B).flatten()
        admitted = self.admitted.repeat(2)  # [2A]
        if compacts(dev):
            keep = admitted.nonzero().squeeze(1)
            copy_rows(device, dst[keep], host, src[keep])
        else:
            rows = torch.where(admitted[:, None], host.index_select(0, src),
                               device.index_select(0, dst))
            device.index_copy_(0, dst, rows)
        kv._count(h2d_bytes=self.admitted.sum() * kv.block_bytes_per_head)
