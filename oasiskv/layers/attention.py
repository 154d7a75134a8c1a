"""Attention over the paged KV pools.

Pool layout per layer: `[Hkv, num_blocks * B, d]` (token slot = block * B + offset). Keeping the
head axis outermost means a request whose blocks are contiguous is a strided *view* of the pool,
so decode reads its KV in place; only fragmented block tables pay for a gather. A sparse
request's working set is the same shape, one slab of K+1 blocks whose slots hold different
blocks per head, so dense and sparse requests share this code; only the mask differs. (A
sparse slab has one more block, its draft slots, where a step's drafts write their K/V.)
"""

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.context import SeqAttention, SlabGroup, get_context
from oasiskv.layers import decode_kernel, gqa, kernel_attention, triton_attention, triton_kernels


def slab_groups(seqs: list[SeqAttention], device: torch.device) -> list[SlabGroup]:
    """The step's sparse decodes whose drafts' K/V (if any) are in their draft slots, grouped
    by slab, draft slots and draft count."""
    groups: dict[tuple[int, int, int], list[SeqAttention]] = {}
    for seq in seqs:
        m = len(seq.draft_rows)
        if (seq.kv_valid is not None and seq.num_queries == 1 and seq.kv_start is not None
                and seq.draft_valid is None and m <= seq.draft_slots):
            groups.setdefault((seq.kv_len, seq.draft_slots, m), []).append(seq)
    out = []
    for (t, slots, m), group in groups.items():
        group.sort(key=lambda s: s.kv_start)
        first = group[0].kv_start
        in_place = all(s.kv_start == first + i * (t + slots) for i, s in enumerate(group))
        own = torch.arange(slots, device=device) == torch.arange(-1, m, device=device)[:, None]
        out.append(SlabGroup(torch.tensor([[s.q_start, *s.draft_rows] for s in group],
                                          device=device), group, in_place, ~own[:, None, :]))
    return out


