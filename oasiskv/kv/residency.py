"""Device working sets of sparse requests: head maps, local fetch, block fills (paper §3.2).

A sparse request holds one slab of K+2 device blocks, laid out by `kv/slab.Slab`: slot s < K of
KV head g holds the logical block head_map[s, g]; then the active (filling) block, attended by
every head, and the draft block (the step's drafts' K/V).
The host tier holds the request's complete history as whole blocks; the summary (kmin/kmax)
of every complete block lives on the device and drives selection. Summaries are indexed by
the request's summary ids (`seq.summary_ids`), host blocks by `seq.host_table`: the same ids
on one node. With a remote store the prompt goes to the store after prefill and the host keeps
a bounded cache of it (`kv/host_cache.py`): host blocks are then looked up per layer, and the
pipeline's remote stage fetches admitted blocks that the host lacks; the summaries of every
block stay.

Prefetch (lookahead/previous): after layer l's attention of step t the next step's selection
and fetch for layer l go to the prefetch pipeline as stages (predict, select, remote, local);
blocks that step t completed enter the working sets as fill jobs after the step.
Layer l's attention of step t+1 first waits for layer l's jobs (and for nothing else). With
`prefetch="sync"` the same stages run inline, so both modes compute the same thing. On one
node a selection or fill job holds several layers, batched (layer l's work only touches layer
l's slots, so the result is the same, with one round of small tensor ops, and with a remote
store one store call, instead of one per layer): async, runs of `prefetch_group` layers, a
selection once the last of its layers has attended; sync, every layer, the selections at the
step's end.

SparseKV holds the state; its concerns live in their own modules: the slot layout
(`kv/slab.py`), the fetch cap and its calibration (`kv/fetch_cap.py`), the selection stages
and their scorers (`kv/select_jobs.py`, `kv/predictors.py`, `kv/scorers.py`), slab loading and
fills (`kv/slab_fill.py`), prompt storage and summaries (`kv/prompt_store.py`), attention's
per-layer hooks (`kv/layer_hooks.py`), job grouping (`kv/job_groups.py`) and the counters
(`kv/counters.py`); this module keeps the step boundaries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from oasiskv.config import CacheConfig
from oasiskv.context import SeqAttention
from oasiskv.kv.blocks import is_contiguous
from oasiskv.kv.counters import CounterTally, SparseCounters
from oasiskv.kv.fetch_cap import FetchCap, block_bytes_per_head, measure_fetch_bandwidth
from oasiskv.kv.job_groups import JobGroups
from oasiskv.kv.layer_hooks import SparseLayerHooks
from oasiskv.kv.predictors import Predictor, make_predictor
from oasiskv.kv.prompt_store import PromptStore
from oasiskv.kv.slab import Slab
from oasiskv.kv.slab_fill import SlabFills
from oasiskv.kv.transfers import device_view, upload
from oasiskv.kv.working_set import StepDecode
from oasiskv.prefetch.executor import InlineExecutor
from oasiskv.prefetch.pipeline import PrefetchPipeline
from oasiskv.sequence import Sequence

if TYPE_CHECKING:
    from oasiskv.kv.remote_tier import RemoteTier


@dataclass
class SparseKV(SparseLayerHooks, SlabFills, PromptStore, JobGroups):
    """Selection, local fetch and fills for the sparse requests of each step; attention's
    per-layer hooks (`context.LayerHooks`: wait_layer, prepare_layer, after_attention)."""

    cfg: CacheConfig
    device_kv: torch.Tensor  # [L, 2, Hkv, device_slots, d]
    host_kv: torch.Tensor  # [L, 2, Hkv, host_slots, d]
    # [L, summary_ids * S, Hkv, d] summaries: summary id i's S = summary_splits sub-blocks at
    # rows i*S .. i*S+S-1 (`summaries.summary_rows`; S = 1: indexed by summary id)
    kmin: torch.Tensor
    kmax: torch.Tensor
    pipeline: PrefetchPipeline = field(default_factory=lambda: PrefetchPipeline(
        InlineExecutor()))
    step: int = 0
    counters: SparseCounters = field(default_factory=SparseCounters)
    last_step: SparseCounters = field(default_factory=SparseCounters)
    frozen: bool = False  # benchmarks: no prefetch at all once seeded (working sets frozen)
    remote: RemoteTier | None = None  # the remote store under bounded host caches, if any
    scales: list[float] = field(default_factory=list)  # per layer: attention scale (oracle, rerank)
    # rerank_source=int8/int4: every complete block's keys as codes [L, summary_ids, Hkv, d, B]
    # (int4: uint8 [..., d, B/2], two codes a byte)
    # with a scale per block and KV head [L, summary_ids, Hkv], indexed like the summaries
    key_codes: torch.Tensor | None = None
    key_scales: torch.Tensor | None = None
    # stage name -> hook(layer, requests) run at the start of that stage (tests: delays, faults)
    stage_hooks: dict[str, Callable[[int, list[Sequence]], None]] = field(default_factory=dict)
    _decodes: list[StepDecode] = field(default_factory=list)
    # one node: (layer, decodes, queries [R, H, d]) whose selection waits to join a job
    _deferred: list[tuple[int, list[StepDecode], torch.Tensor]] = field(default_factory=list)
    _batches: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    tally: CounterTally = field(default_factory=CounterTally)  # jobs' counts, not yet taken
    slab: Slab = field(init=False)  # the slot layout of every request's slab
    predictor: Predictor = field(init=False)  # cfg.predictor's: when and how blocks are chosen
    cap: FetchCap = field(init=False)  # admissions per head, layer and step once seeded

    _mark: float | None = None  # trace: when the foreground's current layer began
    _step_start: float = 0.0
    _scales: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    host_view: torch.Tensor = field(init=False)  # host_kv where the device's kernels read it

    def __post_init__(self) -> None:
        self.host_view = device_view(self.host_kv, self.device_kv.device)
        self.slab = Slab(self.cfg.top_k, self.cfg.block_size)
        self.predictor = make_predictor(self.cfg)
        self.cap = FetchCap(self.cfg.top_k, self.cfg.fetch_cap, auto=self.cfg.f_hbm == "auto")
        if self.cap.auto:
            self.cap.bandwidth = measure_fetch_bandwidth(self.device_kv, self.host_view,
                                                         self.cfg.block_size)

    @property
    def fetch_cap(self) -> int:
        return self.cap.value

    @property
    def host_rows(self) -> torch.Tensor:
        """The host pool as rows of one head's block, [L * 2 * Hkv * host blocks, B*d]."""
        return self.host_view.view(-1, self.cfg.block_size * self.host_kv.shape[-1])

    def layer_scales(self, layers: list[int]) -> torch.Tensor:
        """The attention scale of each of `layers` on the device, [layers] (1/sqrt(d) when
        the engine gave none); built once per run of layers (foreground)."""
        key = tuple(layers)
        if key not in self._scales:
            scales = self.scales or [self.kmin.shape[-1] ** -0.5] * (max(layers) + 1)
            self._scales[key] = upload(torch.tensor([scales[layer] for layer in layers],
                                                    dtype=torch.float32), self.kmin.device)
        return self._scales[key]

    @property
    def block_bytes_per_head(self) -> int:  # K and V of one head's slice of one block
        return block_bytes_per_head(self.device_kv, self.cfg.block_size)

    # ---- step boundaries ------------------------------------------------------------------

    def begin_step(self, decodes: list[tuple[Sequence, SeqAttention]]) -> None:
        if self._decodes:  # the previous step failed: its jobs' work is not to be trusted
            self._reset([d.seq for d in self._decodes])
        self.step += 1
        self.last_step = SparseCounters()
        self._decodes, self._batches, self._deferred = [], {}, []
        self._step_start, self._mark = time.perf_counter(), None
        for seq, attn in decodes:
            d = self._decode(seq, attn, seq.num_computed_tokens)
            if seq.working_set is None:
                self.flush()  # the slab may be a finished request's, with jobs in flight
                self._load(d)
            self._decodes.append(d)

    def batch_tensors(self, decodes: list[StepDecode]) -> tuple[torch.Tensor, ...]:
        """(summary ids [R, n] zero-padded, their counts [R], slab token slots [R, K+1]) of
        some of this step's decodes: built once per step, since every layer's job reads the
        same (foreground only: jobs get them at construction)."""
        key = tuple(id(d) for d in decodes)
        if key not in self._batches:
            self._batches[key] = tuple(upload(t, self.kmin.device) for t in (
                pad_sequence([d.summary_ids for d in decodes], batch_first=True),
                torch.tensor([len(d.summary_ids) for d in decodes]),
                torch.stack([d.slab_tokens for d in decodes])))
        return self._batches[key]

    def _reset(self, seqs: list[Sequence]) -> None:
        """Drops the working sets of requests whose prefetch failed or whose step failed:
        they load and select afresh (exact, uncapped) at their next decode step."""
        for e in self.pipeline.drain():
            seqs = seqs + list(getattr(e, "owners", []))
        for seq in seqs:
            seq.working_set = None

    def flush(self) -> None:
        """Waits for every pending job and counts its work (stats, shutdown, slab reuse)."""
        self._reset([])
        self._take_pending(wait=True)

    def release(self, seq: Sequence) -> None:
        """Before a request's blocks are freed: waits for every job that may still write them
        (also the jobs of other layers when one of its jobs failed), so that the request that
        gets the blocks next never sees a stale fill or fetch land in them."""
        if self.pipeline.touches(seq):
            self.flush()

    def _count(self, **amounts: float) -> None:
        self.tally.count(**amounts)  # jobs count from worker threads

    def _take_pending(self, wait: bool = False) -> None:
        """The jobs' counts, read back once (end of step, flush); with `wait`, also those of
        jobs still running on a device stream."""
        pending = self.tally.take(wait)
        pending.stall_s += self.pipeline.take_stall()
        self.last_step.add(pending)
        self.counters.add(pending)

    def _decode(self, seq: Sequence, attn: SeqAttention | None, pos: int) -> StepDecode:
        full = seq.summary_ids[:pos // self.cfg.block_size]
        return StepDecode(seq, attn, pos, torch.tensor(full, dtype=torch.long),
                          self.slab.slot_starts(seq.block_table),
                          full[0] if full and is_contiguous(full) else None)

    def end_step(self) -> None:
        """After a successful forward: blocks that the step's tokens filled go to the host,
        get their summary, and enter every head's working set (one job per layer)."""
        B = self.cfg.block_size
        self._trace_layer(self.device_kv.shape[0] - 1)
        self._select_deferred()  # before the fills: a filled block displaces the step's picks
        self._write_through([d for d in self._decodes if (d.pos + 1) % B])
        self._submit_fills([(d, d.pos // B) for d in self._decodes if (d.pos + 1) % B == 0])
        if self.cap.auto and self._decodes:  # f_hbm=auto: a unit of cap moves one block-head
            L, _, hkv = self.device_kv.shape[:3]  # in every layer, KV head and request
            self.cap.retune(time.perf_counter() - self._step_start,
                            self.block_bytes_per_head * L * hkv * len(self._decodes))
        self._decodes = []
        self._take_pending()

