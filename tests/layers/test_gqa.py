"""The grouped, copy-free decode attention (`layers/gqa.py`, through `GqaAttention.forward`: the
path decodes take without the compiled kernel) equals the previous implementation
(`ReferenceAttention`) and a brute-force float64 attention over expanded K/V: dense (one run,
several runs, gathered slots), sparse masks, draft rows, sparse slabs in one batch (side by
side or not), GQA groups of 1, 3 and 7, odd lengths, fp32 and bf16."""

import math

import pytest
import torch

from oasiskv.context import SeqAttention, StepContext, set_context
from oasiskv.layers.attention import Attention, GqaAttention
from oasiskv.layers.attention_ref import ReferenceAttention
from oasiskv.layers.gqa import side_by_side

D = 16  # head dim
SLOTS = 600  # pool slots
# the new path may round bf16 once where the reference rounds twice (runs' partial sums);
# two bf16 ulps at 1, nothing looser
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}


def layers(hkv: int, group: int, dtype: torch.dtype, g: torch.Generator):
    """The new layer and the reference over the same random pools."""
    pools = {"device": (torch.randn(hkv, SLOTS, D, generator=g).to(dtype),
                        torch.randn(hkv, SLOTS, D, generator=g).to(dtype))}
    new = GqaAttention(hkv * group, hkv, D, D ** -0.5)
    ref = ReferenceAttention(hkv * group, hkv, D, D ** -0.5)
    new.pools = ref.pools = pools
    new.layer_idx = ref.layer_idx = 0
    return new, ref


def run_both(new: Attention, ref: Attention, q, k, v, seqs: list[SeqAttention]):
    outs = []
    for layer in (new, ref):
        set_context(StepContext(seqs=seqs))  # slab groups are built per context
        try:
            outs.append(layer(q, k, v))
        finally:
            set_context(None)
    return outs


def brute(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          visible: torch.Tensor | None) -> torch.Tensor:
    """float64, each query head against its KV head's expanded copy: q [H, d], keys/values
    [Hkv, T, d], visible [Hkv, T] -> [H*d]."""
    h = q.shape[0]
    group = h // keys.shape[0]
    k = keys.double().repeat_interleave(group, 0)  # [H, T, d]
    s = torch.einsum("hd,htd->ht", q.double(), k) / math.sqrt(q.shape[1])
    if visible is not None:
        s = s.masked_fill(~visible.repeat_interleave(group, 0), float("-inf"))
    return torch.einsum("ht,htd->hd", s.softmax(-1),
                        values.double().repeat_interleave(group, 0)).flatten()


def layout(kind: str, t: int, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    """SeqAttention fields placing t token slots in the pool, and those slots in order."""
    if kind == "one run":
        return {"kv_start": 41}, torch.arange(41, 41 + t)
    if kind == "runs":  # three runs, out of order in the pool
        cuts = [0, t // 3, 2 * t // 3, t]
        firsts = [400, 17, 230]
        runs = [(f, b - a) for f, a, b in zip(firsts, cuts, cuts[1:], strict=False)]
        return {"kv_start": None, "kv_runs": runs}, torch.cat(
            [torch.arange(f, f + n) for f, n in runs])
    slots = torch.randperm(SLOTS, generator=g)[:t]  # gathered
    return {"kv_start": None, "kv_slots": slots}, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(2, 1), (3, 3), (1, 7), (2, 7)])
