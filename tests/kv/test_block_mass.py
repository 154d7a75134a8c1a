"""The rerank's CPU kernel over the key copy's codes (`kv/block_mass.py`,
`layers/csrc/block_mass.cpp`) against a float64 brute force written apart from `_mass`: per
query head one softmax over every real candidate's tokens, summed over each block's tokens and
the heads. Random codes and queries (no ties) on each instruction set this CPU runs; leading
shapes of one to three dims, counts of candidates that divide nothing, candidates that are not
real (a whole group of them too), G of 1, 3, 7 and 9, d of 64 and odd ones, B of 16 (one
AVX-512 vector), 8, 32 and 6 (scalar), int8 codes and 4-bit pairs. The avx512vnni tier
multiplies q rounded to int16 per head: against the brute force of that q (`int16_rounded`),
and within 1 % of q's own."""

import warnings

import pytest
import torch
from vnni_tier import VNNI_TOLERANCE, int16_rounded, kernel_runs_vnni, tolerance, vnni_runs

from oasiskv.kv import block_mass
from oasiskv.kv.rerank import _matmul_mass_codes, candidate_mass_codes, rerank_layers
from oasiskv.kv.summaries import quantize_keys, unpack_codes
from oasiskv.layers import decode_kernel


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setenv(block_mass.ENV, "kernel")


@pytest.fixture
def ext():
    e = block_mass.extension()
    assert e is not None, "the kernel builds and loads on this machine"
    return e


def brute_force(codes, rows, block_scale, q, real) -> torch.Tensor:
    """float64: logits [..., c, G, B]; per head a softmax over the real (candidate, token)
    pairs; each candidate's share summed over its tokens and the heads; -inf where not real."""
    keys = unpack_codes(codes[rows]).double()  # [..., c, d, B]
    logits = torch.einsum("...cdb,...gd->...cgb", keys, q.double())
    logits = logits * block_scale.double()[..., None, None]
    logits = logits.masked_fill(~real[..., None, None], float("-inf"))
    c, G, B = logits.shape[-3:]
    p = torch.softmax(logits.transpose(-3, -2).reshape(*logits.shape[:-3], G, c * B), -1)
    p = torch.nan_to_num(p)  # a group without a real candidate: 0/0
    mass = p.view(*logits.shape[:-3], G, c, B).sum((-1, -3))
    return mass.masked_fill(~real, float("-inf"))


def case(lead, c, G, d, B, bits, seed, pool_rows=300):
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        codes = torch.randint(-127, 128, (pool_rows, d, B), generator=g, dtype=torch.int8)
    else:
        codes = torch.randint(0, 256, (pool_rows, d, B // 2), generator=g, dtype=torch.uint8)
    rows = torch.randint(0, pool_rows, (*lead, c), generator=g)
    block_scale = torch.rand(*lead, c, generator=g) * 0.02 + 0.002
    q = torch.randn(*lead, G, d, generator=g)
    real = torch.rand(*lead, c, generator=g) > 0.25
    real.view(-1, c)[:, 0] = True  # every group has one at least (the rest: see below)
    return codes, rows, block_scale, q, real


def check(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-6)


SHAPES = [  # lead, c, G, d, B, bits
    ((5,), 13, 3, 64, 16, 8),
    ((2, 3, 2), 37, 1, 64, 16, 8),
    ((3, 2), 29, 7, 40, 16, 8),
    ((4,), 11, 9, 72, 16, 8),
    ((2, 2), 7, 3, 37, 16, 8),   # d odd: the last dim alone
    ((3,), 17, 3, 64, 8, 8),     # a narrower vector
    ((2, 3), 9, 3, 64, 32, 8),   # two vectors a row
    ((3,), 10, 3, 24, 6, 8),     # B no multiple of 4: scalar
    ((5,), 13, 3, 64, 16, 4),
    ((2, 3), 19, 7, 40, 16, 4),
    ((3,), 17, 1, 64, 8, 4),
    ((2,), 9, 3, 64, 32, 4),
    ((3,), 10, 3, 24, 6, 4),
    ((2,), 5, 3, 64, 4, 4),      # 4-bit, W = B = 4
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[0])) +
                         f" c{s[1]} G{s[2]} d{s[3]} B{s[4]} int{s[5]}")
