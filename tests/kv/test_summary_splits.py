"""summary_splits (issue 41, finer summaries): S min/max summaries per block, one per B/S-token
sub-block; a block scores the largest of its sub-blocks' bounds. Against brute force: that
score is the largest sub-block's Quest bound, an upper bound on the block's true q.k and at
most the whole-block bound; with K covering every block, decoding equals dense; the device
budget pays (S-1) more summaries per block, counted by hand."""

from types import SimpleNamespace

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.config import CacheConfig
from oasiskv.kv.scorers import QuestBound, requests_view
from oasiskv.kv.select import aggregated_scores, block_scores
from oasiskv.kv.summaries import round_outward, summarize, summary_rows

B, D, HKV, GROUP = 16, 8, 2, 3


def quest_bound(q: torch.Tensor, keys: torch.Tensor) -> float:
    """Quest's bound of one query head q [d] over some keys [t, d], by hand: per channel the
    larger of q * min and q * max, summed."""
    lo, hi = keys.double().amin(0), keys.double().amax(0)
    return float(torch.maximum(q.double() * lo, q.double() * hi).sum())


def brute_force_split_scores(q: torch.Tensor, keys: torch.Tensor, splits: int) -> torch.Tensor:
    """q [H, d], keys [Hkv, n, B, d] -> [Hkv, n]: per block, the largest over its sub-blocks of
    the group's summed Quest bounds (score_aggregation=sum), one Python loop per value."""
    hkv, n = keys.shape[:2]
    group, t = q.shape[0] // hkv, B // splits
    out = torch.zeros(hkv, n, dtype=torch.float64)
    for g in range(hkv):
        for b in range(n):
            out[g, b] = max(sum(quest_bound(q[h], keys[g, b, s * t:(s + 1) * t])
                                for h in range(g * group, (g + 1) * group))
                            for s in range(splits))
    return out


@pytest.mark.parametrize("splits", [1, 2, 4, 16])
def test_split_scores_are_the_largest_sub_block_bound_and_tighter(splits):
    torch.manual_seed(splits)
    n = 6
    keys = torch.randn(HKV, n, B, D) * torch.linspace(0.2, 3, D)  # channels of unequal scale
    q = torch.randn(HKV * GROUP, D)
    kmin, kmax = summarize(keys, splits)
    assert kmin.shape == (n * splits, HKV, D)
    got = block_scores(q, kmin, kmax, splits=splits)  # [Hkv, n]
    torch.testing.assert_close(got.double(), brute_force_split_scores(q, keys, splits),
                               rtol=1e-5, atol=1e-5)
    # an upper bound on every token's q.k (summed over the group), at most the block's bound
    true = torch.einsum("ghd,gnbd->gnb", q.view(HKV, GROUP, D), keys).amax(-1)  # [Hkv, n]
    assert (got >= true - 1e-4).all()
    whole = block_scores(q, *summarize(keys))
    assert (got <= whole + 1e-4).all()
    if splits == B:  # one token per sub-block: the bound is the true largest q.k
        torch.testing.assert_close(got, true, rtol=1e-5, atol=1e-5)
    if splits == 4:
        assert (got < whole - 1e-3).any()  # tighter somewhere (random keys: almost surely)


