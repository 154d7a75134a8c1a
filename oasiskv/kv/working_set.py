"""The per-request and per-step data of sparse decoding: a request's working sets (one per
layer) and what a step knows of each of its sparse decodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.context import SeqAttention
from oasiskv.sequence import Sequence


@dataclass
class WorkingSet:
    head_map: torch.Tensor  # [L, K, Hkv] logical block per (slot, head); -1 = empty
    last_used: torch.Tensor  # [L, K, Hkv] when the slot's block was last selected (select.stamp)
    seeded: list[bool]  # per layer: the cap applies once a top-K set was chosen uncapped
    primed: list[bool]  # per layer: the previous step already chose this step's blocks


@dataclass
class StepDecode:
    seq: Sequence
    attn: SeqAttention | None  # None for a token committed after the step (accepted draft)
    pos: int  # position of the step's token
    summary_ids: torch.Tensor  # [n_full] summary id of each complete logical block (one node:
    # also its host block)
    slab_tokens: torch.Tensor  # [K+1] first device token slot of each attended slot (Slab)
    summary_start: int | None = None  # summary_ids[0] when they are one run (a view)

