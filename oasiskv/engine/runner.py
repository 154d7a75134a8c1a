"""Runs the model for one scheduled batch: owns the KV pools, builds the step context."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from oasiskv.config import ModelConfig
from oasiskv.context import KVWrite, SeqAttention, StepContext, set_context
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.kv.blocks import block_runs, is_contiguous
from oasiskv.kv.dense_layers import dense_context, token_bytes
from oasiskv.kv.residency import SparseKV
from oasiskv.kv.transfers import device_view, upload
from oasiskv.layers import decode_kernel
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.sequence import Sequence

# A fragmented table of up to this many runs of blocks is read run by run, in place (one
# product per run); more runs are gathered into one copy. A full dense pool splits requests
# into 2-3 runs (the allocator's placement), where the copies made dense steps of 6 x 7K
# tokens 1.16x as long.
MAX_KV_RUNS = 16


def allocate_kv(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                device: torch.device | str = "cpu", pin: bool = False) -> torch.Tensor:
    """A KV pool [layers, K/V, Hkv, num_blocks * B, d]. torch.empty: pages are touched only
    when used."""
    return torch.empty(cfg.num_layers, 2, cfg.num_kv_heads, num_blocks * block_size,
                       cfg.head_dim, dtype=dtype, device=device, pin_memory=pin)


def pins_host_kv(device: torch.device | str) -> bool:
    """Whether the host KV tier is pinned (page-locked): only for a CUDA engine, whose
    copies it makes asynchronous. A CPU engine gains nothing from it and would pay locked
    pages and a CUDA context on a machine that merely has a GPU."""
    return torch.device(device).type == "cuda"


def is_decode(seq: Sequence, n: int) -> bool:
    """A scheduled chunk of `n` tokens is a decode step: one token after the prompt. Every
    prompt token is prefill, also when a chunk holds only one (the last prompt token attends
    densely however the prompt was chunked, or handed over as prefix K/V)."""
    return n == 1 and not seq.in_prefill and seq.num_output_tokens > 0


class StepOutput(NamedTuple):
    logits: torch.Tensor  # [S, V] at the sample rows
    draft_logits: list[torch.Tensor | None]  # per batch entry: [m, V] of its draft rows
    features: list[torch.Tensor | None]  # per batch entry: [n + m, F] aux features, or None


def write_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor | slice:
    """A write's rows on the device, or a slice when they are the batch's first rows in order
    (a decode batch's, drafts included or not): the layers then write k[rows] as a view,
    without a gather each."""
    if torch.equal(rows, torch.arange(len(rows))):
        return slice(0, len(rows))
    return rows.to(device)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, device_kv: torch.Tensor, block_size: int,
                 host_kv: torch.Tensor | None = None, sparse: SparseKV | None = None,
                 dense_kv: torch.Tensor | None = None) -> None:
        """Sparse with dense_layers=N (`kv/dense_layers.py`): `dense_kv` [N, ...] holds the
        first N layers' K/V, `device_kv` (the slabs) and `sparse` the other layers'; `host_kv`
        every layer's."""
        self.model = model
        self.keep_draft_kv = False  # speculative acceptance: drafts' K/V may be committed
        self.aux_layers: tuple[int, ...] = ()  # layers whose outputs a drafter reads
        self._last: tuple[dict[int, int], StepContext] | None = None
        self.device_kv = device_kv
        self.host_kv = host_kv
        self.device = device_kv.device
        self.block_size = block_size
        self.sparse = sparse
        self.dense_kv = dense_kv
        self.dense_layers = 0 if dense_kv is None else dense_kv.shape[0]
        # Pools are [layers, K/V, Hkv, slots, d]; each attention layer gets its slices. Sparse
        # prefill writes and attends the host tier in place: on CUDA through its device view
        # (pinned memory read over unified addressing, `kv/transfers.py`); on the CPU itself.
        host_pool = None if host_kv is None else device_view(host_kv, self.device)
        for i, attn in enumerate(model.attention_layers()):
            attn.layer_idx = i
            if i < self.dense_layers:
                attn.pools = {"dense": (dense_kv[i, 0], dense_kv[i, 1])}
            else:
                j = i - self.dense_layers
                attn.pools = {"device": (device_kv[j, 0], device_kv[j, 1])}
            if host_pool is not None:
                attn.pools["host"] = (host_pool[i, 0], host_pool[i, 1])
        if self.device.type == "cpu":  # built (a fresh machine) or loaded now, not in a request
            decode_kernel.extension()

    def _token_slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def _view(self, table: list[int], row: int, n: int, kv_len: int,
              pool: str) -> SeqAttention:
        B = self.block_size
        runs = block_runs(table[:-(-kv_len // B)])  # [(first block, blocks)] holding kv_len
        if len(runs) == 1:  # one run of slots: a view of the pool
            return SeqAttention(row, row + n, kv_len, runs[0][0] * B, None, pool)
        if len(runs) <= MAX_KV_RUNS:  # a full pool's usual case: read in place, run by run
            kv_runs, left = [], kv_len
            for first, blocks in runs:
                kv_runs.append((first * B, min(blocks * B, left)))
                left -= blocks * B
            return SeqAttention(row, row + n, kv_len, None, None, pool, kv_runs=kv_runs)
        slots = self._token_slots(table, 0, kv_len).to(self.device)
        return SeqAttention(row, row + n, kv_len, None, slots, pool)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
        ids, positions = [], []
        writes: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        ctx = StepContext(sparse=self.sparse)
        decodes: list[tuple[Sequence, SeqAttention]] = []
        row = 0
        for seq, n in batch:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids += seq.token_ids[start:end]
            positions.append(torch.arange(start, end))
            rows = torch.arange(row, row + n)
            if self.sparse is None:  # dense: the device pool holds every block
                pool, slots = "device", self._token_slots(seq.block_table, start, end)
                attn = self._view(seq.block_table, row, n, end, pool)
            elif is_decode(seq, n):  # sparse decode: into the slab's active slot
                slab, pool = self.sparse.slab, "device"
                slots = torch.tensor([slab.active_token(seq.block_table, start)])
                attn = self._view(seq.block_table[:slab.blocks], row, n, slab.attended_tokens,
                                  pool)
                attn.draft_slots = slab.draft_tokens
                decodes.append((seq, attn))
            else:  # sparse prefill: K/V go to the host tier, attention reads it there
                pool, slots = "host", self._token_slots(seq.host_table, start, end)
                attn = self._view(seq.host_table, row, n, end, pool)
                if self.device.type == "cuda" and start:
                    # a later chunk on CUDA: the prefix is gathered from pinned memory into
                    # device memory once a layer, and attended there (a view of the host
                    # pool would be read over PCIe again by every tile of the attention)
                    attn = SeqAttention(row, row + n, end, None, upload(
                        self._token_slots(seq.host_table, 0, end), self.device), pool)
            writes.setdefault(pool, ([], []))
            writes[pool][0].append(rows)
            writes[pool][1].append(slots)
            ctx.seqs.append(attn)
            row += n
        # Draft tokens ride along after the normal rows: position p+1, never cached. A sparse
        # request's drafts write their K/V to its slab's draft block (overwritten every step):
        # attention reads them there with the slab.
        for (seq, n), attn in zip(batch, ctx.seqs, strict=True):
            if seq.draft_tokens and is_decode(seq, n):
                m = len(seq.draft_tokens)
                attn.draft_rows = list(range(row, row + m))
                ids += seq.draft_tokens
                positions.append(torch.full((m,), seq.num_computed_tokens + 1))
                if attn.draft_slots:
                    start = self.sparse.slab.draft_start(seq.block_table)
                    writes["device"][0].append(torch.arange(row, row + m))
                    writes["device"][1].append(start + torch.arange(m))
                row += m
        ctx.writes = [KVWrite(pool, write_rows(torch.cat(r), self.device),
                              torch.cat(s).to(self.device)) for pool, (r, s) in writes.items()]
        if self.dense_layers:
            ctx.dense = dense_context(batch, ctx.seqs, self._view, self._token_slots,
                                      self.device)
            ctx.dense_layers = self.dense_layers
        if self.sparse is not None:
            self.sparse.begin_step(decodes)
        return (torch.tensor(ids, device=self.device), torch.cat(positions).to(self.device), ctx)

    def _kv_home(self, seq: Sequence) -> tuple[torch.Tensor, list[int]]:
        """The pool holding a request's history and its block table there."""
        if self.sparse is None:
            return self.device_kv, seq.block_table
        return self.host_kv, seq.host_table

    def write_prefix(self, seq: Sequence) -> None:
        """Puts a request's given prefix K/V where its prefill would have written it."""
        kv = seq.prefix_kv
        pool, table = self._kv_home(seq)
        n = kv.shape[3]
        used = table[:-(-n // self.block_size)]
        copies = [(pool, kv)]
        if self.dense_layers:  # the dense layers' device copy too, at the same slots
            copies.append((self.dense_kv, kv[:self.dense_layers]))
        for dst, src in copies:
            if is_contiguous(used):  # one run of slots: a plain copy, several times faster
                start = used[0] * self.block_size
                dst[:, :, :, start:start + n] = src
            else:
                dst.index_copy_(3, self._token_slots(table, 0, n).to(dst.device),
                                src.to(dst.device))
        if self.sparse is not None:
            self.sparse.summarize_prefill(seq, 0, n)
            if self.dense_layers:
                self.sparse._count(host_write_bytes=n * token_bytes(self.dense_kv))
        seq.prefix_kv = None  # only once it is all there: a failed step's retry writes it again

    def read_kv(self, seq: Sequence, n: int) -> torch.Tensor:
        """K/V of a request's first n tokens, [L, 2, Hkv, n, d] (a copy)."""
        pool, table = self._kv_home(seq)
        return pool.index_select(3, self._token_slots(table, 0, n).to(pool.device))

    @torch.inference_mode()
    def commit_draft(self, seq: Sequence) -> None:
        """The last step's first draft of `seq` was accepted: its K/V, computed as a draft row,
        goes to the cache at position seq.num_computed_tokens."""
        index, ctx = self._last
        row = ctx.seqs[index[id(seq)]].draft_rows[0]
        layers = range(len(ctx.draft_kv))
        k = torch.stack([ctx.draft_kv[layer][0][row] for layer in layers])  # [L, Hkv, d]
        v = torch.stack([ctx.draft_kv[layer][1][row] for layer in layers])
        pos = seq.num_computed_tokens
        if self.sparse is not None:
            n = self.dense_layers
            self.sparse.commit_token(seq, pos, k[n:], v[n:])
            if n:  # the dense layers' copy and their host tier, at its host slot
                slot = self.sparse.host_block(seq, pos // self.block_size) * self.block_size \
                    + pos % self.block_size
                for pool in (self.dense_kv, self.host_kv[:n]):
                    pool[:, 0, :, slot] = k[:n].to(pool.device)
                    pool[:, 1, :, slot] = v[:n].to(pool.device)
            return
        slot = int(self._token_slots(seq.block_table, pos, pos + 1))
        self.device_kv[:, 0, :, slot] = k
        self.device_kv[:, 1, :, slot] = v

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, sample_rows: list[int],
            edit_context: Callable[[StepContext], None] | None = None) -> StepOutput:
        """Computes K/V for the batch's new tokens; returns logits [S, V] at `sample_rows`
        (last row of each sequence that samples this step), per batch entry the logits of its
        draft rows [m, V] (None without drafts) and, when `aux_layers` is set, the features of
        its rows, normal then draft. `edit_context` may change the step's context before the model
        runs (`LLMEngine.forward`)."""
        for seq, _ in batch:
            if seq.prefix_kv is not None:
                self.write_prefix(seq)
        input_ids, positions, ctx = self.prepare(batch)
        if edit_context is not None:
            edit_context(ctx)
        if self.keep_draft_kv and any(attn.draft_rows for attn in ctx.seqs):
            ctx.draft_kv = {}
            self._last = ({id(seq): i for i, (seq, _) in enumerate(batch)}, ctx)
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions, self.aux_layers)
        finally:
            set_context(None)
        if self.sparse is not None:
            for seq, n in batch:
                if not is_decode(seq, n):  # written to the host tier by prefill
                    self.sparse.summarize_prefill(seq, seq.num_computed_tokens,
                                                  seq.num_computed_tokens + n)
            if self.dense_layers:  # the dense layers' new K/V went to the host tier too
                decode = sum(n for seq, n in batch if is_decode(seq, n))
                per_token = token_bytes(self.dense_kv)
                self.sparse._count(d2h_bytes=decode * per_token, host_write_bytes=(
                    sum(n for _, n in batch) - decode) * per_token)
            self.sparse.end_step()
        features: list[torch.Tensor | None] = [None] * len(batch)
        if self.aux_layers:
            hidden, aux = hidden
            features = [aux[list(range(a.q_start, a.q_end)) + a.draft_rows] for a in ctx.seqs]
        draft_rows = [row for attn in ctx.seqs for row in attn.draft_rows]
        logits = self.model.compute_logits(hidden[sample_rows + draft_rows]).float()
        drafts, at = [], len(sample_rows)
        for attn in ctx.seqs:
            drafts.append(logits[at:at + len(attn.draft_rows)] if attn.draft_rows else None)
            at += len(attn.draft_rows)
        return StepOutput(logits[:len(sample_rows)], drafts, features)
