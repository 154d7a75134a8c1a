"""The slot layout of a sparse request's slab: its device blocks, the first `blocks` entries
of its block table.

    slot:  0 .. K-1            K                K+1
           working set         active block     draft block

Slot s < K of KV head g holds the logical block head_map[s, g] (a different block per head);
the active block is the one the step's token fills, attended by every head; the draft block
holds the step's drafts' K/V (the runner writes them, attention reads them right after the
attended slots, draft i at token slot i). Attention reads the K+1 attended slots as the
request's KV, `kv_len` = (K+1)*B token slots. `CacheConfig.slab_blocks` (what the allocator
reserves) is `blocks` (tests/kv/test_slab.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Slab:
    top_k: int  # K: working-set slots
    block_size: int  # B: token slots per block
    # derived once (plain attributes: read in every step, not recomputed by a call)
    working: int = field(init=False)  # working-set slots: slots 0 .. K-1
    active: int = field(init=False)  # the active block's slot: K
    draft: int = field(init=False)  # the draft block's slot: K+1
    attended: int = field(init=False)  # slots attention reads: working set + active block
    blocks: int = field(init=False)  # device blocks of the slab: attended + the draft block
    attended_tokens: int = field(init=False)  # token slots attention reads (its kv_len)
    draft_tokens: int = field(init=False)  # token slots of the draft block: drafts it holds

    def __post_init__(self) -> None:
        K, B = self.top_k, self.block_size
        self.working = self.active = K
        self.draft = self.attended = K + 1
        self.blocks = K + 2
        self.attended_tokens = (K + 1) * B
        self.draft_tokens = B

    def slot_starts(self, table: list[int]) -> torch.Tensor:
        """First device token slot of each attended slot, [K+1] (the active block's last)."""
        return torch.tensor(table[:self.attended], dtype=torch.long) * self.block_size

    def working_tokens(self, table: list[int]) -> torch.Tensor:
        """Device token slots of the K working-set slots, [K * B], slot-major."""
        B = self.block_size
        starts = torch.tensor(table[:self.working], dtype=torch.long) * B
        return (starts[:, None] + torch.arange(B)).flatten()

    def active_token(self, table: list[int], pos: int) -> int:
        """Device token slot of position `pos` in the active block."""
        return table[self.active] * self.block_size + pos % self.block_size

    def draft_start(self, table: list[int]) -> int:
        """First device token slot of the draft block."""
        return table[self.draft] * self.block_size
