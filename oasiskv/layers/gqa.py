"""Grouped-query decode attention that reads K/V where they lie in the pool.

The G query heads of a KV head share its keys, so a decode's queries are grouped as
`[Hkv, G, d]` (or `[Hkv, rows*G, d]` for rows sharing the KV) against `[Hkv, T, d]`: K/V are
never expanded to the query heads, and runs of slots are never joined. The scores are one 2-D
product per KV head and run, not one batched product over the heads: a run is a view of the
pool whose head stride is the pool's, and CPU `bmm` in bf16 copies such an operand first (and
for q @ k^T transposes it: 5x the product's own time at 7K tokens), while one head's run,
`[t, d]` row-major, is an operand oneDNN reads in place. The values' product is per head too
on one thread; with more, oneDNN would run a head's `[G, t] x [t, d]` on one of them (it splits
a product over its output, here a single block), so it is one product per run batched over the
heads, which copies the run's V (once, not expanded) with every thread and then multiplies with
every thread. Fragmented block tables are read run by run the same way; only tables of more runs
than the runner keeps (`kv_slots`) are gathered. Sparse slabs that sit side by side are one
contiguous `[r, window, d]` batch per KV head; a group whose windows are not all side by side
is read as several such batches, never stacked into a copy.

`layers/attention_ref.py` keeps the previous implementation: the tests compare with it.
"""

from __future__ import annotations

import torch


def grouped_scores(q: torch.Tensor, keys: list[torch.Tensor],
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hkv, M, d] (M query rows per KV head), keys: runs [Hkv, t_i, d] -> q @ k^T,
    [Hkv, M, T] in q's dtype, T = sum t_i (written into out[..., :T] when given)."""
    hkv, m, _ = q.shape
    total = sum(k.shape[1] for k in keys)
    if out is None:
        out = q.new_empty(hkv, m, total)
    qs, start = q.unbind(0), 0  # unbind: one op for the heads' views (a step makes thousands)
    for k in keys:
        t = k.shape[1]
        # [M, d] x [d, t] per head: the run's rows as they lie
        for qh, kh, oh in zip(qs, k.transpose(1, 2).unbind(0),
                              out[..., start:start + t].unbind(0), strict=True):
            torch.mm(qh, kh, out=oh)
        start += t
    return out


def grouped_values(probs: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    """probs [Hkv, M, >=T] (the first T columns used), values: runs [Hkv, t_i, d] ->
    probs @ v, [Hkv, M, d], the runs' products summed."""
    hkv, m, _ = probs.shape
    batched = torch.get_num_threads() > 1 and probs.device.type == "cpu"  # the module's note
    out, start = None, 0
    for v in values:
        t = v.shape[1]
        p = probs[..., start:start + t]  # [Hkv, M, t]
        if batched:
            part = torch.matmul(p, v)  # [Hkv, M, d]
            out = part if out is None else out.add_(part)
        elif out is None:
            out = probs.new_empty(hkv, m, v.shape[-1])
            for ph, vh, oh in zip(p.unbind(0), v.unbind(0), out.unbind(0), strict=True):
                torch.mm(ph, vh, out=oh)
        else:
            for ph, vh, oh in zip(p.unbind(0), v.unbind(0), out.unbind(0), strict=True):
                oh.addmm_(ph, vh)
        start += t
    return out


def decode(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
           valid: torch.Tensor | None = None) -> torch.Tensor:
    """One query token over its KV runs: q [Hkv, G, d], keys/values runs [Hkv, t_i, d],
    valid [Hkv, T] (sparse: which slots hold KV) -> [Hkv, G, d]."""
    # the softmax in fp32 over the last, contiguous dim (2.5x faster than over dim 1)
    scores = grouped_scores(q, keys).float()  # [Hkv, G, T]
    if valid is not None:
        scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores.mul_(scale), dim=-1).to(q.dtype)
    return grouped_values(probs, values)


