"""Block scoring options (issue 41) against brute-force references: GQA-aware aggregation of
per-query-head scores, and the int8 key copy the rerank stage can read; with K covering every
block each option decodes as dense does."""

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.kv.select import aggregated_scores, block_scores, rerank_by_mass
from oasiskv.kv.summaries import dequantize_keys, quantize_keys

# ---------------------------------------------------------------- GQA-aware aggregation


def brute_force_aggregation(q, kmin, kmax, n_real, scale, aggregation, alpha):
    """One request, one layer: q [H, d], kmin/kmax [n, Hkv, d] (only the first n_real blocks
    are the request's) -> [Hkv, n] probabilities combined over each group, 0 past n_real."""
    hkv = kmin.shape[1]
    group = q.shape[0] // hkv
    out = torch.zeros(hkv, kmin.shape[0], dtype=torch.float64)
    for g in range(hkv):
        per_head = []
        for h in range(g * group, (g + 1) * group):
            bounds = []
            for b in range(n_real):
                hi, lo = kmax[b, g].double(), kmin[b, g].double()
                c, r = (hi + lo) / 2, (hi - lo) / 2
                bounds.append(float(q[h].double() @ c + alpha * (q[h].double().abs() @ r)))
            per_head.append(torch.softmax(torch.tensor(bounds, dtype=torch.float64) * scale, 0))
        stacked = torch.stack(per_head)  # [G, n_real]
        out[g, :n_real] = stacked.sum(0) if aggregation == "softmax-sum" else stacked.amax(0)
    return out


@pytest.mark.parametrize("aggregation", ["softmax-sum", "softmax-max"])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_aggregated_scores_equal_a_per_head_loop(aggregation, alpha):
    """The batched path: bf16 summaries as a strided [layers, R, n, Hkv, d] view of one pool
    (requests side by side, each past its own blocks reading the next one's), per-layer scales;
    each request's probabilities over its own blocks only."""
    torch.manual_seed(3)
    layers, R, n, hkv, group, d, stride = 2, 3, 9, 3, 3, 8, 11
    lengths = torch.tensor([9, 4, 1])
    pool = [torch.randn(layers, R * stride, hkv, d).to(torch.bfloat16) for _ in range(2)]
    lo_all, hi_all = torch.minimum(*pool), torch.maximum(*pool)
    lo, hi = (p.as_strided((layers, R, n, hkv, d), (p.stride(0), stride * hkv * d, hkv * d, d,
                                                    1)) for p in (lo_all, hi_all))
    q = torch.randn(layers, R, hkv * group, d) * torch.tensor([4.0, 1, 0.5] * hkv)[:, None]
    scales = torch.tensor([d ** -0.5, 0.3])
    past = torch.arange(n)[None, :] >= lengths[:, None]
    got = aggregated_scores(q, lo, hi, past, scales[:, None], aggregation, alpha)
    assert got.shape == (layers, R, hkv, n)
    for layer in range(layers):
        for r in range(R):
            want = brute_force_aggregation(q[layer, r], lo[layer, r], hi[layer, r],
                                           int(lengths[r]), float(scales[layer]), aggregation,
                                           alpha)
            torch.testing.assert_close(got[layer, r].exp().double(), want, rtol=1e-4,
                                       atol=1e-6)
            assert (got[layer, r, :, int(lengths[r]):] == float("-inf")).all()


def test_one_loud_query_head_no_longer_outvotes_its_group():
    """Head 0 (norm 1000) prefers block 0; heads 1 and 2 (norm 4) prefer block 1, each about
    as sure of it (softmax at scale 0.5: 0.98) as head 0 is of block 0 (1.0). sum follows head
    0's raw bounds; softmax-sum counts each head's probability once and follows the two;
    softmax-max takes the surest head's (head 0)."""
    keys = torch.tensor([[[1.0, 0]], [[0.9, 2]]])  # [n=2, Hkv=1, d=2]: one key per block
    q = torch.tensor([[1000.0, -20], [0, 4], [0, 4]])  # [H=3, d]
    assert block_scores(q, keys, keys).argmax() == 0
    past, scale = torch.zeros(2, dtype=torch.bool), torch.tensor(0.5)
    got = {a: aggregated_scores(q, keys, keys, past, scale, a).exp()[0]
           for a in ("softmax-sum", "softmax-max")}
    torch.testing.assert_close(got["softmax-sum"], torch.tensor([
        1 + 2 * torch.sigmoid(torch.tensor(-4.0)), 2 * torch.sigmoid(torch.tensor(4.0))]))
    assert got["softmax-sum"].argmax() == 1 and got["softmax-max"].argmax() == 0


# ---------------------------------------------------------------- the key copy (int8, int4)


