"""Sparse decodes with equal slabs are attended in one batch: the result equals attending each
request alone (`_attend_with_drafts` / `_attend`), masks and drafts included."""

import pytest
import torch

from oasiskv.context import SeqAttention
from oasiskv.layers.attention import Attention, slab_groups

# window starts (a slab of 20 slots, then 4 draft slots): side by side (read in place), or
# three side by side and one apart (copied)
LAYOUTS = {"side by side": [7, 31, 55, 79], "one apart": [7, 31, 55, 120]}


def slab_batch(drafts: int, starts: list[int], g: torch.Generator, hkv: int = 2, group: int = 3,
               d: int = 8, t: int = 20, slots: int = 4):
    """An attention layer with random pools, the step's rows (q, k, v [R*n, heads, d], request
    r's normal row r*n and its drafts after it) and one sparse decode per slab start, whose
    drafts' K/V are written to the draft slots after its slab, as the runner does."""
    attn = Attention(hkv * group, hkv, d, d ** -0.5)
    attn.pools = {"device": (torch.randn(hkv, 200, d, generator=g),
                             torch.randn(hkv, 200, d, generator=g))}
    n, R = 1 + drafts, len(starts)
    q = torch.randn(R * n, hkv * group, d, generator=g)
    k, v = torch.randn(R * n, hkv, d, generator=g), torch.randn(R * n, hkv, d, generator=g)
    seqs = []
    for r, start in enumerate(starts):
        valid = torch.rand(hkv, t, generator=g) > 0.3
        valid[:, 0] = True  # every head sees something
        rows = list(range(r * n + 1, (r + 1) * n))
        seqs.append(SeqAttention(r * n, r * n + 1, t, start, None, kv_valid=valid,
                                 draft_rows=rows, draft_slots=slots))
        for pool, new in zip(attn.pools["device"], (k, v), strict=True):
            pool[:, start + t:start + t + drafts] = new[rows].transpose(0, 1)
    return attn, q, k, v, seqs


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("drafts", [0, 1, 2])
def test_batched_slabs_equal_one_request_at_a_time(drafts, layout):
    """The batch reads the drafts' K/V from the pool; the one-request reference
    (`_attend_with_drafts`) takes them from the step's rows."""
    attn, q, k, v, seqs = slab_batch(drafts, LAYOUTS[layout], torch.Generator().manual_seed(drafts))
    [group] = slab_groups(seqs, q.device)
    assert group.seqs == seqs and group.in_place == (layout == "side by side")
    got = attn._attend_slabs(q[group.rows], group).view(len(seqs), 1 + drafts, -1)
    for r, seq in enumerate(seqs):
        both = [seq.q_start, *seq.draft_rows]
        if drafts:
            want = attn._attend_with_drafts(q[both], seq, k[both], v[both])
        else:
            want = attn._attend(q[both], seq, k[both], v[both])
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)


def test_slab_groups_leave_out_what_the_batch_cannot_read():
    """Requests whose drafts have a mask of their own, or whose drafts' K/V are not in draft
    slots, are attended one at a time; a lone request is a batch of one."""
    attn, q, k, v, seqs = slab_batch(1, LAYOUTS["side by side"], torch.Generator().manual_seed(0),
                                     slots=2)
    seqs[1].draft_valid = seqs[1].kv_valid.clone()
    seqs[2].draft_slots = 0
    lone = SeqAttention(8, 9, 24, 150, None, kv_valid=torch.ones(2, 24, dtype=torch.bool))
    groups = slab_groups([*seqs, lone], q.device)
    assert [group.seqs for group in groups] == [[seqs[0], seqs[3]], [lone]]
    assert [group.in_place for group in groups] == [False, True]
    assert groups[0].rows.tolist() == [[0, 1], [6, 7]]
    # row 0 sees no draft slot, the draft only its own
    assert groups[0].hidden.squeeze(1).tolist() == [[True, True], [False, True]]
