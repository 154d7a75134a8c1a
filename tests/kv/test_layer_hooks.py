"""Attention's per-layer hooks (`kv/layer_hooks.py`) on the hand-checkable SparseKV of
`sparse_units` (one layer, 2 KV heads and 2 query heads, d = 1, blocks of 2 tokens, K = 2;
host key of head h at token slot t: 100*h + t): the masks, a critical-path selection, the
next step's prediction handed on, a failed job."""

import pytest
import torch
from sparse_units import make_kv, make_seq

from oasiskv.context import SeqAttention
from oasiskv.kv import select
from oasiskv.kv.working_set import WorkingSet
from oasiskv.prefetch.executor import PrefetchError


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setattr(select.weighted_scores, "_run", select.weighted_scores.eager)


def decode_with(kv, pos: int, attn: SeqAttention, head_map=None):
    seq = make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=pos)
    if head_map is not None:
        seq.working_set = WorkingSet(torch.tensor(head_map), torch.zeros(1, 2, 2, dtype=torch.long),
                                     [True], [True])
    kv._decodes = [kv._decode(seq, attn, pos)]
    return seq


def test_masks_are_the_held_slots_and_the_active_block_so_far():
    """head 0 holds a block in slot 0 only, head 1 in both; position 4 is the active block's
    first token."""
    kv = make_kv(predictor="previous")
    attn = SeqAttention(0, 1, 6, 6, None)
    decode_with(kv, 4, attn, [[[1, 0], [-1, 1]]])
    kv.prepare_layer(0, torch.ones(1, 2, 1))
    assert attn.kv_valid.tolist() == [[True, True, False, False, True, False],
                                      [True, True, True, True, True, False]]


def test_exact_selects_each_heads_top_k_before_attention():
    """Summaries kmin = kmax = one key per block and head: head 0's blocks score 1, 5, 3,
    head 1's 9, 0, 4 (q = 1): head 0 holds blocks 1 and 2, head 1 blocks 0 and 2, copied from
    the host into its slots."""
    kv = make_kv(predictor="exact")
    for block, keys in enumerate([(1, 9), (5, 0), (3, 4)]):
        kv.kmin[0, block, :, 0] = kv.kmax[0, block, :, 0] = torch.tensor(keys, dtype=torch.float)
    seq = make_seq([3, 4, 5, 6], [0, 1, 2, 3], pos=6)
    attn = SeqAttention(0, 1, 6, 6, None)
    kv.begin_step([(seq, attn)])  # first step: an empty working set
    kv.tally.take()
    kv.prepare_layer(0, torch.ones(1, 2, 1))
    held = seq.working_set.head_map[0]  # [K, Hkv]
    assert sorted(held[:, 0].tolist()) == [1, 2] and sorted(held[:, 1].tolist()) == [0, 2]
    for slot, start in enumerate((6, 8)):  # device blocks 3 and 4
        for head in (0, 1):
            block = int(held[slot, head])
            got = kv.device_kv[0, 0, head, start:start + 2, 0].tolist()
            assert got == [100 * head + 2 * block, 100 * head + 2 * block + 1]
    counts = kv.tally.take()
    assert (counts.predicted, counts.hits, counts.wanted, counts.admitted) == (4, 0, 4, 4)
    assert counts.h2d_bytes == 4 * 2 * 2 * 4  # 4 block-heads, K and V of 2 tokens, fp32
    assert attn.kv_valid.tolist() == [[True] * 5 + [False]] * 2  # active block: token 6 only


@pytest.mark.parametrize("predictor, draft_rows, want", [
    ("previous", [2, 3], [1]),  # the step's own row
    ("lookahead", [2, 3], [2, 3]),  # the drafts' rows, their mean (equal weights)
    ("lookahead", [], [1]),  # no drafts this step
])
def test_after_attention_hands_on_the_predicting_query(predictor, draft_rows, want):
    kv = make_kv(predictor=predictor)
    attn = SeqAttention(1, 2, 6, 6, None, draft_rows=draft_rows)
    seq = decode_with(kv, 4, attn, [[[1, 0], [-1, 1]]])
    seq.working_set.primed = [False]
    q = torch.arange(8.0).view(4, 2, 1)
    kv.after_attention(0, q)
    [(layer, decodes, queries)] = kv._deferred  # sync: submitted at the step's end
    assert layer == 0 and decodes == kv._decodes and seq.working_set.primed == [True]
    torch.testing.assert_close(queries, q[want].mean(0, keepdim=True))


def test_requests_with_unequal_drafts_mix_their_own_rows():
    """Three requests in one batch: drafts on rows 1-3 weighted 0.5/0.3/0.2, none (its own
    row 4), two drafts on rows 6-7 with equal weights: each query is its own rows' weighted
    mean, as if each request were alone (hand-computed)."""
    kv = make_kv(predictor="lookahead")
    q = torch.arange(16.0).view(8, 2, 1)
    attns = [SeqAttention(0, 1, 6, 6, None, draft_rows=[1, 2, 3]),
             SeqAttention(4, 5, 6, 6, None, draft_rows=[]),
             SeqAttention(5, 6, 6, 6, None, draft_rows=[6, 7])]
    weights = [[0.5, 0.3, 0.2], None, None]
    decodes = []
    for attn, w in zip(attns, weights, strict=True):
        decode_with(kv, 4, attn, [[[1, 0], [-1, 1]]]).draft_weights = w
        decodes += kv._decodes
    kv._decodes = decodes
    kv.after_attention(0, q)
    [(_, _, queries)] = kv._deferred
    want = torch.stack([0.5 * q[1] + 0.3 * q[2] + 0.2 * q[3], q[4], (q[6] + q[7]) / 2])
    torch.testing.assert_close(queries, want)


def test_a_critical_path_predictor_hands_on_nothing():
    kv = make_kv(predictor="exact")
    decode_with(kv, 4, SeqAttention(0, 1, 6, 6, None), [[[1, 0], [-1, 1]]])
    kv.after_attention(0, torch.ones(1, 2, 1))
    assert kv._deferred == []


def test_a_failed_job_drops_the_working_sets_it_touched():
    kv = make_kv()
    seq = decode_with(kv, 4, SeqAttention(0, 1, 6, 6, None), [[[1, 0], [-1, 1]]])

    def boom():
        raise RuntimeError("fetch failed")

    kv.pipeline.submit([0], "step 1", [("local", boom)], [seq])
    with pytest.raises(PrefetchError):
        kv.wait_layer(0)
    assert seq.working_set is None
