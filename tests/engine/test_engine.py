"""The engine end to end on a tiny random Llama: continuous batching, chunked prefill,
preemption, validation, failure isolation, stop conditions, sampling, streaming, abort.

References are independent of the code under test where it matters: one-by-one runs, HF
transformers' logits and `generate`, and plain slicing of a longer greedy run.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

import oasiskv.layers.sampler as sampler_mod
from oasiskv import LLM, SamplingParams
from oasiskv.layers.linear import Linear

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)



@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ref_llm(model) -> LLM:
    """A roomy engine used only to produce one-request-at-a-time references."""
    return LLM(model, device_kv_budget="1MiB")


def make_llm(model: str, **kw) -> LLM:
    return LLM(model, **{"device_kv_budget": "1MiB", **kw})


def gen(llm: LLM, prompts, params=GREEDY):
    return llm.generate(prompts, params, use_tqdm=False)


def solo(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [gen(llm, [p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]


def rand_prompts(vocab: int, lengths: list[int], seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip ids 0/1 (<s>, </s>) so no prompt token is special.
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in lengths]


def record_batches(llm: LLM) -> list[list[dict]]:
    """Each successful step's batch, as seen before the engine advances it."""
    steps: list[list[dict]] = []

    def hook(batch):
        steps.append([{"id": s.request_id, "n": n, "computed": s.num_computed_tokens,
                       "prompt": s.num_prompt_tokens, "outputs": s.num_output_tokens}
                      for s, n in batch])

    llm.engine.step_hooks.append(hook)
    return steps


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                          dtype=torch.long),
                      max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def vocab(llm: LLM) -> int:
    return llm.engine.model_config.vocab_size


