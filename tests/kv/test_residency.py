"""SparseKV's step boundaries (`kv/residency.py`) on the hand-checkable SparseKV of
`sparse_units` (one layer, 2 KV heads, d = 1, blocks of 2 tokens, K = 2; slab blocks 3, 4,
5 (active), 6 (draft); host key of head h at token slot t: 100*h + t, value 1000 + that):
what a step records of each decode, the batch's tensors, the write-through and fills at its
end, a failed step's reload, and release waiting only for the jobs that touch a request."""

import torch
from sparse_units import make_kv, make_seq

from oasiskv.context import SeqAttention

PER_TOKEN = 2 * 2 * 1 * 4  # K and V, 2 heads, d = 1, float32


def begin(kv, *seqs):
    kv.begin_step([(s, SeqAttention(i, i + 1, 6, 6, None)) for i, s in enumerate(seqs)])


def test_a_first_step_loads_an_empty_working_set_and_the_active_tokens():
    kv = make_kv()
    seq = make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5)
    begin(kv, seq)
    ws = seq.working_set
    assert kv.step == 1 and (ws.head_map == -1).all() and ws.head_map.shape == (1, 2, 2)
    assert ws.seeded == [False] and ws.primed == [False]
    [d] = kv._decodes
    assert (d.pos, d.summary_ids.tolist(), d.slab_tokens.tolist(), d.summary_start) == (
        5, [0, 1], [6, 8, 10], 0)
    assert kv.device_kv[0, :, :, 10, 0].tolist() == [[4, 104], [1004, 1104]]  # position 4


def test_summary_ids_apart_are_no_run():
    kv = make_kv()
    begin(kv, make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5, summary_ids=[4, 1, 2, 3]))
    assert kv._decodes[0].summary_start is None


def test_batch_tensors_pad_and_are_built_once_a_step():
    kv = make_kv(device_blocks=12)
    begin(kv, make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5),
          make_seq([7, 8, 9, 10], [6, 7], pos=3, summary_ids=[7, 0]))
    ids, lengths, slabs = kv.batch_tensors(kv._decodes)
    assert ids.tolist() == [[0, 1], [7, 0]] and lengths.tolist() == [2, 1]
    assert slabs.tolist() == [[6, 8, 10], [14, 16, 18]]
    assert kv.batch_tensors(kv._decodes)[0] is ids


def test_the_step_end_writes_the_token_through_or_fills_its_block():
    """Position 4 does not complete its block: its K/V (device token 10) go to host token 4.
    Position 5 completes block 2: the block (device tokens 10, 11) fills host block 2."""
    kv = make_kv()
    seq = make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=4)
    begin(kv, seq)
    kv.device_kv[0, :, :, 10, 0] = torch.tensor([[40.0, 41.0], [42.0, 43.0]])  # the runner's
    kv.end_step()
    assert kv.host_kv[0, :, :, 4, 0].tolist() == [[40, 41], [42, 43]]
    assert kv.last_step.d2h_bytes == PER_TOKEN and kv._decodes == []

    seq.num_computed_tokens = 5
    begin(kv, seq)
    kv.device_kv[0, 0, :, 11, 0] = torch.tensor([50.0, 51.0])
    kv.end_step()
    assert kv.host_kv[0, 0, :, 4:6, 0].tolist() == [[40, 50], [41, 51]]
    assert kv.kmin[0, 2, :, 0].tolist() == [40, 41] and kv.kmax[0, 2, :, 0].tolist() == [50, 51]
    assert (seq.working_set.head_map[0] == 2).sum(0).tolist() == [1, 1]  # in every head's set
    assert kv.last_step.d2h_bytes == 2 * PER_TOKEN
    assert kv.counters.d2h_bytes == 3 * PER_TOKEN


def test_a_step_that_never_ended_reloads_its_working_sets():
    kv = make_kv()
    seq = make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=5)
    begin(kv, seq)
    seq.working_set.head_map[0, 0, 0] = 1
    first = seq.working_set
    begin(kv, seq)  # the previous step failed: its jobs' work is not to be trusted
    assert kv.step == 2 and seq.working_set is not first
    assert (seq.working_set.head_map == -1).all()


def test_release_waits_only_for_jobs_touching_the_request():
    kv = make_kv()
    mine, other = make_seq([3, 4, 5, 6], [0, 1], pos=0), make_seq([0, 1, 2, 7], [2, 3], pos=0)
    kv.pipeline.submit([0], "step 1", [("fill", lambda: kv._count(hits=3))], [mine])
    kv.release(other)
    assert kv.counters.hits == 0  # not flushed: its job still counts as pending
    kv.release(mine)
    assert kv.counters.hits == 3 and not kv.pipeline.touches(mine)
