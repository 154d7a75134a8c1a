"""Decode attention over K/V where they lie in the pool, in Triton (flash-decoding).

The same contract as the CPU kernel (`csrc/decode_attention.cpp`): for each request and KV
head, the request's query rows (its normal token, then its drafts) times the G query heads of
the group (M = rows x G, padded to BLOCK_M) are scored against its slots, one tile of BLOCK_N
slots at a time, with an online softmax in fp32; K/V are read in place, never expanded to the
query heads. A request's slots are cut into units (a piece of one run); a request of one unit
writes its output, the units of a longer one write partials (the unnormalised sum, max and
sum of exps) that `_merge` joins by log-sum-exp. Row class 0 (the normal token) sees a slot
where its mask allows it, the drafts where theirs does; draft j also sees its own K/V (its row
of the step's k/v), added by the request's last unit. Built by `layers/triton_attention.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # slots per tile
# a unit's 6 fields (int64): request, first slot, slots, first position (in the request's
# order of slots: its masks' index), partial (-1: writes the output), last (adds own K/V)


@triton.jit
def _decode(q_ptr, q_rs, q_hs, o_ptr, o_rs, o_hs,  # [N, H, d] the step's queries, the output
            k_ptr, k_hs, k_ss, v_ptr, v_hs, v_ss,  # the pool's [Hkv, S, d]
            ke_ptr, ke_rs, ke_hs, ve_ptr, ve_rs, ve_hs,  # [N, Hkv, d] the step's own K/V rows
            mask_ptr, mask_ms, mask_hs,  # [masks, Hkv, T] uint8: 1 where a slot is seen
            units_ptr, rows_ptr, row_off_ptr, masks_ptr,  # the plan (int64)
            part_o_ptr, part_m_ptr, part_l_ptr,  # partials [U, Hkv, BLOCK_M(, BLOCK_D)]
            d, scale, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)  # int64 offsets: a pool may pass 2^31 elements
    h = tl.program_id(1).to(tl.int64)
    hkv = tl.num_programs(1)
    b = tl.load(units_ptr + u * 6)
    first = tl.load(units_ptr + u * 6 + 1)
    count = tl.load(units_ptr + u * 6 + 2)
    pos0 = tl.load(units_ptr + u * 6 + 3)
    part = tl.load(units_ptr + u * 6 + 4)
    last = tl.load(units_ptr + u * 6 + 5)
    r0 = tl.load(row_off_ptr + b)
    n = tl.load(row_off_ptr + b + 1) - r0
    mask0 = tl.load(masks_ptr + b * 2)  # the normal row's mask, -1: sees every slot
    mask1 = tl.load(masks_ptr + b * 2 + 1)  # the drafts'

    m = tl.arange(0, BLOCK_M)
    j = m // G  # row class: 0 the normal token, j >= 1 draft j
    row_ok = j < n
    row = tl.load(rows_ptr + r0 + j, mask=row_ok, other=0)
    head = h * G + m % G
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < d
    qd_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + row[:, None] * q_rs + head[:, None] * q_hs + dd[None, :], mask=qd_ok,
                other=0.0)  # [BLOCK_M, BLOCK_D]

    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, count, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < count
        slot = first + t
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + h * k_hs + slot[:, None] * k_ss + dd[None, :], mask=kv_ok, other=0.0)
        s = tl.dot(q.to(DOT), tl.trans(k.to(DOT)), input_precision=PRECISION) * scale
        pos = pos0 + t
        seen0 = tl.load(mask_ptr + mask0 * mask_ms + h * mask_hs + pos, mask=t_ok & (mask0 >= 0),
                        other=1) != 0
        seen1 = tl.load(mask_ptr + mask1 * mask_ms + h * mask_hs + pos, mask=t_ok & (mask1 >= 0),
                        other=1) != 0
        seen = tl.where((j == 0)[:, None], seen0[None, :], seen1[None, :])
        s = tl.where(seen & t_ok[None, :] & row_ok[:, None], s, float("-inf"))
        new = tl.maximum(mx, tl.max(s, 1))
        safe = tl.where(new == float("-inf"), 0.0, new)  # a row that has seen nothing yet
        alpha = tl.exp(mx - safe)
        p = tl.exp(s - safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + h * v_hs + slot[:, None] * v_ss + dd[None, :], mask=kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
        mx = new
    if last != 0:  # each draft's own K/V: one more slot that only it sees
        own = row_ok & (j > 0)
        own_d = own[:, None] & d_ok[None, :]
        ke = tl.load(ke_ptr + row[:, None] * ke_rs + h * ke_hs + dd[None, :], mask=own_d,
                     other=0.0)
        s1 = tl.sum(q.to(tl.float32) * ke.to(tl.float32), 1) * scale
        s1 = tl.where(own, s1, float("-inf"))
        new = tl.maximum(mx, s1)
        safe = tl.where(new == float("-inf"), 0.0, new)
        alpha = tl.exp(mx - safe)
        p1 = tl.exp(s1 - safe)
        total = total * alpha + p1
        ve = tl.load(ve_ptr + row[:, None] * ve_rs + h * ve_hs + dd[None, :], mask=own_d,
                     other=0.0)
        acc = acc * alpha[:, None] + p1[:, None] * ve.to(tl.float32)
        mx = new
    if part < 0:  # the request's only unit: its output (a row that saw nothing: NaN, as SDPA)
        out = acc / tl.where(row_ok, total, 1.0)[:, None]
        tl.store(o_ptr + row[:, None] * o_rs + head[:, None] * o_hs + dd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=qd_ok)
    else:
        at = (part * hkv + h) * BLOCK_M + m
        tl.store(part_o_ptr + at[:, None] * BLOCK_D + dd[None, :], acc)
        tl.store(part_m_ptr + at, mx)
        tl.store(part_l_ptr + at, total)


@triton.jit
def _merge(o_ptr, o_rs, o_hs, merges_ptr, rows_ptr, row_off_ptr,
           part_o_ptr, part_m_ptr, part_l_ptr, d,
           G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A split request's partials joined by log-sum-exp: merges [R, 3] (request, its first
    unit, one past its last)."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    hkv = tl.num_programs(1)
    b = tl.load(merges_ptr + i * 3)
    u0 = tl.load(merges_ptr + i * 3 + 1)
    u1 = tl.load(merges_ptr + i * 3 + 2)
    m = tl.arange(0, BLOCK_M)
    dd = tl.arange(0, BLOCK_D)
    mx = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for u in range(u0, u1):
        at = (u * hkv + h) * BLOCK_M + m
        mu = tl.load(part_m_ptr + at)
        new = tl.maximum(mx, mu)
        safe = tl.where(new == float("-inf"), 0.0, new)
        a = tl.exp(mx - safe)
        c = tl.exp(mu - safe)
        total = total * a + tl.load(part_l_ptr + at) * c
        part = tl.load(part_o_ptr + at[:, None] * BLOCK_D + dd[None, :])
        acc = acc * a[:, None] + part * c[:, None]
        mx = new
    r0 = tl.load(row_off_ptr + b)
    n = tl.load(row_off_ptr + b + 1) - r0
    j = m // G
    row_ok = j < n
    row = tl.load(rows_ptr + r0 + j, mask=row_ok, other=0)
    head = h * G + m % G
    out = acc / tl.where(row_ok, total, 1.0)[:, None]
    tl.store(o_ptr + row[:, None] * o_rs + head[:, None] * o_hs + dd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (dd < d)[None, :])


def decode(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           k_rows: torch.Tensor, v_rows: torch.Tensor, units: torch.Tensor, rows: torch.Tensor,
           row_off: torch.Tensor, merges: torch.Tensor, masks: torch.Tensor,
           mask_index: torch.Tensor, max_rows: int, scale: float) -> None:
    """out/q [N, H, d], the pool's k/v_cache [Hkv, S, d], the step's k/v_rows [N, Hkv, d] (the
    drafts' own K/V); the plan (int64, on q's device): units [U, 6], rows and row_off (request
    b's rows: rows[row_off[b]:row_off[b+1]], its normal row first), merges [R, 3] the split
    requests; masks [masks, Hkv, T] uint8 and mask_index [B, 2] (the normal row's, the drafts';
    -1: none); max_rows the most rows of a request. Writes the requests' rows of out."""
    hkv, _, d = k_cache.shape
    if masks.numel() == 0:  # no request has a mask: a pointer that is never read
        masks = torch.ones(1, 1, 1, dtype=torch.uint8, device=q.device)
    if any(x.stride(-1) != 1 for x in (out, q, k_cache, v_cache, k_rows, v_rows, masks)):
        raise ValueError("decode: every tensor's last dim must be contiguous")
    group = q.shape[1] // hkv
    block_m = max(16, triton.next_power_of_2(max_rows * group))  # tl.dot's least M
    block_d = max(16, triton.next_power_of_2(d))
    # fp32 inputs multiply in fp32 ("ieee", not tf32) as the PyTorch paths do. Triton's
    # interpreter (CPU tensors: the tests) multiplies bf16 as integers (its numpy has no bf16)
    # and truncates fp32 to bf16 (the GPU rounds to nearest): there the products are fp32 and
    # the output is written in fp32 and rounded by torch
    dot = tl.float32 if not q.is_cuda or q.dtype == torch.float32 else tl.bfloat16 \
        if q.dtype == torch.bfloat16 else tl.float16
    target = out if q.is_cuda or out.dtype == torch.float32 else out.float()
    precision = "ieee" if dot == tl.float32 else None
    n_units = units.shape[0]
    split = merges.shape[0] > 0
    shape = (n_units, hkv, block_m) if split else (1,)
    part_m = torch.empty(shape, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_o = torch.empty((*shape, block_d) if split else (1,), dtype=torch.float32,
                         device=q.device)
    _decode[(n_units, hkv)](
        q, q.stride(0), q.stride(1), target, target.stride(0), target.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), v_cache, v_cache.stride(0),
        v_cache.stride(1), k_rows, k_rows.stride(0), k_rows.stride(1), v_rows, v_rows.stride(0),
        v_rows.stride(1), masks, masks.stride(0), masks.stride(1), units, rows, row_off,
        mask_index, part_o, part_m, part_l, d, scale, G=group, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, BLOCK_D=block_d, DOT=dot, PRECISION=precision)
    if split:
        _merge[(merges.shape[0], hkv)](
            target, target.stride(0), target.stride(1), merges, rows, row_off, part_o, part_m,
            part_l, d, G=group, BLOCK_M=block_m, BLOCK_D=block_d)
    if target is not out:
        out.copy_(target)