@pytest.mark.parametrize("aggregation", ["softmax-sum", "softmax-max"])
def test_split_aggregated_scores_take_each_heads_largest_sub_block_before_the_softmax(
        aggregation):
    """The batched path: two requests' rows side by side in one bf16 pool (a strided view, as
    `QuestBound` scores a batch), each query head's block bound the largest of its sub-blocks',
    softmaxed over the request's own blocks, combined over the group."""
    torch.manual_seed(7)
    splits, n, stride, scale = 2, 5, 7, D ** -0.5
    lengths = [5, 3]
    keys = torch.randn(2 * stride, HKV, B, D)  # [ids, Hkv, B, d]
    lo, hi = round_outward(*summarize(keys.transpose(0, 1)[None], splits), torch.bfloat16)
    views = [requests_view(x, 2, n * splits, stride * splits, 0) for x in (lo, hi)]
    q = torch.randn(1, 2, HKV * GROUP, D) * 3
    past = torch.arange(n)[None] >= torch.tensor(lengths)[:, None]
    got = aggregated_scores(q, *views, past, torch.tensor([[scale]]), aggregation,
                            splits=splits)[0]  # [R, Hkv, n]
    for r, m in enumerate(lengths):
        ids = torch.arange(m) + r * stride
        rows = summary_rows(ids, splits)
        kmin, kmax = lo[0, rows].double(), hi[0, rows].double()  # [m*S, Hkv, d]
        for g in range(HKV):
            heads = []
            for h in range(g * GROUP, (g + 1) * GROUP):
                qh = q[0, r, h].double()
                sub = torch.maximum(qh * kmin[:, g], qh * kmax[:, g]).sum(-1)  # [m*S]
                heads.append(torch.softmax(sub.view(m, splits).amax(-1) * scale, 0))
            stacked = torch.stack(heads)
            want = stacked.sum(0) if aggregation == "softmax-sum" else stacked.amax(0)
            torch.testing.assert_close(got[r, g, :m].exp().double(), want, rtol=1e-4,
                                       atol=1e-6)
        assert (got[r, :, m:] == float("-inf")).all()


@pytest.mark.parametrize("aggregation", ["sum", "softmax-sum"])
@pytest.mark.parametrize("layout", ["side by side", "one run each", "scattered"])
def test_quest_bound_scores_each_requests_own_sub_blocks(aggregation, layout):
    """`scorers.QuestBound` over a pool of S rows per summary id, for the three ways a
    batch's summaries lie (one strided view from a run not at id 0, a run per request, ids
    gathered one by one) equals each request's rows scored alone (summary_rows by hand)."""
    torch.manual_seed(11)
    splits, layers, hkv, d, ids_total = 2, 2, HKV, D, 40
    pool = [torch.randn(layers, ids_total * splits, hkv, d) for _ in range(2)]
    kmin, kmax = torch.minimum(*pool), torch.maximum(*pool)
    lengths = [5, 3, 4]
    starts = {"side by side": [3, 10, 17], "one run each": [20, 2, 11],
              "scattered": [None] * 3}[layout]
    picks = []
    for r, (m, start) in enumerate(zip(lengths, starts, strict=True)):
        ids = (torch.arange(m) + start if start is not None
               else torch.randperm(ids_total)[:m] if r else torch.tensor([30, 1, 7, 25, 12]))
        d_ = SimpleNamespace(summary_ids=ids, summary_start=start)
        picks.append((d_, torch.randn(layers, hkv * GROUP, d) * 2))
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)  # the job's padded ids
    for r, (d_, _) in enumerate(picks):
        ids[r, :len(d_.summary_ids)] = d_.summary_ids
    job = SimpleNamespace(layers=[0, 1], run=slice(0, 2), picks=picks,
                          lengths=torch.tensor(lengths), ids=ids,
                          scales=torch.tensor([0.3, 0.5]))
    job.kv = SimpleNamespace(
        kmin=kmin, kmax=kmax, scales=[0.3, 0.5],
        cfg=SimpleNamespace(summary_splits=splits, score_alpha=1.0,
                            score_aggregation=aggregation))
    n = max(lengths)
    if layout == "side by side":
        assert QuestBound.stride(job, n, ids_total) == 7
    got = QuestBound().score(job, None)  # [layers, R, Hkv, n]
    for r, (d_, q) in enumerate(picks):
        rows = summary_rows(d_.summary_ids, splits)
        m = len(d_.summary_ids)
        for layer in range(layers):
            lo, hi = kmin[layer, rows], kmax[layer, rows]
            if aggregation == "sum":
                want = block_scores(q[layer], lo, hi, splits=splits)
            else:
                want = aggregated_scores(q[layer], lo, hi, torch.zeros(m, dtype=torch.bool),
                                         torch.tensor(job.kv.scales[layer]), aggregation,
                                         splits=splits)
            torch.testing.assert_close(got[layer, r, :, :m], want, rtol=1e-5, atol=1e-5)
            assert (got[layer, r, :, m:] == float("-inf")).all()


