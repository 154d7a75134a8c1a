"""Attention's per-layer hooks, a part of SparseKV (`kv/residency.py`), the `context.LayerHooks`
protocol: before a layer's K/V writes, wait for its prefetch jobs; before its attention, select
on the critical path where the predictor does (or on a request's first step) and set each
request's masks; after it, hand the next step's prediction to the job grouping."""

from __future__ import annotations

import time

import torch

from oasiskv.config import CacheConfig
from oasiskv.kv import select_kernel
from oasiskv.kv.predictors import Predictor
from oasiskv.kv.select import draft_weights, mixed_queries
from oasiskv.kv.select_jobs import SelectJob
from oasiskv.kv.transfers import upload
from oasiskv.kv.working_set import StepDecode
from oasiskv.prefetch.executor import InlineExecutor, PrefetchError
from oasiskv.prefetch.pipeline import PrefetchPipeline


class SparseLayerHooks:
    """SparseKV's per-layer hooks (a mixin: SparseKV holds the state)."""

    cfg: CacheConfig
    pipeline: PrefetchPipeline
    predictor: Predictor
    step: int
    frozen: bool
    _decodes: list[StepDecode]
    _deferred: list[tuple[int, list[StepDecode], torch.Tensor]]
    _mark: float | None
    _batches: dict

    def wait_layer(self, layer: int) -> None:
        """Before layer `layer`'s K/V writes (which must not reach the active slot while a
        fill job still reads it) and attention: waits for the layer's prefetch jobs, and for
        nothing else."""
        self._trace_layer(layer - 1)
        try:
            self.pipeline.wait(layer)
        except PrefetchError as e:
            for seq in e.owners:  # their working sets may be half updated
                seq.working_set = None
            raise
        self._mark = time.perf_counter()

    def _trace_layer(self, layer: int) -> None:
        """Foreground span of the layer that just ran (from its wait to the next one)."""
        tracer = self.pipeline.tracer
        if tracer is not None and self._mark is not None and layer >= 0:
            tracer.span("foreground", f"L{layer} step {self.step}", self._mark,
                        time.perf_counter())

    def prepare_layer(self, layer: int, q: torch.Tensor) -> None:
        """Before layer `layer`'s attention. With the exact or oracle predictor (and on a
        request's first decode step, when no earlier step chose its blocks) the step's own
        query q[row] ([N, H, d]) selects here, on the critical path. Then sets each request's
        masks."""
        B, critical = self.cfg.block_size, self.predictor.critical_path
        picks = []
        for d in self._decodes:
            if critical or not d.seq.working_set.primed[layer]:
                picks.append((d, q[d.attn.q_start][None]))
        if picks:  # on the critical path, with the stages' error reporting and trace spans
            job = SelectJob(self, [layer], picks, self.step)
            inline = InlineExecutor()
            inline.tracer = self.pipeline.tracer
            for stage, fn in (("predict", job.predict), ("select", job.select),
                              ("remote", job.remote), ("local", job.local)):
                try:
                    inline.submit(stage, fn, label=f"L{layer} step {self.step}").wait()
                except PrefetchError:
                    for d, _ in picks:
                        d.seq.working_set = None
                    raise
        if not self._decodes:
            return
        # masks for the whole batch at once: slot k of head g is valid when it holds a block;
        # the active block's tokens up to this step's position. One buffer a step, each
        # request's mask a view of it (attention reads them), rewritten layer by layer
        maps = [d.seq.working_set.head_map for d in self._decodes]  # [L, K, Hkv] each
        R, (_, K, hkv), dev = len(maps), maps[0].shape, maps[0].device
        if "masks" not in self._batches:  # once a step: the active part built on the host
            filled = torch.tensor([d.pos % B for d in self._decodes])
            active = upload(torch.arange(B) <= filled[:, None], dev)  # [R, B]
            masks = torch.empty(R, hkv, (K + 1) * B, dtype=torch.bool, device=dev)
            masks[..., K * B:] = active[:, None]
            for d, mask in zip(self._decodes, masks, strict=True):
                d.attn.kv_valid = mask  # [Hkv, (K+1)*B]
            self._batches["masks"] = masks
        masks = self._batches["masks"]
        if (ext := select_kernel.serves(masks, *maps)) is not None:
            ext.resident_masks(maps, layer, masks, B)
            return
        resident = torch.stack([m[layer] for m in maps]) >= 0  # [R, K, Hkv]
        masks[..., :K * B].view(R, hkv, K, B).copy_(
            resident.transpose(1, 2)[..., None].expand(R, hkv, K, B))

    def after_attention(self, layer: int, q: torch.Tensor) -> None:
        """After layer `layer`'s attention has read the slab: submits the prediction of the
        next step's blocks (lookahead: the drafts' weighted query; previous: this step's
        query) and their fetch to the pipeline, so the next step only attends."""
        if self.predictor.critical_path or not self._decodes:
            return
        decodes = [d for d in self._decodes
                   if not (self.frozen and all(d.seq.working_set.seeded))]
        if not decodes:
            return
        # the predicting rows (lookahead: the drafts', their mean weighted by each one's
        # chance of being taken, greedy: the first; previous: the step's own)
        rows = self.predictor.query_rows([d.attn for d in decodes])
        # rows and weights are the same in every layer: on the device once a step (a tensor
        # from Python data each layer would stop the host on CUDA, every layer); requests
        # with fewer rows repeat their first at weight 0, so the batch is one gather
        key = ("rows", *map(id, decodes))
        if key not in self._batches:
            m, first = max(map(len, rows)), rows[0][0]
            if m == 1 and [r[0] for r in rows] == list(range(first, first + len(rows))):
                self._batches[key] = (slice(first, first + len(rows)), None)  # a view of q
            else:
                self._batches[key] = tuple(upload(t, q.device) for t in (
                    torch.tensor([r + r[:1] * (m - len(r)) for r in rows]),
                    draft_weights([d.seq.draft_weights for d in decodes], m,
                                  list(map(len, rows)))))
        index, w = self._batches[key]
        queries = q[index] if w is None else mixed_queries(q[index], w)  # [R, H, d]
        for d in decodes:
            d.seq.working_set.primed[layer] = True
        self._deferred.append((layer, decodes, queries))
        if self.pipeline.executor.kind == "async" and any(
                layer == run.stop - 1 for run in self.layer_groups()):  # its run's last layer
            self._select_deferred()

