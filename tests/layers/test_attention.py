"""Sparse decodes with equal slabs are attended in one batch: the result equals attending each
request alone (`_attend_with_drafts` / `_attend`), masks and drafts included."""

import pytest
import torch

from oasiskv.context import SeqAttention
from oasiskv.layers.attention import Attention

# slab starts: side by side (read in place), or three side by side and one apart (copied)
LAYOUTS = {"side by side": [7, 27, 47, 67], "one apart": [7, 27, 47, 120]}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("drafts", [0, 1, 2])
@pytest.mark.parametrize("draft_masks", ["own", "shared"])
def test_batched_slabs_equal_one_request_at_a_time(drafts, layout, draft_masks):
    """draft_masks: some requests' drafts have their own mask, or all see the normal one's."""
    g = torch.Generator().manual_seed(drafts)
    hkv, group, d, t, R = 2, 3, 8, 20, 4
    attn = Attention(hkv * group, hkv, d, d ** -0.5)
    pool = (torch.randn(hkv, 200, d, generator=g), torch.randn(hkv, 200, d, generator=g))
    attn.pools = {"device": pool}
    n = 1 + drafts
    q = torch.randn(R, n, hkv * group, d, generator=g)
    k_new = torch.randn(R, n, hkv, d, generator=g)
    v_new = torch.randn(R, n, hkv, d, generator=g)
    seqs = []
    for r in range(R):
        valid = torch.rand(hkv, t, generator=g) > 0.3
        valid[:, 0] = True  # every head sees something
        seq = SeqAttention(r, r + 1, t, LAYOUTS[layout][r], None, kv_valid=valid,
                           draft_rows=list(range(drafts)))
        if r % 2 and drafts and draft_masks == "own":
            seq.draft_valid = valid & (torch.rand(hkv, t, generator=g) > 0.5)
            seq.draft_valid[:, 0] = True
        seqs.append(seq)
    got = attn._attend_slabs(q, seqs, k_new, v_new).view(R, n, -1)
    for r, seq in enumerate(seqs):
        if drafts:
            want = attn._attend_with_drafts(q[r], seq, k_new[r], v_new[r])
        else:
            want = attn._attend(q[r], seq, k_new[r], v_new[r])
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)