@pytest.mark.parametrize("bad", [0, 3, 6, 32, -2])
def test_bad_splits_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=rf"summary_splits must be a power of two from 1 to "
                                         rf"block_size \(16\), got {bad}"):
        CacheConfig(summary_splits=bad)
    with pytest.raises(ValueError, match="predictor=oracle has none"):
        CacheConfig(summary_splits=2, predictor="oracle")
    assert CacheConfig(summary_splits=8, block_size=8).summary_splits == 8


# ---------------------------------------------------------------- engine


def test_engine_summaries_are_each_sub_blocks_min_and_max(tiny_llama):
    """Every complete block's S rows bound exactly its sub-blocks' host keys (float32
    summaries: no rounding), after prefill and after blocks that decode completes."""
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=2, summary_splits=4,
              summary_dtype="float32", rerank=0)  # selections that read the summaries
    sp, seen = llm.engine.sparse, []

    def check(batch):
        for seq, _ in batch:
            for b in range(seq.num_computed_tokens // B):
                host = seq.host_table[b]
                rows = summary_rows(torch.tensor([seq.summary_ids[b]]), 4)
                keys = sp.host_kv[:, 0, :, host * B:(host + 1) * B]  # [L, Hkv, B, d]
                sub = keys.unflatten(2, (4, 4))  # [L, Hkv, S, B/S, d]
                seen.append(torch.equal(sp.kmin[:, rows], sub.amin(3).transpose(1, 2))
                            and torch.equal(sp.kmax[:, rows], sub.amax(3).transpose(1, 2)))

    llm.engine.step_hooks.append(check)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([list(range(1, 90)), list(range(5, 60))], params, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    assert len(seen) > 100 and all(seen)
    llm.close()


@pytest.mark.parametrize("splits", [2, 4])
def test_each_split_is_charged_to_the_device_budget(tiny_llama, splits):
    """One summary (kmin and kmax, bf16 for fp32 K/V) of a block: 2 x 2 layers x 2 KV heads
    x 16 dims x 2 B = 256 B; S splits charge S of them per block, (S-1) x 256 more, and
    the summary tensors are exactly what the budget counts, within it."""
    one = 2 * 2 * 2 * 16 * 2
    kw = dict(kv_mode="sparse", top_k=2, device_kv_budget=256 * 1024, host_kv_budget=2**20,
              rerank=0)  # the summaries' bytes alone; with the copy below
    plain = LLM(str(tiny_llama), **kw)
    split = LLM(str(tiny_llama), **kw, summary_splits=splits)
    a, s = plain.stats(), split.stats()
    assert a["summary_bytes_per_block"] == one and "summary_splits" not in a
    assert s["summary_bytes_per_block"] == a["summary_bytes_per_block"] + (splits - 1) * one
    assert s["summary_splits"] == splits
    assert s["summary_minmax_bytes_per_block"] == splits * one
    kmin = split.engine.sparse.kmin
    assert kmin.shape[1] == s["summary_ids_total"] * splits
    assert 2 * kmin.numel() * kmin.element_size() == s["summary_ids_total"] * splits * one
    assert s["device_bytes_allocated"] <= s["device_kv_budget"]
    assert s["device_kv_budget"] - s["device_bytes_allocated"] < s["kv_bytes_per_block"]
    # the budget's split follows a whole-context request: fewer summaries (the 128 host
    # blocks need 128 x S x 256 B) and fewer KV blocks than with one summary per block
    assert s["kv_blocks_total"] <= a["kv_blocks_total"]
    copy = LLM(str(tiny_llama), **(kw | {"rerank": 2}), summary_splits=splits,
               rerank_source="int8")
    c = copy.stats()  # with the int8 key copy too: both charged per block
    assert c["summary_bytes_per_block"] == splits * one + c["key_copy_bytes_per_block"]
    for llm in (plain, split, copy):
        llm.close()