@pytest.mark.parametrize("bits", [8, 4])
def test_key_copies_and_their_scores_are_within_the_quantization_bound(bits):
    """Every key within half a step (scale / 2) of its code times the scale, the scale its
    block and head's largest |key| / 127 (int4: / 7); so each score q . k within
    scale / 2 * |q|_1."""
    torch.manual_seed(4)
    L, hkv, n, B, d = 2, 3, 5, 16, 8
    keys = torch.randn(L, hkv, n, B, d) * torch.rand(L, hkv, n, 1, 1) * 10
    keys[0, 1, 2] = 0  # an all-zero block: scale 0, codes 0, exact
    codes, scales = quantize_keys(keys, bits)
    if bits == 8:
        assert codes.dtype == torch.int8 and codes.shape == (L, n, hkv, d, B)
    else:  # two codes a byte
        assert codes.dtype == torch.uint8 and codes.shape == (L, n, hkv, d, B // 2)
    assert scales.shape == (L, n, hkv)
    top = 2 ** (bits - 1) - 1
    torch.testing.assert_close(scales, keys.abs().amax((-2, -1)).transpose(1, 2) / top)
    back = dequantize_keys(codes, scales).transpose(1, 2)  # [L, Hkv, n, B, d]
    step = scales.transpose(1, 2)[..., None, None]
    assert ((back - keys).abs() <= step / 2 * (1 + 1e-5)).all()
    assert (back[0, 1, 2] == 0).all()
    q = torch.randn(d) * 3
    err = (back @ q - keys @ q).abs()  # [L, Hkv, n, B]
    assert (err <= step[..., 0] / 2 * q.abs().sum() * (1 + 1e-5) + 1e-6).all()


def test_an_exact_int8_copy_reranks_as_the_float_keys_do():
    """Keys that int8 holds exactly (integers of at most 127 in magnitude, 127 in every
    block and head, times a power of two): the second stage's masses from the copy equal the
    float keys' and pick the same blocks."""
    torch.manual_seed(5)
    R, hkv, group, n, B, d, c = 2, 2, 3, 12, 16, 8, 6
    ints = torch.randint(-127, 128, (hkv, n, B, d)).float()
    ints[:, :, 0, 0] = 127  # each block and head reaches 127: its scale is 2**-3 exactly
    keys = ints / 8  # [Hkv, n, B, d], one history shared by the R requests
    codes, scales = quantize_keys(keys)  # [n, Hkv, d, B], [n, Hkv]
    assert (scales == 1 / 8).all()
    q = torch.randn(R, hkv * group, d)
    scores = torch.randn(R, hkv, n)  # the first stage's scores: any
    scores[1, :, 9:] = float("-inf")  # request 1 has 9 blocks

    def host(cand):  # [R, Hkv, c] -> [R, Hkv, c*B, d]
        return keys[torch.arange(hkv)[None, :, None], cand].flatten(2, 3)

    def int8(cand):
        heads = torch.arange(hkv)[None, :, None]
        return dequantize_keys(codes[cand, heads], scales[cand, heads]).flatten(2, 3)

    want = rerank_by_mass(scores, q, host, d ** -0.5, B, c)
    got = rerank_by_mass(scores, q, int8, d ** -0.5, B, c)
    assert torch.equal(got, want)
    assert torch.equal(got.topk(4).indices, want.topk(4).indices)


@pytest.mark.parametrize("bits", [8, 4])
def test_the_key_copy_is_charged_to_the_device_budget(tiny_llama, bits):
    """Its bytes sit beside each summary: fewer summaries and KV blocks for the same budget,
    every allocated byte within it."""
    kw = dict(kv_mode="sparse", top_k=2, device_kv_budget=256 * 1024, host_kv_budget=2**20)
    plain = LLM(str(tiny_llama), **kw, rerank=0).stats()
    copy = LLM(str(tiny_llama), **kw, rerank=2, rerank_source=f"int{bits}").stats()
    # layers x KV heads x (B x d codes of `bits` bits + a float32 scale)
    per_block = 2 * 2 * (16 * 16 * bits // 8 + 4)
    assert copy["key_copy_bytes_per_block"] == per_block
    assert copy["summary_bytes_per_block"] == plain["summary_bytes_per_block"] + per_block
    assert copy["key_copy_bytes"] == copy["summary_ids_total"] * per_block
    assert copy["device_bytes_allocated"] <= copy["device_kv_budget"]
    assert copy["summary_ids_total"] <= plain["summary_ids_total"]
    assert copy["kv_blocks_total"] <= plain["kv_blocks_total"]
    if bits == 8:  # this budget binds: the copy displaces summaries
        assert copy["summary_ids_total"] < plain["summary_ids_total"]


# ---------------------------------------------------------------- engine: equal to dense


def generate(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("options", [
    {"score_aggregation": "softmax-sum"},
    {"score_aggregation": "softmax-max", "prefetch": "async"},
    {"rerank": 2, "rerank_source": "int8"},
    {"rerank": 2, "rerank_source": "int4", "prefetch": "async"},
    {"rerank": float("inf"), "rerank_source": "int8"},
    {"summary_splits": 2},
    {"summary_splits": 2, "score_aggregation": "softmax-sum", "prefetch": "async"},
    {"summary_splits": 4, "predictor": "exact"},
])
def test_options_with_k_covering_every_block_equal_dense(tiny_llama, options):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    kw = dict(max_num_batched_tokens=48, max_num_seqs=4)
    dense = LLM(str(tiny_llama), **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, dense.engine.model_config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 30, 47, 90)]
    want = generate(dense, prompts, params)
    sparse = LLM(str(tiny_llama), kv_mode="sparse", top_k=16, **kw, **options)  # 256 > 120
    assert generate(sparse, prompts, params) == want
    stats = sparse.stats()
    assert stats["sparse_wanted"] == stats["sparse_admitted"] > 0
