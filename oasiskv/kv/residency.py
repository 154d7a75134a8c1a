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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

from oasiskv.config import CacheConfig
from oasiskv.context import SeqAttention
from oasiskv.engine.sequence import Sequence
from oasiskv.kv.blocks import is_contiguous
from oasiskv.kv.predictors import Predictor, make_predictor
from oasiskv.kv.select import insert_block, mixed_queries
from oasiskv.kv.select_jobs import SelectJob
from oasiskv.kv.slab import Slab
from oasiskv.kv.summaries import quantize_keys, round_outward, summarize, summary_rows
from oasiskv.prefetch.executor import InlineExecutor, PrefetchError
from oasiskv.prefetch.pipeline import PrefetchPipeline

if TYPE_CHECKING:
    from oasiskv.kv.remote_tier import RemoteTier


@dataclass
class WorkingSet:
    head_map: torch.Tensor  # [L, K, Hkv] logical block per (slot, head); -1 = empty
    last_used: torch.Tensor  # [L, K, Hkv] when the slot's block was last selected (select.stamp)
    seeded: list[bool]  # per layer: the cap applies once a top-K set was chosen uncapped
    primed: list[bool]  # per layer: the previous step already chose this step's blocks


@dataclass
class SparseCounters:
    predicted: int = 0  # blocks predicted (summed over requests, layers, heads)
    hits: int = 0  # ... already resident
    wanted: int = 0  # ... not resident
    admitted: int = 0  # ... copied in (wanted - admitted were held back by the cap)
    h2d_bytes: int = 0  # host -> device: local fetches and active-block loads
    d2h_bytes: int = 0  # device -> host: filled blocks
    host_write_bytes: int = 0  # prefill K/V written straight to the host tier
    remote_bytes: int = 0  # remote store -> host cache: misses fetched during decode
    remote_blocks: int = 0  # ... in blocks (one layer's block each)
    remote_put_bytes: int = 0  # host -> remote store: complete prompt blocks after prefill
    handoff_bytes: int = 0  # decode worker: hand-overs' admission bytes (kept blocks + rest)
    host_evictions: int = 0  # prompt blocks the host caches dropped (still in the store)
    stall_s: float = 0.0  # foreground time waiting for prefetch jobs

    def add(self, other: SparseCounters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class StepDecode:
    seq: Sequence
    attn: SeqAttention | None  # None for a token committed after the step (accepted draft)
    pos: int  # position of the step's token
    summary_ids: torch.Tensor  # [n_full] summary id of each complete logical block (one node:
    # also its host block)
    slab_tokens: torch.Tensor  # [K+1] first device token slot of each attended slot (Slab)
    summary_start: int | None = None  # summary_ids[0] when they are one run (a view)


@dataclass
class SparseKV:
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
    fetch_cap: int = 0  # admissions per head, layer and step once seeded (0: from cfg)
    fetch_bandwidth: float = 0.0  # f_hbm=auto: bytes/s of a local fetch, measured at start
    forward_s: float = 0.0  # f_hbm=auto: moving estimate of a decode step's forward time
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
    _pending: SparseCounters = field(default_factory=SparseCounters)  # jobs' counts
    _lock: threading.Lock = field(default_factory=threading.Lock)
    slab: Slab = field(init=False)  # the slot layout of every request's slab
    predictor: Predictor = field(init=False)  # cfg.predictor's: when and how blocks are chosen

    _mark: float | None = None  # trace: when the foreground's current layer began
    _step_start: float = 0.0

    def __post_init__(self) -> None:
        self.slab = Slab(self.cfg.top_k, self.cfg.block_size)
        self.predictor = make_predictor(self.cfg)
        if not self.fetch_cap:
            self.fetch_cap = self.cfg.fetch_cap
        if self.cfg.f_hbm == "auto":
            self.fetch_bandwidth = self.measure_fetch_bandwidth()

    def measure_fetch_bandwidth(self, slices: int = 512, repeats: int = 5) -> float:
        """Bytes/s of the local-fetch gather (per-head block slices host -> device), timed on
        the pools' first slots before anything lives there."""
        B = self.cfg.block_size
        hkv = self.device_kv.shape[2]
        blocks = min(self.device_kv.shape[3], self.host_kv.shape[3]) // B
        n = min(slices, blocks * hkv)
        heads = (torch.arange(n) % hkv)[:, None]
        starts = (torch.arange(n) // hkv * B)[:, None] + torch.arange(B)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.device_kv[0][:, heads, starts] = self.host_kv[0][:, heads, starts]
            if self.device_kv.is_cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return n * self.block_bytes_per_head / best

    def _retune(self, num_decodes: int) -> None:
        """f_hbm=auto: the cap whose admissions (all heads, layers, requests) move in one
        forward pass at the measured bandwidth."""
        if self.cfg.f_hbm != "auto" or not num_decodes:
            return
        forward = time.perf_counter() - self._step_start
        self.forward_s = forward if not self.forward_s else 0.8 * self.forward_s + 0.2 * forward
        L, _, hkv = self.device_kv.shape[:3]
        per_cap = self.block_bytes_per_head * L * hkv * num_decodes  # bytes of one cap unit
        cap = int(self.fetch_bandwidth * self.forward_s / per_cap)
        self.fetch_cap = max(1, min(self.cfg.top_k, cap))

    @property
    def block_bytes_per_head(self) -> int:  # K and V of one head's slice of one block
        return 2 * self.cfg.block_size * self.device_kv.shape[-1] * self.device_kv.element_size()

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
            self._batches[key] = (
                pad_sequence([d.summary_ids for d in decodes], batch_first=True),
                torch.tensor([len(d.summary_ids) for d in decodes]),
                torch.stack([d.slab_tokens for d in decodes]))
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
        self._take_pending()

    def release(self, seq: Sequence) -> None:
        """Before a request's blocks are freed: waits for every job that may still write them
        (also the jobs of other layers when one of its jobs failed), so that the request that
        gets the blocks next never sees a stale fill or fetch land in them."""
        if self.pipeline.touches(seq):
            self.flush()

    def _count(self, **amounts: float) -> None:
        with self._lock:  # jobs count from worker threads
            for name, value in amounts.items():
                setattr(self._pending, name, getattr(self._pending, name) + value)

    def _take_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, SparseCounters()
        pending.stall_s += self.pipeline.take_stall()
        self.last_step.add(pending)
        self.counters.add(pending)

    def _decode(self, seq: Sequence, attn: SeqAttention | None, pos: int) -> StepDecode:
        full = seq.summary_ids[:pos // self.cfg.block_size]
        return StepDecode(seq, attn, pos, torch.tensor(full, dtype=torch.long),
                          self.slab.slot_starts(seq.block_table),
                          full[0] if full and is_contiguous(full) else None)

    def _load(self, d: StepDecode) -> None:
        """First sparse decode step of a request: empty head map; the active block's tokens so
        far come from the host (its complete blocks are admitted by the first selection)."""
        L, _, hkv, _, _ = self.device_kv.shape
        K = self.slab.working
        d.seq.working_set = WorkingSet(torch.full((L, K, hkv), -1, dtype=torch.long),
                                       torch.zeros((L, K, hkv), dtype=torch.long), [False] * L,
                                       [False] * L)
        self.load_slab(d.seq, d.pos)

    def slab_kv(self, seq: Sequence) -> torch.Tensor:
        """The request's working-set slots as they are on the device, [L, K, 2, Hkv, B, d]:
        head h's part of slot s holds block head_map[l, s, h] (nothing where that is -1)."""
        L, _, hkv, _, d = self.device_kv.shape
        K, B = self.slab.working, self.cfg.block_size
        tokens = self.slab.working_tokens(seq.block_table).to(self.device_kv.device)  # [K*B]
        kv = self.device_kv[:, :, :, tokens]
        return kv.view(L, 2, hkv, K, B, d).permute(0, 3, 1, 2, 4, 5).cpu()

    def load_slab(self, seq: Sequence, pos: int, slots: torch.Tensor | None = None) -> None:
        """Fills the request's slab: each layer's working-set blocks into their (slot, head),
        from the host or, given `slots` ([L, K, 2, Hkv, B, d], slab_kv of another engine),
        from there; then the active block's tokens before `pos`; empty slots are zeroed."""
        B = self.cfg.block_size
        slab = self.slab.slot_starts(seq.block_table)  # [K+1]
        # Empty slots are masked out, but 0 * NaN is NaN in probs @ V: clear the slab's bytes
        # (draft slots included: attention reads them all, the step's drafts' K/V in a few).
        for block in seq.block_table[:self.slab.blocks]:
            self.device_kv[:, :, :, block * B:(block + 1) * B] = 0
        if slots is not None:
            L, _, _, hkv, _, d = slots.shape
            empty = (seq.working_set.head_map < 0)[:, :, None, :, None, None]  # [L, K, 1, Hkv]
            kv = slots.masked_fill(empty, 0).permute(0, 2, 3, 1, 4, 5).reshape(L, 2, hkv, -1, d)
            tokens = self.slab.working_tokens(seq.block_table).to(self.device_kv.device)
            self.device_kv[:, :, :, tokens] = kv.to(self.device_kv)
            moved = kv.numel()
        else:
            moved = self._gather_working_set(seq, slab)
        filled = pos % B
        if filled:
            src = self.host_block(seq, pos // B) * B
            dst = int(slab[self.slab.active])
            self.device_kv[:, :, :, dst:dst + filled] = self.host_kv[:, :, :, src:src + filled]
            moved += self.device_kv[:, :, :, :filled].numel()
        self._count(h2d_bytes=moved * self.device_kv.element_size())

    def _gather_working_set(self, seq: Sequence, slab: torch.Tensor) -> int:
        """Each layer's working-set blocks from the host into their (slot, head); returns the
        elements moved."""
        B, arange_b, moved = self.cfg.block_size, torch.arange(self.cfg.block_size), 0
        cache, table = seq.host_cache, torch.tensor(seq.host_table, dtype=torch.long)
        for layer, head_map in enumerate(seq.working_set.head_map):  # [K, Hkv]
            slots, heads = (head_map >= 0).nonzero(as_tuple=True)
            if not len(slots):
                continue
            blocks = head_map[slots, heads]
            host = table[blocks] if cache is None else cache.where[layer, blocks]
            src, dst = host[:, None] * B + arange_b, slab[slots, None] + arange_b  # [n, B]
            kv, host_kv = self.device_kv[layer], self.host_kv[layer]
            kv[:, heads[:, None], dst] = host_kv[:, heads[:, None], src]
            moved += src.numel() * 2 * kv.shape[-1]
        return moved

    @staticmethod
    def host_block(seq: Sequence, block: int) -> int:
        """Host block of a logical block that is never evicted (a generated one, or any block
        without a remote store): the same in every layer."""
        cache = seq.host_cache
        return seq.host_table[block] if cache is None else int(cache.where[0, block])

    def end_step(self) -> None:
        """After a successful forward: blocks that the step's tokens filled go to the host,
        get their summary, and enter every head's working set (one job per layer)."""
        B = self.cfg.block_size
        self._trace_layer(self.device_kv.shape[0] - 1)
        self._select_deferred()  # before the fills: a filled block displaces the step's picks
        self._write_through([d for d in self._decodes if (d.pos + 1) % B])
        self._submit_fills([(d, d.pos // B) for d in self._decodes if (d.pos + 1) % B == 0])
        self._retune(len(self._decodes))
        self._decodes = []
        self._take_pending()

    def _write_through(self, decodes: list[StepDecode]) -> None:
        """The K/V of each decode's token (not completing a block: the fill moves that block
        whole) goes from the active slot to the host too, so that a request whose working set
        is dropped (a failed step or stage) reloads its active block from there intact."""
        if not decodes:
            return
        B, active = self.cfg.block_size, self.slab.active
        src = torch.tensor([int(d.slab_tokens[active]) + d.pos % B for d in decodes])
        dst = torch.tensor([self.host_block(d.seq, d.pos // B) * B + d.pos % B for d in decodes])
        tokens = self.device_kv[:, :, :, src.to(self.device_kv.device)]  # [L, 2, Hkv, n, d]
        self.host_kv[:, :, :, dst] = tokens.to(self.host_kv.device)
        self._count(d2h_bytes=tokens.numel() * tokens.element_size())

    def commit_token(self, seq: Sequence, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """An accepted draft's K/V ([L, Hkv, d] each) joins the active block at `pos`, on the
        host too; when it completes the block, the block fills as after any decode step."""
        B = self.cfg.block_size
        self.flush()  # the active slot may still be read by the step's fill jobs
        block = pos // B
        host = self.host_block(seq, block) * B + pos % B
        self.host_kv[:, 0, :, host] = k.to(self.host_kv.device)
        self.host_kv[:, 1, :, host] = v.to(self.host_kv.device)
        if seq.working_set is None:  # dropped: it reloads from the host at its next step
            if (pos + 1) % B == 0:  # the block is complete there and needs its summary
                keys = self.host_kv[:, 0, :, host + 1 - B:host + 1]  # [L, Hkv, B, d]
                self._summarize(torch.tensor([seq.summary_ids[block]]), keys[:, :, None])
            return
        slot = self.slab.active_token(seq.block_table, pos)
        self.device_kv[:, 0, :, slot] = k
        self.device_kv[:, 1, :, slot] = v
        if (pos + 1) % B == 0:
            self._submit_fills([(self._decode(seq, None, pos), block)])
            self.flush()

    def _submit_fills(self, fills: list[tuple[StepDecode, int]]) -> None:
        """The completed blocks (decode, logical block) as one fill job per layer group for
        all requests, in layer order: the fill worker runs jobs in turn, each after its
        layers' earlier jobs, so a job per request and group would hold request B's first
        layers behind request A's later ones (and behind a slow fetch of those)."""
        if not fills:
            return
        # jobs keep what they need: the request may end (and free its tables) while they run
        step = self.step
        args = [(d, d.seq.working_set, block, self.host_block(d.seq, block),
                 d.seq.summary_ids[block]) for d, block in fills]
        seqs = [d.seq for d, _ in fills]

        def fill(run: slice) -> None:
            hook = self.stage_hooks.get("fill")
            if hook is not None:
                for layer in range(run.start, run.stop):
                    hook(layer, seqs)
            for a in args:
                self._fill(*a, run, step)

        for run in self.layer_groups():
            self.pipeline.submit(list(range(run.start, run.stop)), f"fill step {step}",
                                 [("fill", lambda run=run: fill(run))], seqs)

    def _fill(self, d: StepDecode, ws: WorkingSet, block: int, host: int, summary: int,
              run: slice, step: int) -> None:
        B = self.cfg.block_size
        active = int(d.slab_tokens[self.slab.active])
        kv = self.device_kv[run]  # [n, 2, Hkv, slots, d]
        chunk = kv[:, :, :, active:active + B]  # [n, 2, Hkv, B, d]
        self.host_kv[run, :, :, host * B:(host + 1) * B] = chunk
        self._count(d2h_bytes=chunk.numel() * chunk.element_size())
        self._summarize(torch.tensor([summary]), chunk[:, 0, :, None], layers=run)
        layers, slots, heads = insert_block(ws.head_map[run], ws.last_used[run], block, step)
        arange_b = torch.arange(B)
        dst = d.slab_tokens[slots][:, None] + arange_b  # [m, B] (m: (layer, head)s)
        layers, heads = layers[:, None], heads[:, None]
        kv[layers, :, heads, dst] = kv[layers, :, heads, active + arange_b]

    # ---- prefill ----------------------------------------------------------------------------

    def store_prompt(self, seq: Sequence) -> None:
        """Remote store, after the request's prefill: its complete prompt blocks go to the
        store and a bounded host cache takes over (the allocator frees the other blocks).
        Raises RemoteStoreError when the put fails."""
        before = self.remote.store.bytes_put
        seq.host_cache = self.remote.put_prompt(seq)
        self._count(remote_put_bytes=self.remote.store.bytes_put - before)

    def summarize_prefill(self, seq: Sequence, start: int, end: int) -> None:
        """Summaries of the blocks that the prefill chunk [start, end) completed."""
        B = self.cfg.block_size
        per_token = self.host_kv[:, :, :, 0].numel() * self.host_kv.element_size()
        self._count(host_write_bytes=(end - start) * per_token)
        blocks = range(start // B, end // B)
        if not blocks:
            return
        host_ids = [seq.host_table[b] for b in blocks]
        if is_contiguous(host_ids):  # one run of host slots: read in place (no 80 MB copy)
            keys = self.host_kv[:, 0, :, host_ids[0] * B:(host_ids[-1] + 1) * B]
        else:
            tokens = (torch.tensor(host_ids)[:, None] * B + torch.arange(B)).flatten()
            keys = self.host_kv[:, 0][:, :, tokens]  # [L, Hkv, n*B, d]
        ids = torch.tensor([seq.summary_ids[b] for b in blocks], dtype=torch.long)
        self._summarize(ids, keys.unflatten(2, (len(ids), B)))

    def _summarize(self, ids: torch.Tensor, keys: torch.Tensor,
                   layers: slice = slice(None)) -> None:
        # keys [layers, Hkv, n, B, d] -> summaries of ids [n]; every layer's in one reduction
        # (a prompt's: 1.35x faster than layer by layer)
        S = self.cfg.summary_splits
        kmin, kmax = round_outward(*summarize(keys, S), self.kmin.dtype)  # [layers, n*S, Hkv, d]
        rows = summary_rows(ids, S)
        self.kmin[layers, rows], self.kmax[layers, rows] = kmin, kmax
        if self.key_codes is not None:  # the key copy, with the summary
            # [layers, n, Hkv, d, B (int4: B/2)], [layers, n, Hkv]
            codes, scales = quantize_keys(keys, self.cfg.key_copy_bits)
            self.key_codes[layers, ids], self.key_scales[layers, ids] = codes, scales

    # ---- per layer: selection and the attention masks ------------------------------------

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
        # the active block's tokens up to this step's position
        resident = torch.stack([d.seq.working_set.head_map[layer] for d in self._decodes]) >= 0
        R, K, hkv = resident.shape  # [R, K, Hkv]
        filled = torch.tensor([d.pos % B for d in self._decodes])
        active = torch.arange(B) <= filled[:, None]  # [R, B]
        valid = torch.cat([resident.transpose(1, 2)[..., None].expand(R, hkv, K, B)
                           .reshape(R, hkv, K * B), active[:, None].expand(R, hkv, B)], dim=2)
        for d, mask in zip(self._decodes, valid, strict=True):
            d.attn.kv_valid = mask  # [Hkv, (K+1)*B]

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
        rows = [self.predictor.query_rows(d.attn) for d in decodes]
        weights = [d.seq.draft_weights for d in decodes]
        if len({len(r) for r in rows}) == 1:  # one gather for the batch (a copy: jobs keep it)
            queries = mixed_queries(q[torch.tensor(rows, device=q.device)], weights)  # [R, H, d]
        else:
            queries = torch.cat([mixed_queries(q[r][None], [w])
                                 for r, w in zip(rows, weights, strict=True)])
        for d in decodes:
            d.seq.working_set.primed[layer] = True
        self._deferred.append((layer, decodes, queries))
        if self.pipeline.executor.kind == "async" and any(
                layer == run.stop - 1 for run in self.layer_groups()):  # its run's last layer
            self._select_deferred()

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
