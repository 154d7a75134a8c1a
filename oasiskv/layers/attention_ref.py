"""The attention math as it was before the grouped, copy-free decode (`layers/gqa.py`), kept
as the reference that tests and `scripts/bench_attention.py` compare with: the same layer,
whose decode products run as batched matmuls over the pool's views (in bf16 the CPU copies
such a view, and transposes it for q @ k^T, before multiplying) and whose fragmented tables
and stacked slabs are joined by copies. Not used by the engine."""

import torch
import torch.nn.functional as F

from oasiskv.context import SeqAttention, SlabGroup
from oasiskv.layers.attention import Attention


class ReferenceAttention(Attention):
    """`Attention` with the previous decode paths (the same forward, writes and grouping)."""

    use_kernel = False

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
        """The K/V attended as one tensor each, [Hkv, T, d] (runs joined by a copy)."""
        keys, values = self._kv_parts(seq, k_new, v_new)
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, 1), torch.cat(values, 1)

    def _attend_with_drafts(self, q: torch.Tensor, seq: SeqAttention, k_new: torch.Tensor,
                            v_new: torch.Tensor) -> torch.Tensor:
        """One call for the normal token and its m drafts over the same KV: q/k_new/v_new hold
        [normal, drafts...] rows -> [1+m, H*d]. Draft i also attends to its own K/V."""
        k, v = self._kv(seq, k_new[:1], v_new[:1])  # [Hkv, T, d]
        k_draft, v_draft = k_new[1:], v_new[1:]
        m, g, hkv = len(seq.draft_rows), self.group, self.num_kv_heads
        qg = q.view(1 + m, hkv, g, self.head_dim).transpose(0, 1)  # [Hkv, 1+m, G, d]
        scores = torch.matmul(qg.reshape(hkv, (1 + m) * g, -1), k.transpose(1, 2))
        scores = scores.view(hkv, 1 + m, g, -1) * self.scale  # [Hkv, 1+m, G, T]
        if seq.kv_valid is not None:
            scores[:, 0].masked_fill_(~seq.kv_valid[:, None, :], float("-inf"))
        draft_valid = seq.draft_valid if seq.draft_valid is not None else seq.kv_valid
        if draft_valid is not None:
            scores[:, 1:].masked_fill_(~draft_valid[:, None, None, :], float("-inf"))
        kd, vd = k_draft.transpose(0, 1), v_draft.transpose(0, 1)  # [Hkv, m, d]
        own = torch.full((hkv, 1 + m, g, m), float("-inf"), dtype=scores.dtype,
                         device=scores.device)
        diag = torch.einsum("hmgd,hmd->hmg", qg[:, 1:], kd) * self.scale  # [Hkv, m, G]
        idx = torch.arange(m, device=q.device)
        own[:, 1 + idx, :, idx] = diag.permute(1, 0, 2)  # draft i sees only itself
        probs = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)  # fp32 inside
        t = k.shape[1]
        o = (torch.matmul(probs[..., :t].reshape(hkv, (1 + m) * g, t), v)
             + torch.matmul(probs[..., t:].reshape(hkv, (1 + m) * g, m), vd))  # [Hkv, (1+m)G, d]
        return o.view(hkv, 1 + m, g, -1).transpose(0, 1).reshape(1 + m, -1)

    def _attend_slabs(self, q: torch.Tensor, group: SlabGroup) -> torch.Tensor:
        """Sparse decodes with equal slabs (T slots, contiguous) and m drafts each, in one batch:
        q [R, 1+m, heads, d] holds the rows of `group` -> [R*(1+m), H*d]. A request's window is
        its slab and then its draft slots, where this step wrote its drafts' K/V: the normal
        token sees the slab's valid slots, draft i those and its own K/V. When the windows sit
        side by side (the allocator puts them so), the batched matmuls read them in place,
        with no copy of the working sets."""
        R, n = q.shape[:2]
        seqs = group.seqs
        g, hkv, t, d = self.group, self.num_kv_heads, seqs[0].kv_len, self.head_dim
        window = t + seqs[0].draft_slots
        k_cache, v_cache = self.pools[seqs[0].pool]
        first = seqs[0].kv_start
        if group.in_place:  # views [Hkv, R, window, d]
            keys = k_cache[:, first:first + R * window].view(hkv, R, window, d)
            values = v_cache[:, first:first + R * window].view(hkv, R, window, d)
        else:  # stacking the windows' views copies whole runs (3x faster than an index gather)
            keys = torch.stack([k_cache[:, s.kv_start:s.kv_start + window] for s in seqs], 1)
            values = torch.stack([v_cache[:, s.kv_start:s.kv_start + window] for s in seqs], 1)
        qh = q.view(R, n, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(hkv, R, n * g, d)
        scores = q.new_empty(hkv, R, n * g, window)
        for h in range(hkv):  # per KV head: [R, window, d] is one strided batch, read in place
            torch.bmm(qh[h], keys[h].transpose(1, 2), out=scores[h])
        scores = scores.view(hkv, R, n, g, window).mul_(self.scale)
        valid = torch.stack([s.kv_valid for s in seqs], 1)  # [Hkv, R, T]
        scores[..., :t].masked_fill_(~valid[:, :, None, None, :], float("-inf"))
        scores[..., t:].masked_fill_(group.hidden, float("-inf"))
        # in bf16/fp16 too the softmax over the last dim computes in fp32 and rounds once:
        # the same probabilities as an fp32 softmax cast back, in half the time
        probs = torch.softmax(scores, dim=-1).view(hkv, R, n * g, window)
        out = q.new_empty(hkv, R, n * g, d)
        for h in range(hkv):
            torch.bmm(probs[h], values[h], out=out[h])
        return out.view(hkv, R, n, g, d).permute(1, 2, 0, 3, 4).reshape(R * n, -1)

    def _attend(self, q: torch.Tensor, seq: SeqAttention, k_new: torch.Tensor,
                v_new: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        if n == 1:
            # Decode: the G query heads of a KV head share its keys -> one batched matmul per
            # KV head (and run of slots), no repeat of K/V.
            keys, values = self._kv_parts(seq, k_new, v_new)
            qg = q.view(self.num_kv_heads, self.group, self.head_dim)  # [Hkv, G, d]
            if q.dtype == torch.float32:  # [G, d] x [d, t]: in fp32 1.3x faster on CPU
                parts = [torch.matmul(qg, k.transpose(1, 2)) for k in keys]  # [Hkv, G, t]
                scores = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
            else:  # in bf16 the keys as the long side, [t, d] x [d, G], are 3x faster
                parts = [torch.matmul(k, qg.transpose(1, 2)) for k in keys]  # [Hkv, t, G]
                scores = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
                scores = scores.transpose(1, 2).contiguous()
            # [Hkv, G, T]: a softmax over the last, contiguous dim is 2.5x faster here than
            # over dim 1 of [Hkv, T, G] (at 7K tokens in bf16, 65 against 180 us)
            scores = scores.float()
            if seq.kv_valid is not None:
                scores.masked_fill_(~seq.kv_valid[:, None, :], float("-inf"))
            probs = torch.softmax(scores.mul_(self.scale), dim=-1).to(q.dtype)
            out, start = None, 0
            for v in values:  # [Hkv, G, t] x [Hkv, t, d], summed over the runs
                part = torch.matmul(probs[..., start:start + v.shape[1]], v)
                out, start = (part if out is None else out.add_(part)), start + v.shape[1]
            return out.reshape(1, -1)  # [1, H*d]
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
