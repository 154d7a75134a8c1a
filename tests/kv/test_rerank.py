"""The batched second stage of rerank (`kv/rerank.rerank_layers`, what SelectJob runs)
against the reference: `select.rerank_by_mass` layer by layer over keys gathered and
dequantized one block at a time by indexing. Continuous random data (no ties); several
requests and layers, requests with fewer blocks than the candidates (-inf padding), the
requests' blocks scattered over the pool, float32 and bf16 host keys and the int8 and int4
copies, the copies scored by the CPU kernel (`kv/block_mass.py`) or the compiled path."""

import pytest
import torch
from vnni_tier import kernel_runs_vnni, tolerance

from oasiskv.kv import block_mass
from oasiskv.kv.rerank import candidate_mass, candidate_mass_codes, rerank_layers, warm_up_rerank
from oasiskv.kv.select import rerank_by_mass
from oasiskv.kv.summaries import dequantize_keys, quantize_keys

L, R, HKV, G, B, D, IDS, N, C, K = 3, 3, 2, 3, 16, 32, 90, 24, 12, 5


def case(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    host_kv = torch.randn(L, 2, HKV, IDS * B, D, generator=g).to(dtype)  # [L, 2, Hkv, slots, d]
    ids = torch.randperm(IDS, generator=g)[:R * N].view(R, N)  # [R, n] scattered summary ids
    q = torch.randn(L, R, HKV * G, D, generator=g) * 2
    scores = torch.randn(L, R, HKV, N, generator=g)
    scores[:, 1, :, 7:] = float("-inf")  # request 1 has 7 blocks (< C: -inf candidates)
    scores[:, 2, :, 20:] = float("-inf")
    scales = torch.tensor([D ** -0.5, 0.1, 0.3])
    return host_kv, ids, q, scores, scales


def reference(host_kv, ids, q, scores, scales, bits, c=C):
    """rerank_by_mass per layer over c candidates, keys indexed per (request, head,
    candidate): the host keys (bits 0) or the key copy of 8 or 4 bits, dequantized."""
    keys = host_kv[:, 0].unflatten(2, (-1, B))  # [L, Hkv, ids, B, d]
    codes, kscales = quantize_keys(keys, bits or 8)  # [L, ids, Hkv, d, B], [L, ids, Hkv]
    out = []
    for j in range(L):
        def keys_of(cand, j=j):  # [R, Hkv, c] -> [R, Hkv, c*B, d]
            blocks = ids.gather(1, cand.flatten(1)).view(cand.shape)  # summary ids
            heads = torch.arange(HKV)[None, :, None]
            if bits:
                return dequantize_keys(codes[j, blocks, heads],
                                       kscales[j, blocks, heads]).flatten(2, 3)
            return keys[j, heads, blocks].float().flatten(2, 3)  # fp32 products, as ours
        out.append(rerank_by_mass(scores[j], q[j], keys_of, float(scales[j]), B, c))
    return torch.stack(out), codes, kscales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("bits", "path"), [(0, "compiled"), (0, "eager"), *(
    (bits, path) for bits in (8, 4) for path in ("kernel", "compiled", "eager"))])
