"""The stages of one (layer, step) working-set selection for a batch's sparse requests:
predict (scores + per-head top-K), select (capped LRU, head maps updated), remote (a no-op on
one node), local (one gather host -> device slots). The pipeline runs them in order, inline or
in workers; `kv/residency.py` creates them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from oasiskv.kv.select import block_scores, select_capped_lru_batch

if TYPE_CHECKING:
    from oasiskv.kv.residency import SparseKV, StepDecode


def pinned_blocks(lengths: torch.Tensor, n: int, sink: int, recent: int) -> torch.Tensor:
    """[R, n] True for each request's first `sink` and last `recent` complete blocks: they
    score +inf, so top-K always keeps them (and, once resident, they are always hits)."""
    idx = torch.arange(n)[None, :]
    real = idx < lengths[:, None]
    return real & ((idx < sink) | (idx >= lengths[:, None] - recent))


class SelectJob:
    """The four stages of one (layer, step) selection, batched over the requests."""

    def __init__(self, kv: SparseKV, layer: int, picks: list[tuple[StepDecode, torch.Tensor]],
                 step: int) -> None:
        self.kv, self.layer, self.step = kv, layer, step
        # only requests with complete blocks select; working sets captured now (a request
        # may end, and drop its working set, while the job runs)
        self.picks = [(d, q) for d, q in picks if len(d.host_ids)]
        self.working_sets = [d.seq.working_set for d, _ in self.picks]
        self.ids = self.lengths = self.predicted = None
        self.heads = self.dst = self.src = None

    def _hook(self, stage: str) -> None:
        hook = self.kv.stage_hooks.get(stage)
        if hook is not None:
            hook(self.layer, [d.seq for d, _ in self.picks])

    def predict(self) -> None:
        """Scores every request's complete blocks with its query; per-head top-K."""
        self._hook("predict")
        if not self.picks:
            return
        kv, K = self.kv, self.kv.cfg.top_k
        kmin, kmax = kv.kmin[self.layer], kv.kmax[self.layer]  # [host_blocks, Hkv, d]
        self.ids = pad_sequence([d.host_ids for d, _ in self.picks], batch_first=True)  # [R, n]
        self.lengths = torch.tensor([len(d.host_ids) for d, _ in self.picks])
        n = self.ids.shape[1]
        scores = torch.full((len(self.picks), kmin.shape[1], n), float("-inf"))  # [R, Hkv, n]
        for r, (d, query) in enumerate(self.picks):
            if d.host_start is not None:  # one run of host blocks: score a view, no gather
                run = slice(d.host_start, d.host_start + len(d.host_ids))
                lo, hi = kmin[run], kmax[run]
            else:
                lo, hi = kmin[d.host_ids], kmax[d.host_ids]
            scores[r, :, :len(d.host_ids)] = block_scores(query, lo, hi, kv.cfg.score_alpha)
        scores.masked_fill_(pinned_blocks(self.lengths, n, kv.cfg.sink_blocks,
                                          kv.cfg.recent_blocks)[:, None, :], float("inf"))
        top = torch.topk(scores, min(K, n), dim=-1, sorted=True).indices  # [R, Hkv, k]
        real = torch.arange(top.shape[-1]) < self.lengths.clamp(max=K)[:, None]  # [R, k]
        self.predicted = top.masked_fill(~real[:, None, :], -2)

    def select(self) -> None:
        """Hits stay; up to the cap of misses replace LRU victims (head maps updated)."""
        self._hook("select")
        if self.predicted is None:
            return
        kv, layer, K, B = self.kv, self.layer, self.kv.cfg.top_k, self.kv.cfg.block_size
        wss = self.working_sets
        head_map = torch.stack([ws.head_map[layer] for ws in wss])  # [R, K, Hkv]
        last_used = torch.stack([ws.last_used[layer] for ws in wss])
        k = self.predicted.shape[-1]
        caps = torch.tensor([kv.fetch_cap if ws.seeded[layer] else k for ws in wss])
        sel = select_capped_lru_batch(head_map, last_used, self.predicted, caps, self.step)
        for i, ws in enumerate(wss):
            ws.head_map[layer], ws.last_used[layer] = head_map[i], last_used[i]
            ws.seeded[layer] = ws.seeded[layer] or int(self.lengths[i]) > K
        kv._count(predicted=int(sel.predicted.sum()), hits=int(sel.hits.sum()),
                  wanted=int(sel.wanted.sum()), admitted=len(sel.slots))
        slab = torch.stack([d.slab_tokens for d, _ in self.picks])  # [R, K+1]
        self.heads = sel.heads
        self.dst = slab[sel.requests, sel.slots]
        self.src = self.ids[sel.requests, sel.blocks] * B

    def remote(self) -> None:
        """Single node: the host tier holds every block, nothing to fetch from remote memory."""
        self._hook("remote")

    def local(self) -> None:
        """One vectorised gather of per-head block slices, host -> device slots."""
        self._hook("local")
        if self.heads is None or len(self.heads) == 0:
            return
        kv, B = self.kv, self.kv.cfg.block_size
        arange_b = torch.arange(B)
        h = self.heads[:, None]
        kv.device_kv[self.layer][:, h, self.dst[:, None] + arange_b] = \
            kv.host_kv[self.layer][:, h, self.src[:, None] + arange_b]
        kv._count(h2d_bytes=len(self.heads) * kv.block_bytes_per_head)
