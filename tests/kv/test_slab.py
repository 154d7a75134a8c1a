"""The slab's slot layout (`kv/slab.Slab`) against a hand-computed case: K = 3 working slots,
blocks of B = 4 tokens, a block table whose slab is blocks 10, 11, 12 (working set), 20
(active) and 21 (draft)."""

import torch

from oasiskv.config import CacheConfig
from oasiskv.kv.slab import Slab

TABLE = [10, 11, 12, 20, 21, 99]  # 99: past the slab (a table is never longer; ignored)


def test_slots_and_sizes():
    slab = Slab(top_k=3, block_size=4)
    assert (slab.working, slab.active, slab.draft) == (3, 3, 4)
    assert (slab.attended, slab.blocks) == (4, 5)
    assert (slab.attended_tokens, slab.draft_tokens) == (16, 4)


def test_token_slots_of_a_table():
    slab = Slab(top_k=3, block_size=4)
    assert slab.slot_starts(TABLE).tolist() == [40, 44, 48, 80]
    assert slab.working_tokens(TABLE).tolist() == list(range(40, 52))
    assert slab.active_token(TABLE, 13) == 81  # position 13: offset 1 of its block
    assert slab.active_token(TABLE, 16) == 80
    assert slab.draft_start(TABLE) == 84
    assert slab.slot_starts(TABLE).dtype == torch.long


def test_the_allocator_reserves_the_slab():
    """CacheConfig.slab_blocks (what the allocator reserves, config cannot import kv) equals
    the slab's blocks."""
    for top_k, block in ((3, 4), (128, 16), (1, 8)):
        assert CacheConfig(top_k=top_k, block_size=block).slab_blocks == Slab(top_k, block).blocks
