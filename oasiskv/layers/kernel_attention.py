"""The step's decodes through the compiled kernel (`layers/decode_kernel.py`): which of them it
takes, packed once a step, and its call per layer.

It takes every decode whose K/V lie in runs of a pool (one run, a few runs, a sparse slab), with
its draft rows; a draft's own K/V is its row of the step's k/v (in a sparse slab also in the
draft slots, written from those rows: the same values). One call per pool attends them all, so
the threads share requests x KV heads (split over the sequence when those are few). What it
does not take goes the other ways: prefill chunks, a table gathered into slots, a context that
is all new.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from oasiskv.context import SeqAttention

MIN_CHUNK = 256  # the fewest slots of a chunk when a request's slots are split over threads
ISA = ""  # the instruction set of the kernel's loops: "" the best this CPU runs, or a name


@dataclass
class KernelBatch:
    """One pool's decodes, in the kernel's layout (int64 CPU vectors)."""

    pool: str
    seqs: list[SeqAttention]
    rows: torch.Tensor  # [rows] per request its normal row, then its drafts' rows
    row_off: torch.Tensor  # [B+1] request b's rows: rows[row_off[b]:row_off[b+1]]
    runs: torch.Tensor  # [2*runs] (first slot, slots) per run, requests one after another
    run_off: torch.Tensor  # [B+1] request b's runs: run_off[b]..run_off[b+1]


def takes(seq: SeqAttention) -> bool:
    """A decode whose K/V the kernel reads in place."""
    return seq.num_queries == 1 and seq.kv_slots is None and seq.kv_len > 1


def plan(seqs: list[SeqAttention]) -> tuple[list[KernelBatch], list[SeqAttention]]:
    """The kernel's batches, one per pool, and the sequences left to the other paths."""
    parts: dict[str, tuple[list, list, list, list, list]] = {}
    rest = []
    for seq in seqs:
        if not takes(seq):
            rest.append(seq)
            continue
        kept, rows, row_off, runs, run_off = parts.setdefault(seq.pool, ([], [], [0], [], [0]))
        kept.append(seq)
        rows += [seq.q_start, *seq.draft_rows]
        row_off.append(len(rows))
        for first, n in seq.kv_runs or [(seq.kv_start, seq.kv_len)]:
            runs += [first, n]
        run_off.append(len(runs) // 2)
    batches = [KernelBatch(pool, kept, *(torch.tensor(x, dtype=torch.int64) for x in lists))
               for pool, (kept, *lists) in parts.items()]
    return batches, rest


def attend(ext: ModuleType, pools: dict[str, tuple[torch.Tensor, torch.Tensor]],
           batches: list[KernelBatch], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           out: torch.Tensor, scale: float) -> None:
    """q [N, H, d], k/v [N, Hkv, d] the step's rows; writes the batches' rows of out [N, H*d]."""
    n, h, d = q.shape
    out3 = out.view(n, h, d)
    # the kernel reads rows of d contiguous values; a small batch's projections may come out
    # column-major (a copy of the step's few rows)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    k_rows, v_rows = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, N, d]: the drafts' own K/V
    for b in batches:
        k_cache, v_cache = pools[b.pool]
        ext.decode(out3, q, k_cache, v_cache, k_rows, v_rows, b.rows, b.row_off, b.runs,
                   b.run_off, b.rows, [s.kv_valid for s in b.seqs],
                   [s.draft_valid for s in b.seqs], scale, MIN_CHUNK, ISA)