class Attention(nn.Module):
    # decodes through the compiled kernel (`layers/decode_kernel.py`) where it loads, on CUDA
    # through the Triton kernel (`layers/triton_attention.py`), else through `layers/gqa.py`
    # (as GqaAttention always does)
    use_kernel = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.layer_idx = -1
        # Bound by the runner to this layer's slices of the pools: [Hkv, slots, d] each.
        self.pools: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [N, H, d], k/v [N, Hkv, d] -> [N, H*d]
        step = get_context()
        ctx = step.for_layer(self.layer_idx)  # dense_layers: the first layers' own view
        sparse_layer = self.layer_idx - step.dense_layers  # the sparse KV's count of layers
        if ctx.sparse is not None:  # this layer's prefetch and fills land before our writes
            ctx.sparse.wait_layer(sparse_layer)
        for w in ctx.writes:
            k_cache, v_cache = self.pools[w.pool]
            k_cache.index_copy_(1, w.slots, k[w.rows].transpose(0, 1))
            v_cache.index_copy_(1, w.slots, v[w.rows].transpose(0, 1))
        if ctx.sparse is not None:
            ctx.sparse.prepare_layer(sparse_layer, q)
        if step.draft_kv is not None:
            step.draft_kv[self.layer_idx] = (k, v)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype,
                          device=q.device)
        ext = self._kernel(q)
        tri = self._triton(q)
        if tri is not None:  # CUDA: the decodes in one Triton launch per pool, the rest below
            if ctx.decode_plan is None:  # the same in every layer of the step: planned once
                ctx.decode_plan = triton_attention.plan(ctx.seqs, q.device, self.num_kv_heads)
            batches, seqs = ctx.decode_plan
            triton_attention.attend(tri, self.pools, batches, q, k, v, out, self.scale)
            batched = set()
        elif ext is not None:  # the decodes in one kernel call per pool, the rest below
            if ctx.decode_plan is None:  # the same in every layer of the step: packed once
                ctx.decode_plan = kernel_attention.plan(ctx.seqs)
            batches, seqs = ctx.decode_plan
            kernel_attention.attend(ext, self.pools, batches, q, k, v, out, self.scale)
            batched = set()
        else:
            if ctx.slab_groups is None:  # the same in every layer of the step: grouped once
                ctx.slab_groups = slab_groups(ctx.seqs, q.device)
            for group in ctx.slab_groups:
                out[group.rows.flatten()] = self._attend_slabs(q[group.rows], group)
            seqs, batched = ctx.seqs, {id(s) for group in ctx.slab_groups for s in group.seqs}
        for seq in seqs:
            if id(seq) in batched:
                continue
            rows = slice(seq.q_start, seq.q_end)
            if seq.draft_rows:
                both = [seq.q_start, *seq.draft_rows]
                out[both] = self._attend_with_drafts(q[both], seq, k[both], v[both])
            else:
                out[rows] = self._attend(q[rows], seq, k[rows], v[rows])
        if ctx.sparse is not None:
            ctx.sparse.after_attention(sparse_layer, q)
        return out

    def _kernel(self, q: torch.Tensor) -> ModuleType | None:
        """The compiled decode kernel where it serves this layer's decodes, else None."""
        if (not self.use_kernel or q.device.type != "cpu"
                or q.dtype not in decode_kernel.DTYPES):
            return None
        return decode_kernel.extension()

    def _triton(self, q: torch.Tensor) -> ModuleType | None:
        """The Triton decode kernel where it serves this layer's decodes (CUDA, triton
        installed, OASISKV_CUDA_ATTENTION not torch), else None."""
        if not self.use_kernel or q.device.type != "cuda":
            return None
        return triton_kernels.load("decode")

    def _kv_parts(self, seq: SeqAttention, k_new: torch.Tensor,
                  v_new: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K/V attended, [Hkv, t, d] each: views of the pool, one per run of slots (one
        for a contiguous table); the new rows when they are the whole context; one gathered
        copy for a table of many runs."""
        if seq.kv_len == seq.num_queries:  # whole context is new: use it as computed
            return [k_new.transpose(0, 1)], [v_new.transpose(0, 1)]
        k_cache, v_cache = self.pools[seq.pool]
        if seq.kv_slots is not None:
            return [k_cache.index_select(1, seq.kv_slots)], [v_cache.index_select(1, seq.kv_slots)]
        runs = seq.kv_runs or [(seq.kv_start, seq.kv_len)]
        return [k_cache[:, s:s + t] for s, t in runs], [v_cache[:, s:s + t] for s, t in runs]

    def _kv(self, seq: SeqAttention, k_new: torch.Tensor,
            v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V attended as one tensor each, [Hkv, T, d] (runs joined by a copy: prefill)."""
        keys, values = self._kv_parts(seq, k_new, v_new)
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, 1), torch.cat(values, 1)

    def _attend_with_drafts(self, q: torch.Tensor, seq: SeqAttention, k_new: torch.Tensor,
                            v_new: torch.Tensor) -> torch.Tensor:
        """One call for the normal token and its m drafts over the same KV: q/k_new/v_new hold
        [normal, drafts...] rows -> [1+m, H*d]. Draft i also attends to its own K/V."""
        keys, values = self._kv_parts(seq, k_new[:1], v_new[:1])  # runs [Hkv, t, d]
        n = q.shape[0]
        o = gqa.decode_with_drafts(
            q.view(n, self.num_kv_heads, self.group, self.head_dim), keys, values, k_new[1:],
            v_new[1:], self.scale, seq.kv_valid, seq.draft_valid)  # [1+m, Hkv, G, d]
        return o.reshape(n, -1)

    def _attend_slabs(self, q: torch.Tensor, group: SlabGroup) -> torch.Tensor:
        """Sparse decodes with equal slabs (T slots, contiguous) and m drafts each, in one batch:
        q [R, 1+m, heads, d] holds the rows of `group` -> [R*(1+m), H*d]. A request's window is
        its slab and then its draft slots, where this step wrote its drafts' K/V: the normal
        token sees the slab's valid slots, draft i those and its own K/V. Windows side by side
        (the allocator puts them so) are read in place as one batch per KV head."""
        R, n = q.shape[:2]
        seqs = group.seqs
        k_cache, v_cache = self.pools[seqs[0].pool]
        valid = torch.stack([s.kv_valid for s in seqs], 1)  # [Hkv, R, T]
        o = gqa.attend_slabs(
            q.view(R, n, self.num_kv_heads, self.group, self.head_dim), k_cache, v_cache,
            [s.kv_start for s in seqs], seqs[0].kv_len, seqs[0].kv_len + seqs[0].draft_slots,
            valid, group.hidden, self.scale)  # [R, n, Hkv, G, d]
        return o.reshape(R * n, -1)

    def _attend(self, q: torch.Tensor, seq: SeqAttention, k_new: torch.Tensor,
                v_new: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        if n == 1:  # decode: the G query heads of a KV head share its keys, read in place
            keys, values = self._kv_parts(seq, k_new, v_new)
            qg = q.view(self.num_kv_heads, self.group, self.head_dim)  # [Hkv, G, d]
            return gqa.decode(qg, keys, values, self.scale, seq.kv_valid).reshape(1, -1)
        k, v = self._kv(seq, k_new, v_new)  # [Hkv, T, d]
        # Prefill chunk: queries are the last n positions of the context (causal, aligned to
        # the bottom-right, which SDPA's is_causal is not when n < T).
        t = seq.kv_len
        mask = None
        if n != t:
            q_pos = torch.arange(t - n, t, device=q.device)
            mask = q_pos[:, None] >= torch.arange(t, device=q.device)[None, :]  # [n, T]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=True)  # [1, H, n, d]
        return o[0].transpose(0, 1).reshape(n, -1)


class GqaAttention(Attention):
    """`Attention` whose decodes always take `layers/gqa.py` (the kernel's tests and bench
    compare with it)."""

    use_kernel = False