def test_the_kernel_matches_the_brute_force_on_each_instruction_set(ext, shape, monkeypatch):
    codes, rows, block_scale, q, real = inputs = case(*shape, seed=sum(shape[1:]))
    want = brute_force(*inputs)
    for isa in ext.isas():
        monkeypatch.setattr(block_mass, "ISA", isa)
        got = block_mass.candidate_mass_codes(ext, *inputs)
        if vnni_runs(isa, codes, q.shape[-1]):
            # the same function of q rounded to int16 per head; within 1 % of q's own
            check(got, brute_force(codes, rows, block_scale, int16_rounded(q), real))
            torch.testing.assert_close(got.double(), want, **VNNI_TOLERANCE)
        else:
            check(got, want)
    # the eager reference agrees (its form of the same function)
    check(_matmul_mass_codes(*inputs), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_groups_without_a_real_candidate_are_all_minus_inf_on_any_threads(ext, threads):
    codes, rows, block_scale, q, real = case((4, 3), 21, 3, 64, 16, 8, seed=3)
    real[1, 2] = False
    real[3] = False
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = block_mass.candidate_mass_codes(ext, codes, rows, block_scale, q, real)
    finally:
        torch.set_num_threads(before)
    assert (got[1, 2] == float("-inf")).all() and (got[3] == float("-inf")).all()
    if kernel_runs_vnni(codes, q.shape[-1]):
        q = int16_rounded(q)
    check(got, brute_force(codes, rows, block_scale, q, real))


def test_the_instruction_sets_follow_the_cpu_flags(ext, cpu_flags):
    """avx512vnni is listed (first, as the best) exactly where the CPU has AVX-512 VNNI."""
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= cpu_flags
    want = (["avx512vnni"] if avx512 and "avx512_vnni" in cpu_flags else []) + (
        ["avx512"] if avx512 else []) + (["avx2"] if {"avx2", "fma"} <= cpu_flags else []) + [
        "base"]
    assert ext.isas() == want


def test_a_row_outside_the_pool_or_a_missing_instruction_set_is_an_error(ext, monkeypatch):
    codes, rows, block_scale, q, real = case((2,), 5, 3, 64, 16, 8, seed=4, pool_rows=10)
    rows[1, 3], real[1, 3] = 10, True
    with pytest.raises(RuntimeError, match="outside the pool"):
        block_mass.candidate_mass_codes(ext, codes, rows, block_scale, q, real)
    real[1, 3] = False  # not read: no error
    block_mass.candidate_mass_codes(ext, codes, rows, block_scale, q, real)
    monkeypatch.setattr(block_mass, "ISA", "sse1")
    with pytest.raises(RuntimeError, match="sse1 is not available"):
        block_mass.candidate_mass_codes(ext, codes, rows, block_scale, q, real)


def rerank_case(bits):
    """rerank_layers' inputs over a key copy: [layers 2, ids 40, Hkv 3, d 64, B 16]."""
    g = torch.Generator().manual_seed(bits)
    codes, kscales = quantize_keys(torch.randn(2, 3, 40, 16, 64, generator=g), bits)
    ids = torch.randperm(40, generator=g)[:36].view(2, 18)  # [R, n]
    scores = torch.randn(2, 2, 3, 18, generator=g)
    scores[:, 1, :, 5:] = float("-inf")  # request 1 has 5 blocks, fewer than c
    q = torch.randn(2, 2, 9, 64, generator=g)
    return scores, q, torch.tensor([0.125, 0.3]), 8, ids, codes, kscales


@pytest.mark.parametrize("bits", [8, 4])
def test_rerank_layers_through_the_kernel_equals_the_compiled_path(ext, bits, monkeypatch):
    args = rerank_case(bits)
    # the avx512vnni tier: q rounded to int16 (test_the_kernel_matches_the_brute_force...)
    vnni = kernel_runs_vnni(args[5], args[1].shape[-1])
    with torch.inference_mode():
        got = rerank_layers(*args)
        monkeypatch.setenv(block_mass.ENV, "compiled")
        want = rerank_layers(*args)
    assert torch.equal(got == float("-inf"), want == float("-inf"))
    torch.testing.assert_close(got, want, **tolerance(vnni, 1e-5, 1e-7))
    # the blocks a selection keeps (K = 4)
    assert torch.equal(got.topk(4).indices.sort().values, want.topk(4).indices.sort().values)


def test_falls_back_to_the_compiled_path_with_one_warning_when_it_cannot_build(tmp_path,
                                                                               monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error broken on purpose\n")
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(block_mass, "SOURCE", broken)
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    args = rerank_case(8)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="block-mass kernel could not be built"):
            got = rerank_layers(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once only
            again = rerank_layers(*args)
        monkeypatch.setenv(block_mass.ENV, "compiled")
        want = rerank_layers(*args)
    assert torch.equal(got, want) and torch.equal(again, want)


def test_the_environment_chooses_apart_from_the_attention_kernel(monkeypatch):
    monkeypatch.setenv(decode_kernel.ENV, "gqa")  # the attention's choice does not switch it
    assert block_mass.extension() is not None
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    monkeypatch.setenv(block_mass.ENV, "compiled")
    assert block_mass.extension() is None and decode_kernel._loaded == {}  # nothing built
    codes = torch.zeros(4, 64, 16, dtype=torch.int8)
    assert block_mass.serves(codes) is None
    monkeypatch.setenv(block_mass.ENV, "kernel")
    assert block_mass.serves(codes) is not None
    assert block_mass.serves(codes.float()) is None  # float keys: the compiled path
    monkeypatch.setenv(block_mass.ENV, "fast")
    with pytest.raises(ValueError, match="OASISKV_RERANK='fast'"):
        block_mass.extension()


def test_candidate_mass_codes_stays_the_compiled_reference():
    """rerank.candidate_mass_codes is the compiled function, never the kernel (the bench and
    the fallback compare with it)."""
    inputs = case((2, 3), 13, 3, 64, 16, 8, seed=5)
    with torch.inference_mode():
        check(candidate_mass_codes(*inputs), brute_force(*inputs))


def test_an_engine_run_selects_the_blocks_the_compiled_path_selects(tiny_llama, monkeypatch):
    """A tiny Llama decoding sparse (K=2 of up to 10 blocks, the rerank over the int8 copy):
    every rerank picks the same K blocks per head with the kernel as with the compiled path,
    and the greedy tokens are the same."""
    from oasiskv import LLM, SamplingParams
    from oasiskv.kv import scorers

    picks: list[torch.Tensor] = []
    kernel_calls = []

    def spy(*args):
        out = rerank_layers(*args)
        picks.append(out.topk(2).indices.sort().values)
        return out

    def counted(*args):
        kernel_calls.append(1)
        return mass_kernel(*args)

    mass_kernel = block_mass.candidate_mass_codes
    monkeypatch.setattr(scorers, "rerank_layers", spy)
    monkeypatch.setattr(block_mass, "candidate_mass_codes", counted)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(kv_mode="sparse", top_k=2, rerank=2, rerank_source="int8",
              max_num_batched_tokens=64, max_num_seqs=3)
    g = torch.Generator().manual_seed(0)
    runs, prompts = {}, None
    for env in ("kernel", "compiled"):
        monkeypatch.setenv(block_mass.ENV, env)
        llm = LLM(str(tiny_llama), **kw)
        vocab = llm.engine.model_config.vocab_size
        prompts = prompts or [torch.randint(3, vocab, (n,), generator=g).tolist()
                              for n in (70, 110, 150)]
        picks.clear()
        runs[env] = ([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)],
                     list(picks))
        if env == "kernel":
            assert kernel_calls, "the kernel scored the run's reranks"
            kernel_calls.clear()
    assert not kernel_calls  # OASISKV_RERANK=compiled: never the kernel
    (tokens, got), (want_tokens, want) = runs["kernel"], runs["compiled"]
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert tokens == want_tokens
