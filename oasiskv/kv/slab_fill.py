"""Slab loading and fills, a part of SparseKV (`kv/residency.py`): a request's slab filled at
its first sparse step or after a hand-over (its working-set blocks, then the active block's
tokens so far), the step's tokens written through to the host, accepted drafts committed, and
the blocks that steps complete filled into the host tier, their summaries and every head's
working set (one job per layer group, run by the prefetch pipeline)."""

from __future__ import annotations

import torch

from oasiskv.config import CacheConfig
from oasiskv.kv.select import insert_block
from oasiskv.kv.slab import Slab
from oasiskv.kv.transfers import download, upload
from oasiskv.kv.working_set import StepDecode, WorkingSet
from oasiskv.layers.block_gather import gather_block_heads
from oasiskv.sequence import Sequence


class SlabFills:
    """SparseKV's slab loading and fills (a mixin: SparseKV holds the state)."""

    cfg: CacheConfig
    slab: Slab
    device_kv: torch.Tensor  # [L, 2, Hkv, device_slots, d]
    host_kv: torch.Tensor  # [L, 2, Hkv, host_slots, d]
    host_view: torch.Tensor  # host_kv where the device's kernels read it (`kv/transfers.py`)

    def _load(self, d: StepDecode) -> None:
        """First sparse decode step of a request: empty head map; the active block's tokens so
        far come from the host (its complete blocks are admitted by the first selection)."""
        L, _, hkv, _, _ = self.device_kv.shape
        K = self.slab.working
        dev = self.device_kv.device  # selection runs where the slabs are
        d.seq.working_set = WorkingSet(torch.full((L, K, hkv), -1, dtype=torch.long, device=dev),
                                       torch.zeros((L, K, hkv), dtype=torch.long, device=dev),
                                       [False] * L, [False] * L)
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
            self.device_kv[:, :, :, dst:dst + filled] = self.host_view[:, :, :, src:src + filled]
            moved += self.device_kv[:, :, :, :filled].numel()
        self._count(h2d_bytes=moved * self.device_kv.element_size())

    def _gather_working_set(self, seq: Sequence, slab: torch.Tensor) -> int:
        """Each layer's working-set blocks from the host into their (slot, head); returns the
        elements moved."""
        # (foreground, once per request: the host may read the head maps here)
        B, cache, dev = self.cfg.block_size, seq.host_cache, self.device_kv.device
        head_map = seq.working_set.head_map  # [L, K, Hkv]
        layers, slots, heads = (head_map >= 0).nonzero(as_tuple=True)
        blocks = head_map[layers, slots, heads]
        host = torch.tensor(seq.host_table, dtype=torch.long, device=blocks.device)[blocks] \
            if cache is None else cache.where[layers.to(cache.where.device),
                                              blocks.to(cache.where.device)]
        # one gather for every layer (a Triton launch on CUDA, layers/block_gather.py)
        gather_block_heads(self.device_kv, self.host_view, layers, heads, host.to(dev) * B,
                           upload(slab, dev)[slots.to(dev)], B)
        return len(layers) * B * 2 * self.device_kv.shape[-1]

    @staticmethod
    def host_block(seq: Sequence, block: int) -> int:
        """Host block of a logical block that is never evicted (a generated one, or any block
        without a remote store): the same in every layer."""
        cache = seq.host_cache
        return seq.host_table[block] if cache is None else int(cache.where[0, block])


    def _write_through(self, decodes: list[StepDecode]) -> None:
        """The K/V of each decode's token (not completing a block: the fill moves that block
        whole) goes from the active slot to the host too, so that a request whose working set
        is dropped (a failed step or stage) reloads its active block from there intact."""
        if not decodes:
            return
        B, active, dev = self.cfg.block_size, self.slab.active, self.device_kv.device
        src = torch.tensor([int(d.slab_tokens[active]) + d.pos % B for d in decodes])
        dst = torch.tensor([self.host_block(d.seq, d.pos // B) * B + d.pos % B for d in decodes])
        tokens = self.device_kv[:, :, :, upload(src, dev)]  # [L, 2, Hkv, n, d]
        # on CUDA a device write into pinned memory: the host does not wait for it
        self.host_view[:, :, :, upload(dst, dev)] = tokens
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
                keys = self.host_view[:, 0, :, host + 1 - B:host + 1]  # [L, Hkv, B, d]
                self._summarize(upload(torch.tensor([seq.summary_ids[block]]),
                                       self.kmin.device), keys[:, :, None])
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
        # jobs keep what they need: the request may end (and free its tables) while they run;
        # what they index with goes to the device here, so that no job reads back or builds
        # a tensor from Python data
        step, B, dev = self.step, self.cfg.block_size, self.device_kv.device
        args = [(d.seq.working_set, block, self.host_block(d.seq, block),
                 upload(torch.tensor([d.seq.summary_ids[block]]), dev),
                 d.seq.block_table[self.slab.active] * B, upload(d.slab_tokens, dev))
                for d, block in fills]
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

    def _fill(self, ws: WorkingSet, block: int, host: int, summary: torch.Tensor, active: int,
              slab_tokens: torch.Tensor, run: slice, step: int) -> None:
        """One completed block in layers `run`: to the host tier (non-blocking into pinned
        memory on CUDA), its summary, and into every head's working set (a fixed-size copy
        of the active block into each head's chosen slot; heads that already hold it copy
        their slot's own rows back)."""
        B = self.cfg.block_size
        kv = self.device_kv[run]  # [n, 2, Hkv, slots, d]
        chunk = kv[:, :, :, active:active + B]  # [n, 2, Hkv, B, d]
        download(self.host_kv[run, :, :, host * B:(host + 1) * B], chunk)
        self._count(d2h_bytes=chunk.numel() * chunk.element_size())
        self._summarize(summary, chunk[:, 0, :, None], layers=run)
        slots, new = insert_block(ws.head_map[run], ws.last_used[run], block, step)  # [n, Hkv]
        n, _, hkv = kv.shape[:3]
        dev = kv.device
        dst = slab_tokens[slots][..., None] + torch.arange(B, device=dev)  # [n, Hkv, B]
        layers = torch.arange(n, device=dev)[:, None, None]
        heads = torch.arange(hkv, device=dev)[None, :, None]
        old = kv[layers, :, heads, dst]  # [n, Hkv, B, 2, d]
        kv[layers, :, heads, dst] = torch.where(new[..., None, None, None], chunk.permute(
            0, 2, 3, 1, 4), old)
