"""The stages of one (layer, step) working-set selection for a batch's sparse requests:
predict (scores + per-head top-K), select (capped LRU, head maps updated), remote (a no-op on
one node), local (one gather host -> device slots). The pipeline runs them in order, inline or
in workers; `kv/residency.py` creates them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from oasiskv.kv.select import block_scores, select_capped_lru, top_k_blocks

if TYPE_CHECKING:
    from oasiskv.kv.residency import SparseKV, StepDecode, WorkingSet


class SelectJob:
    """The four stages of one (layer, step) selection for a batch's requests."""

    def __init__(self, kv: SparseKV, layer: int, picks: list[tuple[StepDecode, torch.Tensor]],
                 step: int) -> None:
        self.kv, self.layer, self.picks, self.step = kv, layer, picks, step
        # captured now: a request may end (and drop its working set) while the job runs
        self.working_sets = [d.seq.working_set for d, _ in picks]
        self.predicted: list[tuple[StepDecode, WorkingSet, torch.Tensor]] = []
        self.heads: list[torch.Tensor] = []
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []

    def _hook(self, stage: str) -> None:
        hook = self.kv.stage_hooks.get(stage)
        if hook is not None:
            hook(self.layer, [d.seq for d, _ in self.picks])

    def predict(self) -> None:
        """Scores each request's complete blocks with its query ([H, d]); per-head top-K."""
        self._hook("predict")
        kv, layer = self.kv, self.layer
        for (d, query), ws in zip(self.picks, self.working_sets, strict=True):
            if len(d.host_ids) == 0:
                continue
            scores = block_scores(query, kv.kmin[layer, d.host_ids], kv.kmax[layer, d.host_ids],
                                  kv.cfg.score_alpha)
            self.predicted.append((d, ws, top_k_blocks(scores, kv.cfg.top_k)))

    def select(self) -> None:
        """Hits stay; up to the cap of misses replace LRU victims (head maps updated)."""
        self._hook("select")
        kv, layer, B = self.kv, self.layer, self.kv.cfg.block_size
        counts = dict(predicted=0, hits=0, wanted=0, admitted=0)
        for d, ws, top in self.predicted:
            cap = kv.fetch_cap if ws.seeded[layer] else None
            sel = select_capped_lru(ws.head_map[layer], ws.last_used[layer], top, cap,
                                    self.step)
            ws.seeded[layer] = ws.seeded[layer] or len(d.host_ids) > kv.cfg.top_k
            counts["predicted"] += sel.predicted
            counts["hits"] += sel.hits
            counts["wanted"] += sel.wanted
            counts["admitted"] += len(sel.slots)
            self.heads.append(sel.heads)
            self.dst.append(d.slab_tokens[sel.slots])
            self.src.append(d.host_ids[sel.blocks] * B)
        kv._count(**counts)

    def remote(self) -> None:
        """Single node: the host tier holds every block, nothing to fetch from remote memory."""
        self._hook("remote")

    def local(self) -> None:
        """One vectorised gather of per-head block slices, host -> device slots."""
        self._hook("local")
        if not self.heads:
            return
        heads, dst, src = torch.cat(self.heads), torch.cat(self.dst), torch.cat(self.src)
        if len(heads) == 0:
            return
        kv, B = self.kv, self.kv.cfg.block_size
        arange_b = torch.arange(B)
        h = heads[:, None]
        kv.device_kv[self.layer][:, h, dst[:, None] + arange_b] = \
            kv.host_kv[self.layer][:, h, src[:, None] + arange_b]
        kv._count(h2d_bytes=len(heads) * kv.block_bytes_per_head)