def assert_idle(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished()
    assert not e.scheduler.running and not e.scheduler.waiting
    assert e.pool.num_free == e.pool.num_blocks


# ---------------------------------------------------------------- batching


def test_batched_equals_one_by_one_with_chunked_mixed_steps(model, ref_llm):
    lengths = [3, 17, 40, 9, 26, 1]
    prompts = rand_prompts(vocab(ref_llm), lengths)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (12, 5, 9, 16, 7, 10)]
    expected = solo(ref_llm, prompts, params)

    llm = make_llm(model, max_num_seqs=3, max_num_batched_tokens=8)
    steps = record_batches(llm)
    outs = gen(llm, prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert [o.finish_reason for o in outs] == ["length"] * 6
    assert [o.prompt_token_ids for o in outs] == prompts

    # The schedule really was continuous batching with chunked prefill and mixed steps.
    assert all(len(b) <= 3 and sum(r["n"] for r in b) <= 8 for b in steps)
    assert max(len(b) for b in steps) == 3
    partial = [r for b in steps for r in b if r["computed"] + r["n"] < r["prompt"]]
    assert partial, "no prompt was prefilled in chunks"
    mixed = [b for b in steps
             if any(r["outputs"] > 0 and r["n"] == 1 for r in b)
             and any(r["computed"] < r["prompt"] for r in b)]
    assert mixed, "no step mixed decodes with prefill"
    joined = [b for b in steps
              if any(r["computed"] == 0 for r in b) and any(r["outputs"] > 0 for r in b)]
    assert joined, "no request joined a batch that was already decoding"
    stats = llm.stats()
    assert stats["steps"] == len(steps)
    assert stats["preemptions"] == 0
    assert stats["prefill_tokens"] == sum(lengths)
    assert stats["decode_tokens"] == sum(len(t) - 1 for t in expected)
    assert stats["requests_finished"] == 6
    assert_idle(llm)


def test_chunked_prefill_equals_unchunked_and_transformers(model, hf):
    prompt = rand_prompts(320, [50], seed=7)[0]
    firsts = {}
    for budget in (16, 4096):
        llm = make_llm(model, max_num_batched_tokens=budget)
        captured = []
        run = llm.engine.runner.run

        def capture(batch, rows, run=run, captured=captured):
            out = run(batch, rows)
            captured.append((len(rows), out.logits.clone()))
            return out

        llm.engine.runner.run = capture
        out = gen(llm, [prompt])[0]
        # Steps before the first sampled token are the prefill; chunked needs ceil(50/16).
        n_prefill = next(i for i, (rows, _) in enumerate(captured) if rows) + 1
        assert n_prefill == (4 if budget == 16 else 1)
        firsts[budget] = (out.token_ids, captured[n_prefill - 1][1][0])

    assert firsts[16][0] == firsts[4096][0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    for _, logits in firsts.values():
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_greedy_equals_transformers_generate(model, hf):
    prompts = rand_prompts(320, [5, 23, 11], seed=3)
    llm = make_llm(model)
    outs = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=20))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_greedy(hf, prompt, 20)
        assert len(ref) == 20 and 1 not in ref  # no EOS on these prompts: 20 full tokens
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_engine_sharing_weights_holds_no_copy_and_matches_transformers(model, hf, ref_llm):
    from oasiskv.config import EngineConfig
    from oasiskv.engine.engine import LLMEngine

    owner = ref_llm.engine
    config = EngineConfig.from_kwargs(model=model, kv_mode="sparse", top_k=4,
                                      device_kv_budget="1MiB")
    engine = LLMEngine(config, share_weights=owner)
    theirs = {n: p.data_ptr() for n, p in owner.model.named_parameters(remove_duplicate=False)}
    ours = {n: p.data_ptr() for n, p in engine.model.named_parameters(remove_duplicate=False)}
    assert ours == theirs and len(ours) > 10
    packed = [(m.packed, o.packed) for m, o in zip(engine.model.modules(),
                                                   owner.model.modules(), strict=True)
              if isinstance(m, Linear)]
    assert packed and all(a is not None and a is b for a, b in packed)  # packed once, shared
    prompt = rand_prompts(320, [40], seed=5)[0]
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=12))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished and o.request_id == rid]
    assert done[0].token_ids == hf_greedy(hf, prompt, 12)  # K=4 blocks hold all 52 tokens
    with pytest.raises(ValueError, match=r"share_weights: .*\(float32.*this one .*\(bfloat16"):
        LLMEngine(EngineConfig.from_kwargs(model=model, dtype="bfloat16"), share_weights=owner)


PREFAULT_PROBE = """
import json, os, sys
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine

def resident():  # bytes of this process in RAM
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

growth, engines = {}, []
for prefault in (None, False, True):  # the first engine also loads code and libraries
    before = resident()
    engines.append(LLMEngine(EngineConfig.from_kwargs(
        model=sys.argv[1], kv_mode="sparse", top_k=4, device_kv_budget="24MiB",
        host_kv_budget="96MiB", prefault_kv=bool(prefault))))  # room for all host summaries
    growth[prefault] = resident() - before
print(json.dumps([growth[False], growth[True], bool(engines[2].runner.host_kv.any())]))
"""


