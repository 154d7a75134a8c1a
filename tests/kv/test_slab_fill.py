"""Slab loading and fills (`kv/slab_fill.py`) on the hand-checkable SparseKV of
`sparse_units`: slab blocks 3, 4 (working slots), 5 (active), 6 (draft), host block b = logical
block b, position 5 (blocks 0 and 1 complete, block 2 active holding position 4).
Working sets: head 0 holds block 1 in slot 0 (slot 1 empty); head 1 blocks 0 and 1."""

import math

import torch
from sparse_units import device, make_kv, make_seq

from oasiskv.kv.working_set import WorkingSet

NAN = float("nan")


def with_working_set(seq):
    seq.working_set = WorkingSet(torch.tensor([[[1, 0], [-1, 1]]]),  # [L, K, Hkv]
                                 torch.tensor([[[0, 5], [0, 3]]]), [True], [True])
    return seq


def same(got: list[float], want: list[float]) -> bool:
    return all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, want,
                                                                         strict=True))


def test_load_slab_from_the_host():
    kv = make_kv()
    seq = with_working_set(make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5))
    kv.load_slab(seq, 5)
    slab = list(range(6, 14))  # slots 0, 1, active, draft: 2 tokens each
    assert device(kv, 0, 0, slab) == [2, 3, 0, 0, 4, 0, 0, 0]
    assert device(kv, 1, 0, slab) == [1002, 1003, 0, 0, 1004, 0, 0, 0]
    assert device(kv, 0, 1, slab) == [100, 101, 102, 103, 104, 0, 0, 0]
    assert device(kv, 1, 1, slab) == [1100, 1101, 1102, 1103, 1104, 0, 0, 0]
    assert same(device(kv, 0, 0, list(range(6)) + [14, 15]), [NAN] * 8)  # not its blocks
    # 3 (slot, head) blocks x 2 tokens x K and V, then the active token's K and V in 2 heads
    assert kv.tally.take().h2d_bytes == (12 + 4) * 4


def test_slab_kv_carries_a_slab_to_another_table():
    kv = make_kv()
    seq = with_working_set(make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5))
    kv.load_slab(seq, 5)
    slots = kv.slab_kv(seq)  # [L, K, 2, Hkv, B, d]
    assert slots.shape == (1, 2, 2, 2, 2, 1)
    assert slots[0, 0, 0, 0, :, 0].tolist() == [2, 3]  # slot 0, K, head 0: block 1
    assert slots[0, 1, 1, 1, :, 0].tolist() == [1102, 1103]  # slot 1, V, head 1: block 1
    other = with_working_set(make_seq([0, 1, 2, 7], [0, 1, 2, 3], pos=5))
    kv.tally.take()
    kv.load_slab(other, 5, slots)
    for which in (0, 1):
        for head in (0, 1):
            assert device(kv, which, head, list(range(6))) == device(kv, which, head,
                                                                      list(range(6, 12)))
    assert kv.tally.take().h2d_bytes == (16 + 4) * 4  # the whole working slots, the active


def test_a_committed_token_completing_its_block_fills_it():
    """k, v of position 5 (7, 8 / 9, 10 in heads 0, 1) complete block 2: it goes to the
    host, gets its summary (min, max of keys 4, 7 and 104, 8), and enters both heads' working
    sets: head 0's empty slot 1, head 1's least recently used slot (1, last used 3 < 5)."""
    kv = make_kv()
    seq = with_working_set(make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5))
    kv.load_slab(seq, 5)
    kv.commit_token(seq, 5, torch.tensor([[[7.0], [8.0]]]), torch.tensor([[[9.0], [10.0]]]))
    assert kv.host_kv[0, 0, :, 4:6, 0].tolist() == [[4, 7], [104, 8]]
    assert kv.host_kv[0, 1, :, 4:6, 0].tolist() == [[1004, 9], [1104, 10]]
    assert kv.kmin[0, 2, :, 0].tolist() == [4, 8] and kv.kmax[0, 2, :, 0].tolist() == [7, 104]
    assert seq.working_set.head_map.tolist() == [[[1, 0], [2, 2]]]
    assert device(kv, 0, 0, [6, 7, 8, 9]) == [2, 3, 4, 7]  # head 0: block 1, block 2
    assert device(kv, 0, 1, [6, 7, 8, 9]) == [100, 101, 104, 8]  # head 1: block 0, block 2
    assert device(kv, 1, 1, [8, 9]) == [1104, 10]
    assert kv.counters.h2d_bytes == 64 and kv.counters.d2h_bytes == 8 * 4  # the block, K+V


def test_a_token_committed_without_a_working_set_goes_to_the_host_only():
    kv = make_kv()
    seq = make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5)  # dropped: reloads at its next step
    kv.commit_token(seq, 5, torch.tensor([[[7.0], [8.0]]]), torch.tensor([[[9.0], [10.0]]]))
    assert kv.host_kv[0, 0, :, 5, 0].tolist() == [7, 8]
    assert kv.kmin[0, 2, :, 0].tolist() == [4, 8]  # the completed block's summary, from there
    assert torch.isnan(kv.device_kv).all()


def test_host_block_without_a_remote_store_is_the_host_table():
    assert make_kv().host_block(make_seq([3, 4, 5, 6], [7, 1, 2], pos=0), 0) == 7
