"""Device working sets of sparse requests: head maps, local fetch, block fills (paper §3.2).

A sparse request holds one slab of K+1 device blocks. Slot s < K of KV head g holds the
logical block head_map[s, g]; slot K is the active (filling) block, attended by every head.
The host tier holds the request's complete history as whole blocks; the summary (kmin/kmax)
of every complete block lives on the device and drives selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasiskv.config import CacheConfig
from oasiskv.context import SeqAttention
from oasiskv.engine.sequence import Sequence
from oasiskv.kv.select import block_scores, insert_block, select_capped_lru, top_k_blocks
from oasiskv.kv.summaries import summarize


@dataclass
class WorkingSet:
    head_map: torch.Tensor  # [L, K, Hkv] logical block per (slot, head); -1 = empty
    last_used: torch.Tensor  # [L, K, Hkv] step at which the slot's block was last selected
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

    def add(self, other: SparseCounters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Decode:
    seq: Sequence
    attn: SeqAttention | None  # None for a token committed after the step (accepted draft)
    pos: int  # position of the step's token
    host_ids: torch.Tensor  # [n_full] host block of each complete logical block
    slab_tokens: torch.Tensor  # [K+1] first device token slot of each slot


@dataclass
class SparseKV:
    """Selection, local fetch and fills for the sparse requests of each step."""

    cfg: CacheConfig
    device_kv: torch.Tensor  # [L, 2, Hkv, device_slots, d]
    host_kv: torch.Tensor  # [L, 2, Hkv, host_slots, d]
    kmin: torch.Tensor  # [L, host_blocks, Hkv, d] summaries, indexed by host block
    kmax: torch.Tensor
    step: int = 0
    counters: SparseCounters = field(default_factory=SparseCounters)
    last_step: SparseCounters = field(default_factory=SparseCounters)
    _decodes: list[_Decode] = field(default_factory=list)

    @property
    def block_bytes_per_head(self) -> int:  # K and V of one head's slice of one block
        return 2 * self.cfg.block_size * self.device_kv.shape[-1] * self.device_kv.element_size()

    # ---- step boundaries ------------------------------------------------------------------

    def begin_step(self, decodes: list[tuple[Sequence, SeqAttention]]) -> None:
        self.step += 1
        self.last_step = SparseCounters()
        self._decodes = []
        for seq, attn in decodes:
            d = self._decode(seq, attn, seq.num_computed_tokens)
            if seq.working_set is None:
                self._load(d)
            self._decodes.append(d)

    def _decode(self, seq: Sequence, attn: SeqAttention | None, pos: int) -> _Decode:
        K, B = self.cfg.top_k, self.cfg.block_size
        return _Decode(seq, attn, pos, torch.tensor(seq.host_table[:pos // B], dtype=torch.long),
                       torch.tensor(seq.block_table[:K + 1], dtype=torch.long) * B)

    def _load(self, d: _Decode) -> None:
        """First sparse decode step of a request: empty head map; the active block's tokens so
        far come from the host (its complete blocks are admitted by the first selection)."""
        L, _, hkv, _, _ = self.device_kv.shape
        K, B = self.cfg.top_k, self.cfg.block_size
        d.seq.working_set = WorkingSet(torch.full((L, K, hkv), -1, dtype=torch.long),
                                       torch.zeros((L, K, hkv), dtype=torch.long), [False] * L,
                                       [False] * L)
        # Empty slots are masked out, but 0 * NaN is NaN in probs @ V: clear the slab's bytes.
        for start in d.slab_tokens.tolist():
            self.device_kv[:, :, :, start:start + B] = 0
        filled = d.pos % B
        if filled:
            src = d.seq.host_table[d.pos // B] * B
            dst = int(d.slab_tokens[K])
            self.device_kv[:, :, :, dst:dst + filled] = self.host_kv[:, :, :, src:src + filled]
            self.last_step.h2d_bytes += (self.device_kv[:, :, :, :filled].numel()
                                         * self.device_kv.element_size())

    def end_step(self) -> None:
        """After a successful forward: blocks that the step's tokens filled go to the host,
        get their summary, and enter every head's working set."""
        B = self.cfg.block_size
        for d in self._decodes:
            if (d.pos + 1) % B == 0:
                self._fill(d, d.pos // B)
        self._decodes = []
        self.counters.add(self.last_step)

    def commit_token(self, seq: Sequence, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """An accepted draft's K/V ([L, Hkv, d] each) joins the active block at `pos`; when it
        completes the block, the block fills as after any decode step."""
        K, B = self.cfg.top_k, self.cfg.block_size
        slot = seq.block_table[K] * B + pos % B
        self.device_kv[:, 0, :, slot] = k
        self.device_kv[:, 1, :, slot] = v
        if (pos + 1) % B == 0:
            before = self.last_step.d2h_bytes
            self._fill(self._decode(seq, None, pos), pos // B)
            self.counters.d2h_bytes += self.last_step.d2h_bytes - before

    def _fill(self, d: _Decode, block: int) -> None:
        K, B = self.cfg.top_k, self.cfg.block_size
        active = int(d.slab_tokens[K])
        host = d.seq.host_table[block] * B
        chunk = self.device_kv[:, :, :, active:active + B]  # [L, 2, Hkv, B, d]
        self.host_kv[:, :, :, host:host + B] = chunk
        self.last_step.d2h_bytes += chunk.numel() * chunk.element_size()
        self._summarize(torch.tensor([d.seq.host_table[block]]), chunk[:, 0].unsqueeze(2))
        ws = d.seq.working_set
        arange_b = torch.arange(B)
        for layer in range(self.device_kv.shape[0]):
            slots, heads = insert_block(ws.head_map[layer], ws.last_used[layer], block,
                                        self.step)
            dst = d.slab_tokens[slots][:, None] + arange_b  # [Hkv, B]
            kv = self.device_kv[layer]
            kv[:, heads[:, None], dst] = kv[:, heads[:, None], active + arange_b]

    # ---- prefill ----------------------------------------------------------------------------

    def summarize_prefill(self, seq: Sequence, start: int, end: int) -> None:
        """Summaries of the blocks that the prefill chunk [start, end) completed."""
        B = self.cfg.block_size
        per_token = self.host_kv[:, :, :, 0].numel() * self.host_kv.element_size()
        self.last_step.host_write_bytes += (end - start) * per_token
        blocks = range(start // B, end // B)
        if not blocks:
            return
        host_ids = torch.tensor([seq.host_table[b] for b in blocks], dtype=torch.long)
        tokens = (host_ids[:, None] * B + torch.arange(B)).flatten()
        keys = self.host_kv[:, 0][:, :, tokens]  # [L, Hkv, n*B, d]
        self._summarize(host_ids, keys.unflatten(2, (len(host_ids), B)))

    def _summarize(self, host_ids: torch.Tensor, keys: torch.Tensor) -> None:
        # keys [L, Hkv, n, B, d]
        for layer in range(keys.shape[0]):
            kmin, kmax = summarize(keys[layer])
            self.kmin[layer, host_ids] = kmin.to(self.kmin.dtype)
            self.kmax[layer, host_ids] = kmax.to(self.kmax.dtype)

    # ---- per layer: selection and the attention masks ------------------------------------

    def prepare_layer(self, layer: int, q: torch.Tensor) -> None:
        """Before layer `layer`'s attention. With the exact predictor (and on a request's first
        decode step, when no earlier step chose its blocks) the step's own query q[row]
        ([N, H, d]) selects on the critical path. Then sets each request's attention masks."""
        B = self.cfg.block_size
        picks = []
        for d in self._decodes:
            ws = d.seq.working_set
            if self.cfg.predictor == "exact" or not ws.primed[layer]:
                picks.append((d, q[d.attn.q_start]))
        self._select(layer, picks)
        for d in self._decodes:
            resident = d.seq.working_set.head_map[layer] >= 0  # [K, Hkv]
            active = torch.arange(B) <= d.pos % B
            d.attn.kv_valid = torch.cat([resident.T.repeat_interleave(B, dim=1),
                                         active.expand(resident.shape[1], B)], dim=1)

    def after_attention(self, layer: int, q: torch.Tensor) -> None:
        """After layer `layer`'s attention has read the slab: predict the next step's blocks
        (lookahead: the drafts' averaged query; previous: this step's query) and fetch them
        now, so the next step only attends."""
        if self.cfg.predictor == "exact":
            return
        picks = []
        for d in self._decodes:
            rows = d.attn.draft_rows if self.cfg.predictor == "lookahead" else []
            picks.append((d, q[rows].mean(0) if rows else q[d.attn.q_start]))
            d.seq.working_set.primed[layer] = True
        self._select(layer, picks)

    def _select(self, layer: int, picks: list[tuple[_Decode, torch.Tensor]]) -> None:
        """Scores each request's complete blocks with its query ([H, d]), picks each head's
        top-K, applies the capped LRU, and fetches all admissions in one gather."""
        K, B = self.cfg.top_k, self.cfg.block_size
        heads, dst, src = [], [], []
        for d, query in picks:
            ws = d.seq.working_set
            n_full = len(d.host_ids)
            if n_full == 0:
                continue
            scores = block_scores(query, self.kmin[layer, d.host_ids],
                                  self.kmax[layer, d.host_ids], self.cfg.score_alpha)
            cap = self.cfg.fetch_cap if ws.seeded[layer] else None
            sel = select_capped_lru(ws.head_map[layer], ws.last_used[layer],
                                    top_k_blocks(scores, K), cap, self.step)
            ws.seeded[layer] = ws.seeded[layer] or n_full > K
            c = self.last_step
            c.predicted, c.hits = c.predicted + sel.predicted, c.hits + sel.hits
            c.wanted, c.admitted = c.wanted + sel.wanted, c.admitted + len(sel.slots)
            heads.append(sel.heads)
            dst.append(d.slab_tokens[sel.slots])
            src.append(d.host_ids[sel.blocks] * B)
        if heads:
            self._local_fetch(layer, torch.cat(heads), torch.cat(dst), torch.cat(src))

    def _local_fetch(self, layer: int, heads: torch.Tensor, dst: torch.Tensor,
                     src: torch.Tensor) -> None:
        """One vectorised gather of per-head block slices, host -> device slots."""
        if len(heads) == 0:
            return
        arange_b = torch.arange(self.cfg.block_size)
        h = heads[:, None]
        self.device_kv[layer][:, h, dst[:, None] + arange_b] = \
            self.host_kv[layer][:, h, src[:, None] + arange_b]
        self.last_step.h2d_bytes += len(heads) * self.block_bytes_per_head
