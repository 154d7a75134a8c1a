"""The step's decodes through the Triton kernel (`layers/triton_kernels/decode.py`) on CUDA:
which of them it takes (those the CPU kernel takes, `kernel_attention.takes`), planned once a
step into device tensors, and its call per layer (attention dispatches here on CUDA; the CPU
keeps its paths).

A request's slots, run after run, are cut into units of at most `chunk` slots, so that units x
KV heads give the GPU enough programs (flash-decoding: a long request is split over the
sequence and its partials merged by log-sum-exp); a request of one unit is written directly.
The plan is built on the host once a step (the CPU kernel's plan is too) and copied to the
device in one go; per layer only the masks are stacked (they change per layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch

from oasiskv.context import SeqAttention
from oasiskv.layers.kernel_attention import takes

MIN_CHUNK = 256  # the fewest slots of a unit when a request is split
PROGRAMS = 528  # units x KV heads the split aims at (4 per SM of an H100's 132)
TILE = 64  # the kernel's slots per tile: a unit's length rounds up to it


@dataclass
class TritonBatch:
    """One pool's decodes, in the kernel's layout (int64 tensors on the device)."""

    pool: str
    seqs: list[SeqAttention]
    units: torch.Tensor  # [U, 6] request, first slot, slots, first position, partial, last
    rows: torch.Tensor  # [rows] per request its normal row, then its drafts' rows
    row_off: torch.Tensor  # [B+1]
    merges: torch.Tensor  # [R, 3] the split requests: request, first unit, one past its last
    max_rows: int  # the most rows of one request (1 + its drafts)
    mask_key: tuple  # which requests had which masks when mask_index was built
    mask_index: torch.Tensor  # [B, 2] the normal row's and the drafts' mask (-1: none)


def chunk_for(seqs: list[SeqAttention], hkv: int) -> int:
    """Slots per unit: the batch's slots over the units that fill PROGRAMS with its KV heads."""
    total = sum(s.kv_len for s in seqs)
    units = max(1, PROGRAMS // max(1, hkv))
    return max(MIN_CHUNK, math.ceil(total / units / TILE) * TILE)


def units_of(seq: SeqAttention, chunk: int) -> list[tuple[int, int, int]]:
    """(first slot, slots, first position) of a request's units: its runs cut at `chunk`."""
    out, pos = [], 0
    for first, n in seq.kv_runs or [(seq.kv_start, seq.kv_len)]:
        for a in range(0, n, chunk):
            out.append((first + a, min(chunk, n - a), pos + a))
        pos += n
    return out


def mask_layout(seqs: list[SeqAttention]) -> tuple[tuple, list[list[int]]]:
    """Which masks the requests have now, and each request's (normal, drafts) index into the
    stacked masks (`stack_masks` stacks them in this order)."""
    key, index, n = [], [], 0
    for s in seqs:
        has, own = s.kv_valid is not None, s.draft_valid is not None
        key.append((has, own))
        normal = n if has else -1
        n += has
        drafts = n if own else normal
        n += own
        index.append([normal, drafts])
    return tuple(key), index


def stack_masks(seqs: list[SeqAttention], device: torch.device) -> torch.Tensor:
    """The requests' masks as one uint8 tensor [masks, Hkv, T] (shorter ones padded unseen)."""
    masks = [m for s in seqs for m in (s.kv_valid, s.draft_valid) if m is not None]
    if not masks:
        return torch.empty(0, 1, 1, dtype=torch.uint8, device=device)
    if all(m.shape == masks[0].shape for m in masks):
        return torch.stack(masks).to(device).view(torch.uint8)
    hkv, t = masks[0].shape[0], max(m.shape[1] for m in masks)
    out = torch.zeros(len(masks), hkv, t, dtype=torch.uint8, device=device)
    for i, m in enumerate(masks):
        out[i, :, :m.shape[1]] = m.to(device)
    return out


def plan(seqs: list[SeqAttention], device: torch.device, hkv: int,
         chunk: int | None = None) -> tuple[list[TritonBatch], list[SeqAttention]]:
    """The kernel's batches, one per pool, and the sequences left to the other paths."""
    by_pool: dict[str, list[SeqAttention]] = {}
    rest = []
    for seq in seqs:
        (by_pool.setdefault(seq.pool, []) if takes(seq) else rest).append(seq)
    batches = []
    for pool, kept in by_pool.items():
        size = chunk or chunk_for(kept, hkv)
        units, rows, row_off, merges = [], [], [0], []
        for b, seq in enumerate(kept):
            rows += [seq.q_start, *seq.draft_rows]
            row_off.append(len(rows))
            parts = units_of(seq, size)
            u0 = len(units)
            split = len(parts) > 1
            for i, (first, n, pos) in enumerate(parts):
                units.append([b, first, n, pos, u0 + i if split else -1, i == len(parts) - 1])
            if split:
                merges.append([b, u0, len(units)])
        key, index = mask_layout(kept)
        # one copy to the device for the step's plan
        flat = torch.tensor([x for u in units for x in u] + rows + row_off
                            + [x for m in merges for x in m] + [x for i in index for x in i],
                            dtype=torch.int64).to(device)
        cuts = [6 * len(units), len(rows), len(row_off), 3 * len(merges), 2 * len(index)]
        u, r, ro, mg, mi = flat.split(cuts)
        batches.append(TritonBatch(pool, kept, u.view(-1, 6), r, ro, mg.view(-1, 3),
                                   max(1 + len(s.draft_rows) for s in kept), key,
                                   mi.view(-1, 2)))
    return batches, rest


def attend(kernels: ModuleType, pools: dict[str, tuple[torch.Tensor, torch.Tensor]],
           batches: list[TritonBatch], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: torch.Tensor, scale: float) -> None:
    """q [N, H, d], k/v [N, Hkv, d] the step's rows (the drafts' own K/V); writes the batches'
    rows of out [N, H*d]. `kernels` is `layers/triton_kernels/decode.py`."""
    n, h, d = q.shape
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    for b in batches:
        key, index = mask_layout(b.seqs)
        if key != b.mask_key:  # the masks' presence changed since the plan (not expected)
            b.mask_key = key
            b.mask_index = torch.tensor(index, dtype=torch.int64).view(-1, 2).to(q.device)
        k_cache, v_cache = pools[b.pool]
        kernels.decode(out.view(n, h, d), q, k_cache, v_cache, k, v, b.units, b.rows, b.row_off,
                       b.merges, stack_masks(b.seqs, q.device), b.mask_index, b.max_rows, scale)
