"""The per-step context that attention layers read (nano-vllm's set_context idiom).

The runner builds it once per step; model files never see it, only `layers/attention.py`.
What attention calls per layer on the sparse side is the `LayerHooks` protocol, which
`kv/residency.SparseKV` and the recall tool's probe (`eval/recall_probe.RecallProbe`)
implement; this module knows neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SeqAttention:
    """One sequence's part of the flattened token batch and where its KV lives."""

    q_start: int  # first row of this sequence in the step's token batch
    q_end: int  # one past its last row
    kv_len: int  # token slots attended, including this step's new ones
    kv_start: int | None  # first token slot when they are one contiguous run
    kv_slots: torch.Tensor | None  # [kv_len] token slots otherwise (gather path)
    pool: str = "device"  # "device" or "host" (sparse prefill reads the host tier)
    # a fragmented table of a few runs of blocks: (first token slot, tokens) per run, in order
    # (kv_start and kv_slots are None); decode reads each run in place
    kv_runs: list[tuple[int, int]] | None = None
    kv_valid: torch.Tensor | None = None  # [Hkv, kv_len] sparse working set: which slots hold KV
    # Draft tokens (decode only): rows of the batch whose queries ride along with the normal
    # token. Each sees the KV the normal token sees (masked by draft_valid, default kv_valid)
    # plus its own K/V, never written to the cache; the normal token never sees them.
    draft_rows: list[int] = field(default_factory=list)
    draft_valid: torch.Tensor | None = None  # [Hkv, kv_len]
    # sparse decode: the token slots right after kv_len (the slab's draft block) where this
    # step writes its drafts' K/V, draft i at slot i (the rest hold finite values, unseen);
    # attention reads them with the slab. 0: the drafts' K/V are not in the pool.
    draft_slots: int = 0

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start


@dataclass
class KVWrite:
    """New tokens' K/V rows of the batch -> token slots of one pool."""

    pool: str  # "device" or "host"
    rows: torch.Tensor | slice  # [n] rows of the step's token batch (a slice: the first n)
    slots: torch.Tensor  # [n] token slots


@dataclass
class SlabGroup:
    """Sparse decodes attended in one batch: equal slabs, draft slots and draft counts
    (`layers/attention.slab_groups` builds them once a step)."""

    rows: torch.Tensor  # [R, 1+m] each request's normal row, then its drafts' rows
    seqs: list[SeqAttention]  # sorted by slab
    in_place: bool  # the windows (slab + draft slots) are one run of the pool, read as a view
    hidden: torch.Tensor  # [1+m, 1, draft slots]: row 0 sees no draft slot, row 1+i slot i


@runtime_checkable
class LayerHooks(Protocol):
    """What attention calls on `StepContext.sparse` in every layer of a step, in this order,
    its layer counted from the first sparse one (with dense_layers=N, model layer N+i is its i)."""

    def wait_layer(self, layer: int) -> None:
        """Before the layer's K/V writes: whatever must land in its slots first (prefetch)."""

    def prepare_layer(self, layer: int, q: torch.Tensor) -> None:
        """After the writes, before attention: q [N, H, d] the step's queries; sets each
        sparse decode's masks (`SeqAttention.kv_valid`, `draft_valid`)."""

    def after_attention(self, layer: int, q: torch.Tensor) -> None:
        """After attention has read the layer's slots: q [N, H, d] as above."""


@dataclass
class StepContext:
    writes: list[KVWrite] = field(default_factory=list)
    seqs: list[SeqAttention] = field(default_factory=list)
    sparse: LayerHooks | None = None  # selects and fetches working sets before attention
    # layer -> (k, v) [N, Hkv, d] of the step's rows, kept when drafts may be accepted
    draft_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    # attention's batches of equal sparse slabs (layers/attention.slab_groups), set by the
    # first layer
    slab_groups: list[SlabGroup] | None = None
    # the decode kernel's batches and the sequences it leaves (layers/kernel_attention.plan),
    # set by the first layer
    decode_plan: tuple | None = None
    # sparse with dense_layers=N: layers 0..N-1 read `dense` instead (whole contexts in their
    # own device copy, no working sets); `sparse` then counts its layers from layer N
    dense: StepContext | None = None
    dense_layers: int = 0

    def for_layer(self, layer: int) -> StepContext:
        """What attention layer `layer` reads: `dense` for the first dense_layers layers."""
        return self.dense if layer < self.dense_layers else self


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside a step: the runner sets the step context")
    return _CONTEXT
