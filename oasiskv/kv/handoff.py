"""What a prefill worker hands a decode worker (paper §3.3.1, "partial transfer").

The prefill worker computes the prompt, puts its complete blocks to the remote store, runs one
decode step more (its first query predicts the working set of the next step), and hands over:
the request's tokens, the summaries (kmin/kmax) of every complete block (and the device's key
copy of them, where the rerank reads one: it is indexed like the summaries), the K/V of the
blocks after the prompt's last complete one (the active block), each layer's working set and
its K/V, in one of three ways:

- `partial` (the paper's): per layer the union of the working set's prompt blocks, whole, into
  the decode host's cache, from which the slab is filled;
- `slab`: the slab itself, per layer K slot blocks, head h's part of slot s being the block
  head_map[l, s, h]: K x Hkv head slices instead of whole blocks for every head, and no
  prompt block on the decode host at first (a block that leaves a working set and is wanted
  again comes from the store: less at admission, more during decode);
- `full`: every prompt block into the decode host's cache (for comparison).

The decode worker reads them from the store (one-sided reads of the prefill host's memory
with Mooncake); any other prompt block comes from the store when a later step wants it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.kv.residency import SparseKV
from oasiskv.kv.select import stamp
from oasiskv.kv.summaries import (
    dequantize_bounds,
    quantize_bounds,
    round_outward,
    summary_rows,
)
from oasiskv.kv.working_set import WorkingSet
from oasiskv.sequence import RequestMetrics, Sequence

TRANSFERS = ("partial", "slab", "full")


@dataclass
class Handoff:
    request_id: str
    namespace: str  # the request's prompt blocks in the remote store
    prompt: str | None
    token_ids: list[int]  # prompt + generated; the last one has no K/V yet
    num_prompt_tokens: int
    num_computed_tokens: int
    transfer: str  # one of TRANSFERS
    kept: list[torch.Tensor]  # per layer [m_l]: logical prompt blocks sent whole
    slab_namespace: str | None  # slab: where the K slot blocks of each layer wait
    kmin: torch.Tensor  # [L, n_full * S, Hkv, d] summaries of every complete logical block
    kmax: torch.Tensor  # (S = summary_splits rows per block, `summaries.summary_rows`); no
    # rows where the prefill worker's selection reads none (rerank=inf, oracle); int8 codes
    # where summary_scales is set (handoff_summaries=int8, `summaries.quantize_bounds`)
    tail: torch.Tensor  # [L, 2, Hkv, T, d] K/V of tokens P*B .. num_computed (not in store)
    head_map: torch.Tensor  # [L, K, Hkv] working set: logical block per (slot, head)
    ages: torch.Tensor  # [L, K, Hkv] select.stamp of each slot minus the step's stamp (<= 0)
    seeded: list[bool]  # per layer: the fetch cap applies
    primed: list[bool]  # per layer: the next step's blocks are chosen
    draft_tokens: list[int]
    draft_weights: list[float] | None
    generator_state: torch.Tensor | None  # seeded sampling continues where it stopped
    metrics: RequestMetrics  # arrival, first token (one process: perf_counter is shared)
    block_size: int
    summary_splits: int = 1  # the decode worker's must match (engine.add_handoff checks)
    # the key copy of every complete block (rerank_source int8/int4), as the summaries:
    # codes [L, n_full, Hkv, d, B (int4: B/2)], scales [L, n_full, Hkv]; None without one
    key_codes: torch.Tensor | None = None
    key_scales: torch.Tensor | None = None
    summary_scales: torch.Tensor | None = None  # [L, n_full * S, Hkv] float32 with int8 kmin/kmax

    @property
    def num_prompt_blocks(self) -> int:
        """P: complete prompt blocks, the ones in the store."""
        return self.num_prompt_tokens // self.block_size

    @property
    def block_bytes(self) -> int:
        """One logical block of one layer, [2, Hkv, B, d]."""
        _, _, hkv, _, d = self.tail.shape
        return 2 * hkv * self.block_size * d * self.tail.element_size()

    @property
    def kept_blocks(self) -> int:
        """Blocks (one layer's each, or K slot blocks per layer) the decode worker reads from
        the store at admission."""
        slab = self.head_map.shape[0] * self.head_map.shape[1] if self.slab_namespace else 0
        return sum(len(k) for k in self.kept) + slab

    @property
    def metadata_bytes(self) -> int:
        """Summaries, the K/V after the last prompt block, working sets: sent with the
        request itself."""
        return sum(t.numel() * t.element_size()
                   for t in (self.kmin, self.kmax, self.tail, self.head_map, self.ages,
                             self.key_codes, self.key_scales, self.summary_scales)
                   if t is not None)

    @property
    def admission_bytes(self) -> int:
        """Bytes that move from the prefill host to the decode host before the first decode
        step there: the kept blocks plus what travels with the request."""
        return self.kept_blocks * self.block_bytes + self.metadata_bytes


def take_handoff(kv: SparseKV, seq: Sequence, transfer: str) -> Handoff:
    """Prefill side, after the request's extra decode step (its jobs done): what the decode
    worker needs. The request's prompt blocks are in the store already; with slab transfer its
    slab goes there too. Raises RemoteStoreError when that put fails."""
    B = kv.cfg.block_size
    P, n_full = seq.num_prompt_tokens // B, seq.num_computed_tokens // B
    ws = seq.working_set
    ids = torch.tensor(seq.summary_ids[:n_full], dtype=torch.long)
    rows = summary_rows(ids, kv.cfg.summary_splits)
    sent = rows if kv.cfg.bounds else rows[:0]  # no summaries where no selection reads them
    # K/V after the last complete prompt block: on the host (fills and write-through)
    blocks = torch.tensor([kv.host_block(seq, b) for b in range(P, n_full + 1)],
                          dtype=torch.long)
    tokens = (blocks[:, None] * B + torch.arange(B)).flatten()[:seq.num_computed_tokens - P * B]
    tail = kv.host_kv[:, :, :, tokens]  # [L, 2, Hkv, T, d]
    namespace = seq.host_cache.namespace
    if transfer == "partial":  # each layer's working-set blocks from the prompt
        kept = [m[(m >= 0) & (m < P)].unique() for m in ws.head_map]
    elif transfer == "slab":
        kept = [torch.zeros(0, dtype=torch.long)] * len(ws.head_map)
    else:
        kept = [torch.arange(P)] * len(ws.head_map)
    handoff = Handoff(
        request_id=seq.request_id, namespace=namespace, prompt=seq.prompt,
        token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
        num_computed_tokens=seq.num_computed_tokens, transfer=transfer, kept=kept,
        slab_namespace=None,
        kmin=kv.kmin[:, sent].cpu(), kmax=kv.kmax[:, sent].cpu(), tail=tail.cpu(),
        head_map=ws.head_map.clone(), ages=ws.last_used - stamp(kv.step),
        seeded=list(ws.seeded), primed=list(ws.primed), draft_tokens=list(seq.draft_tokens),
        draft_weights=seq.draft_weights,
        generator_state=None if seq.generator is None else seq.generator.get_state(),
        metrics=seq.metrics, block_size=B, summary_splits=kv.cfg.summary_splits)
    if kv.cfg.handoff_summaries == "int8":
        handoff.kmin, handoff.kmax, handoff.summary_scales = quantize_bounds(handoff.kmin,
                                                                             handoff.kmax)
    if kv.key_codes is not None:
        handoff.key_codes = kv.key_codes[:, ids].cpu()
        handoff.key_scales = kv.key_scales[:, ids].cpu()
    if transfer == "slab":  # last: nothing that could fail after it leaves the slab stored
        handoff.slab_namespace = kv.remote.put_slab(namespace, kv.slab_kv(seq))
    return handoff


def receive_handoff(kv: SparseKV, seq: Sequence, handoff: Handoff) -> int:
    """Decode side, the request admitted (slab, summary ids and host-cache blocks allocated):
    reads the kept blocks or the slab from the store, installs summaries, the
    active block and the working set, and fills its slab, so that its next step continues
    where the prefill worker's would have. Returns the bytes read from the store; raises
    RemoteStoreError when the read fails."""
    B, h = kv.cfg.block_size, handoff
    P, n_full = h.num_prompt_blocks, h.num_computed_tokens // B
    ids = torch.tensor(seq.summary_ids[:n_full], dtype=torch.long)
    rows = summary_rows(ids, h.summary_splits)  # the same splits (engine.add_handoff)
    if kv.cfg.bounds:  # the same kind of selection (engine.add_handoff)
        kmin, kmax = h.kmin, h.kmax
        if h.summary_scales is not None:  # int8 codes: float32 bounds, outward
            kmin, kmax = dequantize_bounds(kmin, kmax, h.summary_scales)
        kmin, kmax = round_outward(kmin, kmax, kv.kmin.dtype)  # exact when dtypes match
        kv.kmin[:, rows], kv.kmax[:, rows] = kmin.to(kv.kmin.device), kmax.to(kv.kmax.device)
    if kv.key_codes is not None:  # the same kind of copy (engine.add_handoff)
        kv.key_codes[:, ids] = h.key_codes.to(kv.key_codes.device)
        kv.key_scales[:, ids] = h.key_scales.to(kv.key_scales.device)
    keep = h.kept
    if h.transfer == "full":  # all of the prompt arrives: keep the working sets' blocks, then
        capacity = kv.remote.capacity(P)  # the most recent ones
        keep = []
        for m in h.head_map:
            wanted = m[(m >= 0) & (m < P)].unique()
            rest = torch.arange(P - 1, -1, -1)
            rest = rest[~torch.isin(rest, wanted)][:capacity - len(wanted)]
            keep.append(torch.cat([rest.flip(0), wanted]))  # the working set most recent
    seq.host_cache, read = kv.remote.receive(seq, h.namespace, h.kept, keep)
    slab = None
    if h.slab_namespace is not None:
        slab = kv.remote.take_slab(h.slab_namespace, *h.head_map.shape[:2])
        read += slab.numel() * slab.element_size()
    generated = seq.host_cache.where[0, P:P + -(-h.tail.shape[3] // B)]
    tokens = (generated[:, None] * B + torch.arange(B)).flatten()[:h.tail.shape[3]]
    kv.host_kv[:, :, :, tokens] = h.tail.to(kv.host_kv)
    dev = kv.device_kv.device  # selection runs where the slabs are
    seq.working_set = WorkingSet(h.head_map.clone().to(dev), (h.ages + stamp(kv.step)).to(dev),
                                 list(h.seeded), list(h.primed))
    kv.load_slab(seq, h.num_computed_tokens, slab)
    return read