@pytest.mark.parametrize("kind", ["one run", "runs", "gathered"])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_equals_reference_and_brute_force(dtype, hkv, group, kind, masked, threads):
    g = torch.Generator().manual_seed(hkv * 10 + group)
    new, ref = layers(hkv, group, dtype, g)
    seqs, visible = [], []
    for r, t in enumerate([1, 7, 37, 173]):  # odd lengths, one request each, one query row
        fields, slots = layout(kind, t, g)
        valid = None
        if masked:
            valid = torch.rand(hkv, t, generator=g) > 0.4
            valid[:, -1] = True  # every head sees something
        seqs.append(SeqAttention(r, r + 1, t, kv_valid=valid, kv_slots=fields.pop("kv_slots",
                                 None), **fields))
        visible.append((slots, valid))
    q = torch.randn(len(seqs), hkv * group, D, generator=g).to(dtype)
    k, v = (torch.randn(len(seqs), hkv, D, generator=g).to(dtype) for _ in range(2))
    got, want = run_both(new, ref, q, k, v, seqs)
    torch.testing.assert_close(got, want, **TOL[dtype])
    kc, vc = new.pools["device"]
    for r, (slots, valid) in enumerate(visible):
        truth = brute(q[r].float(), kc[:, slots].float(), vc[:, slots].float(), valid)
        err = (got[r].double() - truth).abs().max()
        ref_err = (want[r].double() - truth).abs().max()
        assert err <= 2 * ref_err + (1e-5 if dtype == torch.float32 else 4e-3), (r, err, ref_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("kind", ["one run", "runs"])
@pytest.mark.parametrize("masks", ["none", "shared", "own"])
def test_draft_rows_equal_reference_and_brute_force(dtype, group, kind, masks, threads):
    """A request with 3 drafts attended one at a time: each draft sees the KV (under the drafts'
    mask) and its own K/V; the normal row sees the KV only."""
    hkv, t, m = 2, 45, 3
    g = torch.Generator().manual_seed(group)
    new, ref = layers(hkv, group, dtype, g)
    fields, slots = layout(kind, t, g)
    valid = draft_valid = None
    if masks != "none":
        valid = torch.rand(hkv, t, generator=g) > 0.4
        valid[:, 0] = True
    if masks == "own":
        draft_valid = torch.rand(hkv, t, generator=g) > 0.4
        draft_valid[:, 0] = True
    seq = SeqAttention(0, 1, t, kv_slots=None, kv_valid=valid, draft_rows=[1, 2, 3],
                       draft_valid=draft_valid, **fields)
    q = torch.randn(1 + m, hkv * group, D, generator=g).to(dtype)
    k, v = (torch.randn(1 + m, hkv, D, generator=g).to(dtype) for _ in range(2))
    got, want = run_both(new, ref, q, k, v, [seq])
    torch.testing.assert_close(got, want, **TOL[dtype])
    kc, vc = new.pools["device"]
    seen = draft_valid if draft_valid is not None else valid
    for row in range(1 + m):
        mask = valid if row == 0 else seen
        keys, values = kc[:, slots].float(), vc[:, slots].float()
        if mask is None:
            mask = torch.ones(hkv, t, dtype=torch.bool)
        if row:  # its own K/V as one more slot
            keys = torch.cat([keys, k[row, :, None].float()], 1)
            values = torch.cat([values, v[row, :, None].float()], 1)
            mask = torch.cat([mask, torch.ones(hkv, 1, dtype=torch.bool)], 1)
        truth = brute(q[row].float(), keys, values, mask)
        err = (got[row].double() - truth).abs().max()
        ref_err = (want[row].double() - truth).abs().max()
        assert err <= 2 * ref_err + (1e-5 if dtype == torch.float32 else 4e-3), (row, err)


# window starts of 4 requests (a slab of 37 slots, then 4 draft slots: windows of 41)
SLAB_LAYOUTS = {"side by side": [5, 46, 87, 128], "one apart": [5, 46, 87, 300],
                "pairs": [5, 46, 200, 241], "all apart": [5, 100, 200, 300], "alone": [77]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("drafts", [0, 1, 2])
@pytest.mark.parametrize("name", SLAB_LAYOUTS)
def test_slabs_equal_reference(dtype, group, drafts, name):
    """Sparse slabs attended in one batch, their drafts' K/V in the draft slots, as the runner
    leaves them; windows side by side are read in place, the rest chain by chain."""
    hkv, t, slots = 2, 37, 4
    g = torch.Generator().manual_seed(drafts * 10 + group)
    new, ref = layers(hkv, group, dtype, g)
    starts, n = SLAB_LAYOUTS[name], 1 + drafts
    q = torch.randn(len(starts) * n, hkv * group, D, generator=g).to(dtype)
    k, v = (torch.randn(len(starts) * n, hkv, D, generator=g).to(dtype) for _ in range(2))
    seqs = []
    for r, start in enumerate(starts):
        valid = torch.rand(hkv, t, generator=g) > 0.3
        valid[:, 0] = True
        rows = list(range(r * n + 1, (r + 1) * n))
        seqs.append(SeqAttention(r * n, r * n + 1, t, start, None, kv_valid=valid,
                                 draft_rows=rows, draft_slots=slots))
        for pool, rows_kv in zip(new.pools["device"], (k, v), strict=True):
            pool[:, start + t:start + t + drafts] = rows_kv[rows].transpose(0, 1)
    got, want = run_both(new, ref, q, k, v, seqs)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.float32:  # and the truth, row by row
        kc, vc = new.pools["device"]
        for r, (start, seq) in enumerate(zip(starts, seqs, strict=True)):
            for i in range(n):
                extra = torch.arange(start + t, start + t + i)[i - 1:]  # a draft: its own slot
                cols = torch.cat([torch.arange(start, start + t), extra])
                mask = torch.cat([seq.kv_valid, torch.ones(hkv, len(extra), dtype=torch.bool)],
                                 1)
                truth = brute(q[r * n + i], kc[:, cols], vc[:, cols], mask)
                torch.testing.assert_close(got[r * n + i].double(), truth, atol=1e-5, rtol=1e-5)


def test_side_by_side_chains():
    assert side_by_side([5, 46, 87, 128], 41) == [(0, 4)]
    assert side_by_side([5, 46, 87, 300], 41) == [(0, 3), (3, 1)]
    assert side_by_side([5, 46, 200, 241], 41) == [(0, 2), (2, 2)]
    assert side_by_side([5, 100], 41) == [(0, 1), (1, 1)]
    assert side_by_side([7], 41) == [(0, 1)]