def decode_with_drafts(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                       k_draft: torch.Tensor, v_draft: torch.Tensor, scale: float,
                       valid: torch.Tensor | None = None,
                       draft_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The normal token and its m drafts over the same KV runs, draft i also over its own K/V:
    q [1+m, Hkv, G, d] (row 0 the normal token), keys/values runs [Hkv, t_i, d], k/v_draft
    [m, Hkv, d], valid [Hkv, T] the normal row's mask, draft_valid the drafts' (default valid)
    -> [1+m, Hkv, G, d]."""
    n, hkv, g, d = q.shape
    m = n - 1
    t = sum(k.shape[1] for k in keys)
    qg = q.permute(1, 0, 2, 3).reshape(hkv, n * g, d)  # [Hkv, (1+m)G, d]
    # the KV's scores and the drafts' own keys in one buffer: no concatenation
    buf = grouped_scores(qg, keys, out=q.new_empty(hkv, n * g, t + m))
    scores = buf.view(hkv, n, g, t + m)
    scores[..., :t].mul_(scale)
    if valid is not None:
        scores[:, 0, :, :t].masked_fill_(~valid[:, None, :], float("-inf"))
    draft_valid = valid if draft_valid is None else draft_valid
    if draft_valid is not None:
        scores[:, 1:, :, :t].masked_fill_(~draft_valid[:, None, None, :], float("-inf"))
    own = scores[..., t:]  # [Hkv, 1+m, G, m]: draft i sees only its own K/V
    own.fill_(float("-inf"))
    kd, vd = k_draft.transpose(0, 1), v_draft.transpose(0, 1)  # [Hkv, m, d]
    diag = torch.einsum("hmgd,hmd->hmg", q[1:].transpose(0, 1), kd) * scale  # [Hkv, m, G]
    idx = torch.arange(m, device=q.device)
    own[:, 1 + idx, :, idx] = diag.permute(1, 0, 2)
    probs = torch.softmax(buf, dim=-1)  # in bf16 too it computes in fp32 and rounds once
    out = grouped_values(probs, values)  # [Hkv, (1+m)G, d]
    out += torch.matmul(probs[..., t:], vd)
    return out.view(hkv, n, g, d).transpose(0, 1)


def side_by_side(starts: list[int], window: int) -> list[tuple[int, int]]:
    """Sorted window starts -> (first index, count) of each maximal chain of windows that
    follow one another in the pool: each chain is one in-place batch."""
    chains, first = [], 0
    for i in range(1, len(starts) + 1):
        if i == len(starts) or starts[i] != starts[i - 1] + window:
            chains.append((first, i - first))
            first = i
    return chains


def attend_slabs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 starts: list[int], t: int, window: int, valid: torch.Tensor,
                 hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """Sparse decodes with equal slabs, in one batch: q [R, n, Hkv, G, d] (row 0 of each
    request its normal token, then its drafts), the pools [Hkv, slots, d], starts the R windows'
    first slots (sorted; a window is a slab of t slots then its draft slots), valid [Hkv, R, t]
    the slabs' masks, hidden [n, 1, window - t] the draft slots each row does not see ->
    [R, n, Hkv, G, d]."""
    R, n, hkv, g, d = q.shape
    qh = q.permute(2, 0, 1, 3, 4).reshape(hkv, R, n * g, d)
    scores = q.new_empty(hkv, R, n * g, window)
    chains = side_by_side(starts, window)
    for a, r in chains:  # per chain and KV head: [r, window, d] is contiguous in the pool
        first = starts[a]
        keys = k_cache[:, first:first + r * window].view(hkv, r, window, d)
        for qk, kk, sk in zip(qh[:, a:a + r].unbind(0), keys.transpose(2, 3).unbind(0),
                              scores[:, a:a + r].unbind(0), strict=True):
            torch.bmm(qk, kk, out=sk)
    scores = scores.view(hkv, R, n, g, window).mul_(scale)
    scores[..., :t].masked_fill_(~valid[:, :, None, None, :], float("-inf"))
    scores[..., t:].masked_fill_(hidden, float("-inf"))
    # in bf16 too the softmax over the last dim computes in fp32 and rounds once
    probs = torch.softmax(scores, dim=-1).view(hkv, R, n * g, window)
    out = q.new_empty(hkv, R, n * g, d)
    for a, r in chains:
        first = starts[a]
        values = v_cache[:, first:first + r * window].view(hkv, r, window, d)
        for pk, vk, ok in zip(probs[:, a:a + r].unbind(0), values.unbind(0),
                              out[:, a:a + r].unbind(0), strict=True):
            torch.bmm(pk, vk, out=ok)
    return out.view(hkv, R, n, g, d).permute(1, 2, 0, 3, 4)