def test_batched_rerank_picks_the_references_blocks(dtype, bits, seed, path, monkeypatch):
    # the key copy's codes on the CPU: the kernel, or (OASISKV_RERANK=compiled) inductor's
    monkeypatch.setenv(block_mass.ENV, "kernel" if path == "kernel" else "compiled")
    if path == "eager":  # where torch.compile fails: the matmul form, not the unfused product
        for fn in (candidate_mass, candidate_mass_codes):
            monkeypatch.setattr(fn, "_run", fn.eager)
    host_kv, ids, q, scores, scales = case(dtype, seed)
    want, codes, kscales = reference(host_kv, ids, q, scores, scales, bits)
    with torch.inference_mode():
        if bits:
            got = rerank_layers(scores, q, scales, C, ids, codes, kscales)
        else:  # the host tier's keys as SelectJob passes them: a transposed view
            keys = host_kv[:, 0].unflatten(2, (-1, B)).transpose(1, 2)  # [L, ids, Hkv, B, d]
            got = rerank_layers(scores, q, scales, C, ids, keys)
    assert torch.equal(got == float("-inf"), want == float("-inf"))  # same candidates
    real = want > float("-inf")
    # the kernel's avx512vnni tier multiplies q rounded to int16 (tests/kv/test_block_mass.py)
    vnni = path == "kernel" and kernel_runs_vnni(codes, D)
    assert torch.allclose(got[real], want[real], **tolerance(vnni, 1e-4, 1e-6))
    # what the selection keeps: each head's top K (request 1 has only 7 blocks in all)
    k = torch.topk(want, K, dim=-1)
    assert torch.equal(torch.topk(got, K, dim=-1).indices.sort(-1).values,
                       k.indices.sort(-1).values)
    assert (k.values[:, 1] > float("-inf")).all()


@pytest.mark.parametrize("c", [N, N + 5])
@pytest.mark.parametrize(("bits", "path"), [(0, "compiled"), (8, "kernel"), (8, "compiled"),
                                            (4, "kernel")])
def test_candidates_past_the_blocks_score_every_real_block(bits, path, c, monkeypatch):
    """c >= n (rerank=inf): every block is a candidate, read in block order; the previous
    stage's scores only say which are real. Against the reference's top-n, whose candidates
    are every block in score order."""
    monkeypatch.setenv(block_mass.ENV, path)
    host_kv, ids, q, scores, scales = case(torch.float32, 0)
    flat = torch.zeros_like(scores).masked_fill_(scores == float("-inf"), float("-inf"))
    want, codes, kscales = reference(host_kv, ids, q, scores, scales, bits, c=N)
    keys = host_kv[:, 0].unflatten(2, (-1, B))  # [L, Hkv, ids, B, d]
    with torch.inference_mode():
        if bits:  # the scales laid out as the engine's (a take; a transposed view indexes)
            got = rerank_layers(flat, q, scales, c, ids, codes, kscales.contiguous())
        else:
            got = rerank_layers(flat, q, scales, c, ids, keys.transpose(1, 2))
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    real = want > float("-inf")
    vnni = path == "kernel" and kernel_runs_vnni(codes, D)
    assert torch.allclose(got[real], want[real], **tolerance(vnni, 1e-4, 1e-6))


def test_keys_whose_blocks_are_not_contiguous_are_a_clear_error():
    host_kv, ids, q, scores, scales = case(torch.float32, 0)
    keys = host_kv[:, 0].unflatten(2, (-1, B)).transpose(1, 2).transpose(3, 4)
    with pytest.raises(ValueError, match="must be contiguous"):
        rerank_layers(scores, q, scales, C, ids, keys)


@pytest.mark.parametrize("bits", [8, 4])
def test_after_the_warm_up_no_request_shape_compiles_anew(bits, monkeypatch):
    """warm_up_rerank compiles for every shape a step passes: any run of layers, any number
    of requests, any number of candidates (requests shorter than c*K blocks have fewer; a
    count equal to the query group's size, specialized, must not make it static)."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv(block_mass.ENV, "compiled")  # the kernel compiles nothing
    hkv, heads, layers = 3, 9, 4  # G = 3
    codes, kscales = quantize_keys(torch.randn(layers, hkv, 60, B, D), bits)
    warm_up_rerank(codes, heads)
    compiled = counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        for run, requests, n in [(1, 1, 3), (4, 3, 20), (2, 2, 7), (4, 1, 40)]:
            ids = torch.arange(requests * n).view(requests, n)
            rerank_layers(torch.randn(run, requests, hkv, n), torch.randn(run, requests, heads, D),
                          torch.ones(run), 30, ids, codes[:run], kscales[:run])
    assert counters["stats"]["unique_graphs"] == compiled
