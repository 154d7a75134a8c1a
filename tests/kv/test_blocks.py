"""BlockPool: no block is ever owned twice, counts stay consistent, requests stay contiguous
while the pool has room, and exhaustion is a MemoryError that changes nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv.kv.blocks import BlockPool, block_runs, is_contiguous

NUM_TABLES = 5

ops = st.lists(st.one_of(
    st.tuples(st.just("grow"), st.integers(0, NUM_TABLES - 1), st.integers(0, 70)),
    st.tuples(st.just("free"), st.integers(0, NUM_TABLES - 1), st.just(0)),
), max_size=60)


def check(pool: BlockPool, tables: list[list[int]], tokens: list[int], peak: int) -> None:
    owned = [b for t in tables for b in t]
    assert len(owned) == len(set(owned)), "a block is in two tables"
    assert all(0 <= b < pool.num_blocks for b in owned)
    assert not pool.is_free[owned].any(), "an owned block is marked free"
    assert pool.num_free == int(pool.is_free.sum()) == pool.num_blocks - len(owned)
    assert pool.num_used == len(owned)
    assert pool.peak_used == peak
    for t, n in zip(tables, tokens, strict=True):
        assert len(t) == pool.blocks_for(n)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), ops=ops)
def test_random_grow_and_free_keep_invariants(num_blocks, block_size, ops):
    pool = BlockPool(num_blocks, block_size)
    tables: list[list[int]] = [[] for _ in range(NUM_TABLES)]
    tokens = [0] * NUM_TABLES
    peak = 0
    for op, i, extra in ops:
        if op == "free":
            pool.free(tables[i])
            assert tables[i] == []
            tokens[i] = 0
        else:
            target = tokens[i] + extra
            need = -(-target // block_size) - len(tables[i])
            before = (list(tables[i]), pool.num_free, pool.is_free.copy())
            if need > pool.num_free:
                with pytest.raises(MemoryError):
                    pool.grow(tables[i], target)
                # A failed grow takes nothing.
                assert tables[i] == before[0] and pool.num_free == before[1]
                assert np.array_equal(pool.is_free, before[2])
            else:
                pool.grow(tables[i], target)
                assert tables[i][:len(before[0])] == before[0]  # grows at the end only
                tokens[i] = target
        peak = max(peak, sum(len(t) for t in tables))
        check(pool, tables, tokens, peak)


def test_two_requests_growing_alternately_stay_contiguous():
    pool = BlockPool(64, 16)
    a, b = [], []
    for n in range(1, 26):  # 25 blocks each: 50 of 64
        pool.grow(a, n * 16)
        pool.grow(b, n * 16)
    assert is_contiguous(a) and is_contiguous(b)
    assert not set(a) & set(b)


def test_third_request_lands_in_the_largest_gap_and_all_stay_contiguous():
    pool = BlockPool(90, 1)
    tables = [[], [], []]
    for n in range(1, 21):  # 20 blocks each: 60 of 90
        for t in tables:
            pool.grow(t, n)
    assert all(is_contiguous(t) for t in tables)
    assert len({b for t in tables for b in t}) == 60


def test_freed_space_is_reused_contiguously():
    pool = BlockPool(32, 4)
    a, b = [], []
    pool.grow(a, 40)  # 10 blocks
    pool.grow(b, 40)
    pool.free(a)
    c = []
    pool.grow(c, 48)  # 12 blocks: fits in the largest free run
    assert is_contiguous(c) and is_contiguous(b)


def test_exhaustion_is_memory_error_and_takes_nothing():
    pool = BlockPool(4, 16)
    a, b = [], []
    pool.grow(a, 64)
    assert pool.num_free == 0
    with pytest.raises(MemoryError, match="exhausted"):
        pool.grow(b, 1)
    assert b == [] and pool.num_free == 0 and pool.peak_used == 4
    pool.free(a)
    assert pool.num_free == 4 and pool.num_used == 0 and pool.peak_used == 4
    pool.grow(b, 17)  # 2 blocks
    assert len(b) == 2 and pool.num_free == 2
    with pytest.raises(MemoryError):
        pool.grow(b, 17 + 3 * 16)  # 3 more blocks, 2 free
    assert len(b) == 2 and pool.num_free == 2


def test_fragmented_pool_still_allocates_every_block():
    pool = BlockPool(8, 1)
    tables = [[] for _ in range(8)]
    for t in tables:
        pool.grow(t, 1)
    assert sorted(t[0] for t in tables) == list(range(8))
    for t in tables:
        if t[0] % 2 == 0:
            pool.free(t)  # every other block free: no run longer than 1
    big = []
    pool.grow(big, 4)
    assert sorted(big) == [0, 2, 4, 6] and not is_contiguous(big)
    assert pool.num_free == 0


def test_block_runs_by_hand():
    assert block_runs([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert block_runs([7]) == [(7, 1)] and block_runs([]) == []


def test_sparse_slabs_sit_side_by_side():
    pool = BlockPool(40, 16)
    tables = [[] for _ in range(4)]
    for t in tables:  # a slab of 5 blocks each
        pool.take_run(t, 5)
    assert tables == [list(range(s, s + 5)) for s in (0, 5, 10, 15)]
    pool.free(tables[1])
    again = []
    pool.take_run(again, 5)  # the freed slab's place, side by side with its neighbours again
    assert again == list(range(5, 10))
    with pytest.raises(MemoryError, match="exhausted"):
        pool.take_run(again, pool.num_free + 1)


def test_slab_falls_back_to_any_run_then_to_any_blocks():
    pool = BlockPool(12, 1)
    singles = [[] for _ in range(12)]
    for t in singles:
        pool.grow(t, 1)
    for t in singles:
        if t[0] in (1, 2, 3, 4, 7, 9, 11):  # free: a run 1..4 (not at a multiple of 4), 7, 9, 11
            pool.free(t)
    slab = []
    pool.take_run(slab, 4)
    assert slab == [1, 2, 3, 4]
    slab = []
    pool.take_run(slab, 3)  # no run of 3 left: the lowest free blocks
    assert slab == [7, 9, 11] and pool.num_free == 0


def test_is_contiguous():
    assert is_contiguous([]) and is_contiguous([5]) and is_contiguous([3, 4, 5])
    assert not is_contiguous([3, 5]) and not is_contiguous([4, 3]) and not is_contiguous(
        [1, 3, 2, 4])


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0, 16)
