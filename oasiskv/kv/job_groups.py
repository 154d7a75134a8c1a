"""Job grouping, a part of SparseKV (`kv/residency.py`): the layers of each prefetch job (runs
of prefetch_group layers on one node, for selections and fills alike), and the deferred
selections of a step submitted as one job per run of layers with the same requests."""

from __future__ import annotations

import torch

from oasiskv.config import CacheConfig
from oasiskv.kv.select_jobs import SelectJob
from oasiskv.kv.working_set import StepDecode
from oasiskv.prefetch.pipeline import PrefetchPipeline


class JobGroups:
    """SparseKV's job grouping (a mixin: SparseKV holds the state)."""

    cfg: CacheConfig
    pipeline: PrefetchPipeline
    device_kv: torch.Tensor  # [L, 2, Hkv, device_slots, d]
    step: int
    _deferred: list[tuple[int, list[StepDecode], torch.Tensor]]

    def _submit_selection(self, layers: list[int], decodes: list[StepDecode],
                          queries: torch.Tensor) -> None:
        """The next step's selection in `layers` (queries [R, layers, H, d]) as pipeline
        stages."""
        job = SelectJob(self, layers, list(zip(decodes, queries, strict=True)), self.step)
        self.pipeline.submit(layers, f"step {self.step}", [
            ("predict", job.predict), ("select", job.select), ("remote", job.remote),
            ("local", job.local)], [d.seq for d in decodes])

    @property
    def prefetch_group(self) -> int:
        """Layers per selection or fill job on one node (async; sync: all of them)."""
        L = self.device_kv.shape[0]
        if self.pipeline.executor.kind == "sync":
            return L
        return self.cfg.prefetch_group or max(1, L // 2)

    def layer_groups(self) -> list[slice]:
        """The layers of each job: runs of prefetch_group layers, for selections and fills
        alike, so that a layer waits at its run's first."""
        L, n = self.device_kv.shape[0], self.prefetch_group
        return [slice(i, min(i + n, L)) for i in range(0, L, n)]

    def _select_deferred(self) -> None:
        """The deferred selections (one node): each run of layers with the same requests as
        one job."""
        while self._deferred:
            decodes = self._deferred[0][1]
            n = next((i for i, (_, ds, _) in enumerate(self._deferred)
                      if list(map(id, ds)) != list(map(id, decodes))), len(self._deferred))
            run, self._deferred = self._deferred[:n], self._deferred[n:]
            queries = torch.stack([qs for _, _, qs in run], 1)  # [R, layers, H, d]
            self._submit_selection([layer for layer, _, _ in run], decodes, queries)
