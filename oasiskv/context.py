"""The per-step context that attention layers read (nano-vllm's set_context idiom).

The runner builds it once per step; model files never see it, only `layers/attention.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SeqAttention:
    """One sequence's part of the flattened token batch and where its KV lives in the pool."""

    q_start: int  # first row of this sequence in the step's token batch
    q_end: int  # one past its last row
    kv_len: int  # context tokens attended, including this step's new ones
    kv_start: int | None  # first token slot when the context is one contiguous run
    kv_slots: torch.Tensor | None  # [kv_len] token slots otherwise (gather path)

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start


@dataclass
class StepContext:
    slot_mapping: torch.Tensor  # [N] pool token slot that each new token's K/V is written to
    seqs: list[SeqAttention] = field(default_factory=list)


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("attention ran outside a step: the runner sets the step context")
    return _CONTEXT
