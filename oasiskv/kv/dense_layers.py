"""Sparse mode with `dense_layers=N`: the first N decoder layers attend to their whole context.

Quest and FreeKV keep layers 0-1 dense, where block selection does poorly. Those layers' K/V
lives in a device tensor of its own, `dense_kv [N, 2, Hkv, ids * B, d]`, indexed like the
host tier (token slot = host block * B + offset; on one node a host block's id is its summary
id). So a request's share of it is reserved with its summary ids at admission, for its whole
possible history (a sparse request never grows nor is preempted), freed with them, and each
block's share is charged to `device_kv_budget` beside the block's summary
(`kv/device_budget.dense_layer_bytes`).

In those layers every new token's K/V (prefill and decode rows alike) is written to the dense
copy and to the host tier, which keeps every layer's whole history as without dense layers;
attention reads the dense copy as dense mode reads its pool, drafts seeing the context and
their own K/V. Nothing selects or prefetches for them: the step context hands them a context
of their own (`StepContext.dense`), and the sparse KV (`kv/residency.SparseKV`) is built over
layers N.. only (its slabs, summaries, key copy and a view of the host tier), so it counts
layers from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from oasiskv.config import ModelConfig
from oasiskv.context import KVWrite, SeqAttention, StepContext


def check_dense_layers(dense_layers: int, mc: ModelConfig) -> None:
    """dense_layers must leave at least one sparse layer (all dense is kv_mode=dense)."""
    if not 0 <= dense_layers < mc.num_layers:
        raise ValueError(f"dense_layers must be in [0, {mc.num_layers}) for this model's "
                         f"{mc.num_layers} layers (all of them dense is kv_mode=dense), "
                         f"got {dense_layers}")


def sparse_layers(mc: ModelConfig, dense_layers: int) -> ModelConfig:
    """The model as the sparse KV sees it: its layers after the first `dense_layers`."""
    return dataclasses.replace(mc, num_layers=mc.num_layers - dense_layers)


def allocate_dense_kv(mc: ModelConfig, dense_layers: int, ids: int, block_size: int,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The dense layers' K/V [N, 2, Hkv, ids * B, d], a block per summary id (None for N=0).
    torch.empty: pages are touched only when used, as the other pools."""
    if not dense_layers:
        return None
    return torch.empty(dense_layers, 2, mc.num_kv_heads, ids * block_size, mc.head_dim,
                       dtype=dtype, device=device)


def dense_context(batch: list, seqs: list[SeqAttention],
                  view: Callable[..., SeqAttention],
                  token_slots: Callable[[list[int], int, int], torch.Tensor],
                  device: torch.device) -> StepContext:
    """The step context of the dense layers: for each batch entry (seq, n) with its sparse
    view in `seqs` (same rows, same draft rows), a view of its first start+n token slots
    in the dense copy, and writes of its new rows to the dense copy and the host tier at its
    host slots. `view(table, row, n, kv_len, pool)` and `token_slots(table, start, end)`: the
    runner's."""
    ctx = StepContext()
    rows, slots = [], []
    for (seq, n), attn in zip(batch, seqs, strict=True):
        start = seq.num_computed_tokens
        dense = view(seq.host_table, attn.q_start, n, start + n, "dense")
        dense.draft_rows = attn.draft_rows  # never written: attention takes their K/V as new
        ctx.seqs.append(dense)
        rows.append(torch.arange(attn.q_start, attn.q_end))
        slots.append(token_slots(seq.host_table, start, start + n))
    r, s = torch.cat(rows).to(device), torch.cat(slots).to(device)
    ctx.writes = [KVWrite("dense", r, s), KVWrite("host", r, s)]
    return ctx


def token_bytes(dense_kv: torch.Tensor) -> int:
    """Bytes of one token's K and V in all dense layers."""
    return dense_kv[:, :, :, 0].numel() * dense_kv.element_size()