def test_prefault_kv_maps_the_pools_at_start(model):
    # a fresh interpreter: in this one freed memory of earlier tests may already be resident
    out = subprocess.run([sys.executable, "-c", PREFAULT_PROBE, model], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    lazy, prefaulted, nonzero = json.loads(out.splitlines()[-1])
    assert prefaulted - lazy > 90 * 2**20, (lazy, prefaulted)  # the pools' pages, mapped
    assert not nonzero  # written with zeros


def test_small_kv_budget_preempts_and_matches(model, ref_llm):
    prompts = rand_prompts(vocab(ref_llm), [40, 33, 21, 38, 12, 29], seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    big = make_llm(model, block_size=4)
    expected = [o.token_ids for o in gen(big, prompts, params)]
    assert big.stats()["preemptions"] == 0

    bpb = big.engine.bytes_per_block
    # 16 blocks of 4 tokens: any one request (<= 56 tokens) fits, six at once do not.
    small = make_llm(model, block_size=4, device_kv_budget=16 * bpb)
    assert small.engine.pool.num_blocks == 16
    outs = gen(small, prompts, params)
    stats = small.stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]
    assert [o.token_ids for o in outs] == expected
    assert stats["kv_peak_blocks"] <= 16
    assert_idle(small)


def test_admission_waits_for_the_whole_prompt_not_its_first_chunk(model, ref_llm):
    """Prompts of 40 tokens (10 blocks of 4) with 32 outputs (18 blocks) in a 30-block pool,
    prefilled in chunks of 8 tokens (2 blocks). Admitted on its first chunk, a request whose
    later chunks do not fit is preempted and admitted again on that chunk, over and over (2,
    6, 5 and 6 times); admitted only when its whole prompt fits, a request is preempted at
    most once, when the running requests' outputs outgrow the pool."""
    prompts = rand_prompts(vocab(ref_llm), [40] * 5, seed=7)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    expected = [o.token_ids for o in gen(make_llm(model, block_size=4), prompts, params)]
    probe = make_llm(model, block_size=4)
    tight = make_llm(model, block_size=4, max_num_batched_tokens=8,
                     device_kv_budget=30 * probe.engine.bytes_per_block)
    assert tight.engine.pool.num_blocks == 30
    outs = gen(tight, prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert tight.stats()["preemptions"] > 0  # the pool is tight
    assert max(o.metrics.num_preemptions for o in outs) == 1
    assert_idle(tight)


# ---------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def strict_llm(model) -> LLM:
    """Context 64 tokens; KV budget 3 blocks of 16 tokens (48 tokens)."""
    probe = make_llm(model)
    return make_llm(model, max_model_len=64, device_kv_budget=3 * probe.engine.bytes_per_block)


GOOD = [5, 6, 7, 8, 9]
GOOD_PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def good_tokens(ref_llm) -> list[int]:
    return gen(ref_llm, [GOOD], GOOD_PARAMS)[0].token_ids


def _bad_requests(v: int):
    return {
        "empty text": ("", GOOD_PARAMS, r"empty"),
        "empty ids": ([[]], GOOD_PARAMS, r"empty"),
        "longer than context": ([list(range(2, 66))], GOOD_PARAMS, r"64 tokens.*context"),
        "id == vocab": ([[5, v, 7]], GOOD_PARAMS, r"vocabulary"),
        "negative id": ([[5, -1]], GOOD_PARAMS, r"vocabulary"),
        "exceeds kv budget": ([list(range(2, 12))],
                              SamplingParams(temperature=0, max_tokens=50), r"KV budget"),
    }


@pytest.mark.parametrize("case", sorted(_bad_requests(320)))
def test_bad_request_is_value_error_and_engine_keeps_serving(strict_llm, good_tokens, case):
    prompt, params, match = _bad_requests(vocab(strict_llm))[case]
    with pytest.raises(ValueError, match=match):
        strict_llm.generate(prompt, params, use_tqdm=False)
    assert_idle(strict_llm)
    # With a good request in the same call: nothing is queued, nothing runs.
    bad = prompt if isinstance(prompt, str) else prompt[0]
    with pytest.raises(ValueError, match=match):
        strict_llm.generate([GOOD, bad], [GOOD_PARAMS, params], use_tqdm=False)
    assert_idle(strict_llm)
    # And through the engine API: add_request raises, the queue is untouched.
    with pytest.raises(ValueError, match=match):
        strict_llm.engine.add_request(bad, params)
    assert_idle(strict_llm)
    assert gen(strict_llm, [GOOD], GOOD_PARAMS)[0].token_ids == good_tokens
    assert_idle(strict_llm)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params_are_value_errors(strict_llm, good_tokens, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert gen(strict_llm, [GOOD], GOOD_PARAMS)[0].token_ids == good_tokens


def test_bad_engine_config_is_value_error(model, good_tokens):
    with pytest.raises(ValueError, match="no_such_option"):
        LLM(model, no_such_option=1)
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model-xyz'"):
        LLM("no-such-model-xyz")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model, max_model_len=10_000)  # the tiny model's context is 512
    with pytest.raises(ValueError, match="no room for one KV block"):
        LLM(model, device_kv_budget=100)
    assert gen(make_llm(model), [GOOD], GOOD_PARAMS)[0].token_ids == good_tokens


def test_prompt_that_fills_the_context_is_rejected_one_shorter_is_served(strict_llm):
    with pytest.raises(ValueError, match="context"):
        strict_llm.engine.add_request(list(range(2, 66)))  # 64 tokens == max_model_len
    out = gen(strict_llm, [list(range(2, 45))],  # 43 tokens + up to 5 out fits 48 KV tokens
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


# ---------------------------------------------------------------- failure isolation


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_failing_request_is_isolated(model, ref_llm, when):
    prompts = rand_prompts(vocab(ref_llm), [12, 30, 7, 19, 4], seed=11)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = solo(ref_llm, prompts, params)

    llm = make_llm(model, max_num_seqs=4, max_num_batched_tokens=24)
    e = llm.engine
    ids = [e.add_request(p, params) for p in prompts]
    culprit = ids[2]
    batches_with_culprit = []

    def hook(batch):
        for seq, _ in batch:
            if seq.request_id == culprit:
                batches_with_culprit.append(len(batch))
                if when == "prefill" or seq.num_output_tokens >= 3:
                    raise RuntimeError("injected fault")

    e.step_hooks.append(hook)
    finished = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out
    assert max(batches_with_culprit) > 1  # it failed inside a real batch first
    bad = finished[culprit]
    assert bad.finish_reason == "error"
    assert "injected fault" in bad.error
    if when == "decode":
        assert bad.token_ids == clean[2][:len(bad.token_ids)] and len(bad.token_ids) == 3
    for rid, ref in zip(ids, clean, strict=True):
        if rid != culprit:
            assert finished[rid].finish_reason == "length" and finished[rid].error is None
            assert finished[rid].token_ids == ref
    stats = llm.stats()
    assert stats["requests_failed"] == 1 and stats["requests_finished"] == 4
    assert stats["step_failures"] >= 2  # the batch, then the culprit alone
    assert_idle(llm)
    e.step_hooks.clear()
    assert gen(llm, [prompts[2]], params)[0].token_ids == clean[2]


def test_sampling_failure_leaves_seeded_neighbours_reproducible(model, ref_llm, monkeypatch):
    prompts = rand_prompts(vocab(ref_llm), [6, 9, 4], seed=13)
    seeded = [SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True)
              for s in (21, 22)]
    clean = solo(ref_llm, prompts[:2], seeded)
    culprit = SamplingParams(temperature=1.0, seed=666, max_tokens=8, ignore_eos=True)
    real = sampler_mod.sample_one

    def faulty(logits, params, generator):
        if params.seed == 666:
            raise RuntimeError("injected sampling fault")
        return real(logits, params, generator)

    monkeypatch.setattr(sampler_mod, "sample_one", faulty)
    outs = gen(make_llm(model), prompts, seeded + [culprit])
    assert outs[2].finish_reason == "error"
    assert [o.token_ids for o in outs[:2]] == clean


# ---------------------------------------------------------------- stop conditions


@pytest.fixture(scope="module")
def long_greedy(ref_llm):
    prompt = rand_prompts(vocab(ref_llm), [9], seed=17)[0]
    out = gen(ref_llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    return prompt, out.token_ids, out.text


def test_max_tokens_is_length(ref_llm, long_greedy):
    prompt, ref, _ = long_greedy
    out = gen(ref_llm, [prompt], SamplingParams(temperature=0, max_tokens=7))[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"
    assert out.metrics.num_generated_tokens == 7


def _first_new(ref: list[int]) -> int:
    """Index k >= 2 of the first token not seen before it (a clean place to stop)."""
    return next(k for k in range(2, len(ref)) if ref[k] not in ref[:k])


def test_stop_token_ids(ref_llm, long_greedy):
    prompt, ref, _ = long_greedy
    k = _first_new(ref)
    out = gen(ref_llm, [prompt], SamplingParams(temperature=0, max_tokens=30,
                                                 stop_token_ids=[ref[k]]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == ref[k]
    assert out.token_ids == ref[:k]
    assert out.text == ref_llm.tokenizer.decode(ref[:k])


def test_eos_stops_and_ignore_eos_does_not(tiny_llama, tmp_path, long_greedy):
    prompt, ref, _ = long_greedy
    k = _first_new(ref)
    # Same weights, but the config names a token the greedy run produces as EOS.
    path = shutil.copytree(tiny_llama, tmp_path / "eos_model")
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = ref[k]
    (path / "config.json").write_text(json.dumps(cfg))
    llm = make_llm(str(path))
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    assert out.finish_reason == "stop" and out.stop_reason == ref[k]
    assert out.token_ids == ref[:k]
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == ref


def _stop_string(tokenizer, ref: list[int]) -> tuple[str, int]:
    """Two ASCII letters that first appear after the second token, and the number of tokens
    whose text first contains them."""
    text = tokenizer.decode(ref)
    for i in range(len(tokenizer.decode(ref[:2])), len(text) - 1):
        s = text[i:i + 2]
        if s.isascii() and s.isalpha() and text.find(s) == i:
            n = next(n for n in range(1, len(ref) + 1) if s in tokenizer.decode(ref[:n]))
            return s, n
    pytest.fail(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text(ref_llm, long_greedy, include):
    prompt, ref, text = long_greedy
    s, n = _stop_string(ref_llm.tokenizer, ref)
    idx = text.find(s)
    out = gen(ref_llm, [prompt], SamplingParams(temperature=0, max_tokens=30, stop=["@@@", s],
                                                 include_stop_str_in_output=include))[0]
    assert out.finish_reason == "stop" and out.stop_reason == s
    # It stopped at the first token whose text completes the stop string.
    assert 2 < n < 30 and out.token_ids == ref[:n]
    assert out.text == (text[:idx + len(s)] if include else text[:idx])
    assert out.text.endswith(s) if include else s not in out.text


def test_max_model_len_is_length(model, long_greedy):
    prompt, ref, _ = long_greedy  # 9 prompt tokens
    llm = make_llm(model, max_model_len=20)
    out = gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=11, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert out.token_ids == ref[:11]  # 9 + 11 == 20: the whole context
    # one more is refused, as vLLM refuses it, not silently capped
    with pytest.raises(ValueError, match=r"context length is 20 tokens .* 9 input tokens "
                                         r"\(12 > 20 - 9\)"):
        gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))


# ---------------------------------------------------------------- sampling


def test_seeds(model, ref_llm, long_greedy):
    prompt, greedy, _ = long_greedy

    def sp(seed, **kw):
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=20, ignore_eos=True, **kw)

    a = gen(ref_llm, [prompt], sp(1))[0].token_ids
    # Same seed, same tokens: in another call and alongside other requests in one batch.
    assert gen(ref_llm, [prompt], sp(1))[0].token_ids == a
    both = gen(ref_llm, [prompt, prompt, prompt], [sp(1), sp(2), sp(1)])
    assert both[0].token_ids == a and both[2].token_ids == a
    assert both[1].token_ids != a  # different seeds differ
    assert a != greedy[:20]
    # Unseeded requests follow the engine seed.
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    r1 = gen(make_llm(model, seed=5), [prompt], unseeded)[0].token_ids
    r2 = gen(make_llm(model, seed=5), [prompt], unseeded)[0].token_ids
    r3 = gen(make_llm(model, seed=6), [prompt], unseeded)[0].token_ids
    assert r1 == r2 != r3


def test_temperature_zero_and_top_k_one_are_greedy(ref_llm, hf, long_greedy):
    prompt, greedy, _ = long_greedy
    assert greedy[:20] == hf_greedy(hf, prompt, 20)
    t0 = gen(ref_llm, [prompt], SamplingParams(temperature=0, max_tokens=20, seed=3))[0]
    assert t0.token_ids == greedy[:20]
    k1 = gen(ref_llm, [prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=20,
                                                seed=3, ignore_eos=True))[0]
    assert k1.token_ids == greedy[:20]


def test_tiny_temperature_is_near_greedy(ref_llm, long_greedy):
    prompt, greedy, _ = long_greedy
    out = gen(ref_llm, [prompt], SamplingParams(temperature=1e-40, max_tokens=10, seed=0,
                                                 ignore_eos=True))[0]
    assert out.finish_reason == "length", out.error
    assert out.token_ids == greedy[:10]


def test_metrics(ref_llm, long_greedy):
    prompt, _, _ = long_greedy
    out = gen(ref_llm, [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    m = out.metrics
    assert m.num_prompt_tokens == len(prompt) and m.num_generated_tokens == 6
    assert m.ttft is not None and m.ttft >= 0
    assert m.tpot is not None and m.tpot >= 0
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    d = m.as_dict()
    assert d["prompt_tokens"] == len(prompt) and d["generated_tokens"] == 6
    assert d["e2e_s"] >= d["ttft_s"] >= 0 and d["preemptions"] == 0


# ---------------------------------------------------------------- streaming, abort


def test_stream_grows_and_ends_like_generate(ref_llm, long_greedy):
    prompt, _, _ = long_greedy
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    final = gen(ref_llm, [prompt], params)[0]
    chunks = list(ref_llm.stream(prompt, params))
    assert [len(c.token_ids) for c in chunks] == list(range(1, 13))
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.token_ids[:len(a.token_ids)] == a.token_ids
        assert not a.finished
    last = chunks[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.token_ids == final.token_ids and last.text == final.text
    assert_idle(ref_llm)


def test_abandoned_stream_is_aborted(ref_llm, long_greedy):
    prompt, _, _ = long_greedy
    stream = ref_llm.stream(prompt, SamplingParams(temperature=0, max_tokens=12))
    next(stream)
    next(stream)
    assert ref_llm.engine.pool.num_used > 0
    stream.close()
    assert_idle(ref_llm)


def test_abort_frees_blocks_and_spares_others(model, ref_llm):
    prompts = rand_prompts(vocab(ref_llm), [20, 35, 10], seed=19)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    clean = solo(ref_llm, prompts, params)
    llm = make_llm(model, max_num_seqs=2)  # the third request waits
    e = llm.engine
    ids = [e.add_request(p, params) for p in prompts]
    for _ in range(3):
        e.step()
    running, waiting = e.requests[ids[1]], e.requests[ids[2]]
    assert running in e.scheduler.running and running.block_table
    assert waiting in e.scheduler.waiting
    used = e.pool.num_used
    n_blocks = len(running.block_table)
    e.abort(ids[1])
    e.abort(ids[2])
    e.abort("no-such-request")  # a no-op
    assert e.pool.num_used == used - n_blocks
    assert running not in e.scheduler.running and waiting not in e.scheduler.waiting
    assert running.finish_reason == waiting.finish_reason == "abort"
    finished = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {ids[0]}
    assert finished[ids[0]].token_ids == clean[0]
    assert_idle(llm)
    e.abort(ids[0])  # aborting a finished request changes nothing
    assert ids[0] not in e.requests  # finished requests leave the engine's table
