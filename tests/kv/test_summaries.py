"""Block summaries in a coarser dtype stay bounds of their block's keys (rounded outward, at
most one step of that dtype away), so Quest's score stays an upper bound."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv.kv.select import block_scores
from oasiskv.kv.summaries import (
    dequantize_bounds,
    quantize_bounds,
    round_outward,
    summarize,
)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 30.0]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]))
def test_rounded_summaries_bound_every_key_within_one_step(seed, scale, dtype):
    keys = torch.randn(2, 5, 16, 8, generator=torch.Generator().manual_seed(seed)) * scale
    kmin, kmax = summarize(keys)  # [5, 2, 8]
    lo, hi = round_outward(kmin, kmax, dtype)
    assert lo.dtype == hi.dtype == dtype
    assert (lo.float() <= kmin).all() and (hi.float() >= kmax).all()
    # the nearest representable value on the right side: one step of the dtype at most
    step_lo = (lo.float() - torch.nextafter(lo, lo.new_tensor(-torch.inf)).float()).abs()
    step_hi = (torch.nextafter(hi, hi.new_tensor(torch.inf)).float() - hi.float()).abs()
    assert (kmin - lo.float() <= step_lo).all() and (hi.float() - kmax <= step_hi).all()
    # Quest's score over the rounded summary still bounds every key's q.k
    q = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed + 1))  # 2 heads / KV head
    scores = block_scores(q, lo, hi)  # [Hkv, n]
    exact = torch.einsum("hd,gnbd->hgnb", q, keys).amax(-1)  # [H, Hkv, n]
    for g in range(2):
        assert (scores[g] >= exact[2 * g:2 * g + 2, g].sum(0) - 1e-4).all()


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-30, 1e-3, 1.0, 300.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_int8_summaries_bound_every_key_within_two_codes(seed, scale, dtype):
    """handoff_summaries=int8: codes and one scale per (row, KV head) that still bound the
    block's keys, at most two codes (of that row's scale) outside them."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 6, 16, 64, generator=g) * scale
    keys[:, 1, :, 5] *= 40  # an outlier channel, as real keys have
    keys[:, 2] = 0  # an all-zero block
    kmin, kmax = (t.to(dtype) for t in summarize(keys))  # [6, 3, 64]
    lo, hi, scales = quantize_bounds(kmin, kmax)
    assert lo.dtype == hi.dtype == torch.int8 and scales.shape == (6, 3)
    qlo, qhi = dequantize_bounds(lo, hi, scales)
    assert (qlo <= kmin.float()).all() and (qhi >= kmax.float()).all()
    assert (kmin.float() - qlo <= 2 * scales[..., None]).all()
    assert (qhi - kmax.float() <= 2 * scales[..., None]).all()
    assert torch.equal(qlo[2], torch.zeros_like(qlo[2])) and torch.equal(qhi[2], qlo[2])
    # into a summary dtype, outward again: still bounds
    blo, bhi = round_outward(qlo, qhi, torch.bfloat16)
    assert (blo.float() <= kmin.float()).all() and (bhi.float() >= kmax.float()).all()


def test_same_dtype_is_exact():
    keys = torch.randn(2, 3, 16, 4)
    kmin, kmax = summarize(keys)
    lo, hi = round_outward(kmin, kmax, torch.float32)
    assert torch.equal(lo, kmin) and torch.equal(hi, kmax)


@pytest.mark.parametrize(("kv_dtype", "want"), [(torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, torch.float16)])
def test_auto_summaries_are_bfloat16_for_float32_kv_else_the_kv_dtype(kv_dtype, want):
    from oasiskv.config import CacheConfig

    assert CacheConfig().summary_torch_dtype(kv_dtype) == want
    assert CacheConfig(summary_dtype="float32").summary_torch_dtype(kv_dtype) == torch.float32


def test_engine_default_keeps_bfloat16_summaries_of_float32_kv(tiny_llama):
    from oasiskv import LLM

    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=2)
    assert llm.engine.config.dtype == "float32" and llm.engine.sparse.kmin.dtype == torch.bfloat16
    llm.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_engine_stores_rounded_summaries_and_pays_half_their_device_bytes(tiny_llama, dtype):
    from oasiskv import LLM, SamplingParams

    kw = dict(kv_mode="sparse", top_k=2, device_kv_budget="4MiB", host_kv_budget="4MiB",
              rerank=0)  # the summaries' bytes alone
    llm = LLM(str(tiny_llama), summary_dtype=dtype, **kw)
    full = LLM(str(tiny_llama), summary_dtype="float32", **kw)
    half, whole = llm.stats(), full.stats()
    # a block's kmin and kmax in every layer: 2 x 2 layers x 2 KV heads x 16 dims
    assert whole["summary_bytes_per_block"] == 2 * 2 * 2 * 16 * 4
    assert half["summary_bytes_per_block"] == 2 * 2 * 2 * 16 * 2
    for engine, s in ((llm.engine, half), (full.engine, whole)):
        summaries = engine.sparse.kmin.numel() * engine.sparse.kmin.element_size() * 2
        assert summaries == s["summary_ids_total"] * s["summary_bytes_per_block"]
        assert s["device_bytes_allocated"] <= 4 * 2**20
    sp, B = llm.engine.sparse, 16
    assert sp.kmin.dtype == sp.kmax.dtype == getattr(torch, dtype)
    seen = []

    def check(batch):  # summaries of every complete block bound its keys on the host
        for seq, _ in batch:
            for b in range(seq.num_computed_tokens // B):
                host = seq.host_table[b]
                keys = sp.host_kv[:, 0, :, host * B:(host + 1) * B]  # [L, Hkv, B, d]
                seen.append(bool((sp.kmin[:, host].float() <= keys.amin(2)).all()
                                 and (sp.kmax[:, host].float() >= keys.amax(2)).all()))

    llm.engine.step_hooks.append(check)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([list(range(1, 90)), list(range(5, 60))], params, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    assert seen and all(seen)
    llm.close()
    full.close()


@pytest.mark.parametrize("bits", [8, 4])
def test_after_the_key_copy_warm_up_no_prompt_compiles_anew(bits):
    """warm_up_key_copy compiles the key copy's quantization for every prompt a prefill
    passes (a run of host slots read in place, or gathered slots; any block count), so no
    first token waits for a compile; and the fused pass equals the eager one."""
    from torch._dynamo.utils import counters

    from oasiskv.kv.summaries import _quantize, quantize_keys, warm_up_key_copy

    L, hkv, B, d = 3, 2, 16, 8
    host_kv = torch.randn(L, 2, hkv, 100 * B, d, dtype=torch.bfloat16)
    warm_up_key_copy(host_kv, B, bits)
    compiled = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for start, n in [(0, 7), (10, 40), (3, 2), (0, 99)]:
            run = host_kv[:, 0, :, start * B:(start + n) * B]  # [L, Hkv, n*B, d]
            gathered = host_kv[:, 0][:, :, torch.randperm(100 * B)[:n * B]]
            for keys in (run, gathered):
                keys = keys.unflatten(2, (n, B))
                codes, scales = quantize_keys(keys, bits)
                want_codes, want_scales = _quantize(keys, bits)
                assert torch.equal(codes, want_codes) and torch.equal(scales, want_scales)
    assert counters["stats"]["unique_graphs"] == compiled
