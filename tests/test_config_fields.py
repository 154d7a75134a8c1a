"""Every config field changes what the engine does. One row per field of EngineConfig and its
sections: each sets the field (an `LLM(...)` keyword) to a non-default value on an engine where
it applies and observes a behaviour that value causes, against the default or a hand-computed
reference. A field added without a row fails `test_every_config_field_has_a_row`."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from config_probes import (
    BYTES_PER_BLOCK,
    GREEDY,
    LONG,
    PROMPTS,
    SPARSE,
    B,
    Run,
    drafts_by_step,
    most_admitted,
    pool_residency,
    prompt_lookup,
    reranks_like,
    run,
    selections_like,
)
from conftest import build_model_dir

from oasiskv import LLM, SamplingParams
from oasiskv.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from oasiskv.store.mooncake import INSTALL_HINT, mooncake_available, start_master


def all_field_names() -> set[str]:
    """Read from the dataclasses themselves, not from EngineConfig.flat_fields()."""
    sections = {"cache", "scheduler", "spec"}
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert sections <= names
    return ((names - sections) | {f.name for f in dataclasses.fields(CacheConfig)}
            | {f.name for f in dataclasses.fields(SchedulerConfig)}
            | {f.name for f in dataclasses.fields(SpecConfig)})


# ---------------------------------------------------------------- the table


@dataclass
class Ctx:
    path: str  # tiny_llama
    other: str  # another tiny model: same shapes and tokenizer, other weights
    request: pytest.FixtureRequest


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("other_llama"), seed=1)


ROWS: dict[str, Callable[[Ctx], None]] = {}


def row(name: str) -> Callable:
    def register(check: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        ROWS[name] = check
        return check
    return register


def test_every_config_field_has_a_row():
    assert set(ROWS) == all_field_names()
    assert {f.name for _, f in EngineConfig.flat_fields()} == all_field_names()


@pytest.mark.parametrize("name", sorted(all_field_names()))
def test_config_field_takes_effect(tiny_llama, other_model, request, name):
    assert name in ROWS, f"no row shows that {name} changes what the engine does"
    ROWS[name](Ctx(str(tiny_llama), str(other_model), request))


# ---------------------------------------------------------------- EngineConfig


@row("model")
def _model(ctx: Ctx) -> None:
    """The weights come from that model: greedy tokens equal HF transformers' on it."""
    prompt, n = PROMPTS[0][:20], 6
    hf = transformers.AutoModelForCausalLM.from_pretrained(ctx.path).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    assert run(ctx.path, [prompt], params).tokens == [ids[0, 20:].tolist()]
    assert run(ctx.other, [prompt], params).tokens != [ids[0, 20:].tolist()]


@row("dtype")
def _dtype(ctx: Ctx) -> None:
    """bfloat16 weights and KV: the same continuation scores close to, not exactly as, fp32."""
    cont = PROMPTS[1][:8]
    params = SamplingParams(max_tokens=len(cont), forced_tokens=cont, logprobs=True)
    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(ctx.path, dtype=dtype)
        assert llm.engine.runner.device_kv.dtype == getattr(torch, dtype)
        out = llm.generate([PROMPTS[0][:40]], params, use_tqdm=False)[0]
        logprobs[dtype] = torch.tensor(out.logprobs)
    assert not torch.equal(logprobs["bfloat16"], logprobs["float32"])
    torch.testing.assert_close(logprobs["bfloat16"], logprobs["float32"], atol=0.1, rtol=0)


@row("device")
def _device(ctx: Ctx) -> None:
    """Weights and KV pools live on that device: meta (shapes only) on any machine; on a
    CUDA machine cuda, with the CPU's tokens; without CUDA cuda is refused."""
    engine = LLM(ctx.path, device="meta").engine
    assert engine.runner.device_kv.is_meta
    assert all(p.is_meta for p in engine.model.parameters())
    engine = LLM(ctx.path).engine
    assert not engine.runner.device_kv.is_meta and engine.runner.device_kv.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            LLM(ctx.path, device="cuda")
        return
    llm = LLM(ctx.path, device="cuda")
    assert llm.engine.runner.device_kv.is_cuda
    assert all(p.is_cuda for p in llm.engine.model.parameters())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == run(ctx.path, PROMPTS, params).tokens


@row("num_threads")
def _num_threads(ctx: Ctx) -> None:
    """torch's intra-op thread count (process-wide: restored after)."""
    try:
        LLM(ctx.path)
        assert torch.get_num_threads() == 1  # conftest's, left alone by default
        LLM(ctx.path, num_threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)


@row("seed")
def _seed(ctx: Ctx) -> None:
    """Requests without a seed of their own sample from the engine's seed: reproducible per
    seed, different across seeds."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)

    def sample(**kw) -> list[list[int]]:
        return [o.token_ids for o in LLM(ctx.path, **kw).generate(PROMPTS, params,
                                                                    use_tqdm=False)]

    seven = sample(seed=7)
    assert sample(seed=7) == seven
    assert sample() != seven


# ---------------------------------------------------------------- SchedulerConfig


@row("max_num_seqs")
def _max_num_seqs(ctx: Ctx) -> None:
    one, default = run(ctx.path, max_num_seqs=1), run(ctx.path)
    assert max(e["seqs"] for e in one.log) == 1
    assert max(e["seqs"] for e in default.log) == 2
    assert one.tokens == default.tokens


@row("max_num_batched_tokens")
def _max_num_batched_tokens(ctx: Ctx) -> None:
    """Prompts are prefilled in chunks of at most that many tokens per step."""
    small, default = run(ctx.path, max_num_batched_tokens=32), run(ctx.path)
    assert max(e["prefill_tokens"] + e["decode_tokens"] for e in small.log) == 32
    assert sum(e["prefill_tokens"] > 0 for e in small.log) == -(-230 // 32)
    assert default.log[0]["prefill_tokens"] == 230  # both prompts in the first step
    assert small.tokens == default.tokens


@row("max_model_len")
def _max_model_len(ctx: Ctx) -> None:
    """Requests are bounded by that context: 100 + 10 tokens run, 100 + 30 are refused."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    short = run(ctx.path, [PROMPTS[0]], params, max_model_len=110)
    assert short.tokens == run(ctx.path, [PROMPTS[0]], params).tokens
    assert short.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="110"):
        LLM(ctx.path, max_model_len=110).generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert len(run(ctx.path, [PROMPTS[0]]).tokens[0]) == 30


# ---------------------------------------------------------------- CacheConfig: dense


@row("block_size")
def _block_size(ctx: Ctx) -> None:
    """KV is allocated in blocks of that many tokens."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for kw, block in (({"block_size": 8}, 8), ({}, 16)):
        stats = run(ctx.path, [PROMPTS[0][:40]], params, **kw).stats
        assert stats["kv_bytes_per_block"] == block * BYTES_PER_BLOCK // B
        assert stats["kv_peak_blocks"] == -(-43 // block)  # K/V of 40 + 3 tokens


@row("device_kv_budget")
def _device_kv_budget(ctx: Ctx) -> None:
    """A pool of 16 blocks admits both prompts (7 + 9 blocks) but not their growth (to 9 +
    10): one is preempted and recomputed, and nothing is lost."""
    small, default = run(ctx.path, device_kv_budget=16 * BYTES_PER_BLOCK), run(ctx.path)
    assert small.stats["kv_blocks_total"] == small.stats["kv_peak_blocks"] == 16
    assert small.stats["preemptions"] > 0 and default.stats["preemptions"] == 0
    assert small.tokens == default.tokens


@row("prefault_kv")
def _prefault_kv(ctx: Ctx) -> None:
    """The pools' pages are mapped in (mincore) and zero when the engine starts; without it a
    fresh pool has no page mapped until it is used (pools well above glibc's largest mmap
    threshold, 32 MiB, so that malloc maps them fresh instead of reusing touched heap)."""
    def fresh(prefault: bool) -> tuple[list[float | None], bool]:  # a process per engine
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            return pool.submit(pool_residency, ctx.path, prefault).result()

    shares, zero = fresh(True)
    assert shares == [1.0, 1.0] and zero
    shares, _ = fresh(False)
    assert all(s < 0.1 for s in shares if s is not None)


# ---------------------------------------------------------------- CacheConfig: sparse


@row("kv_mode")
def _kv_mode(ctx: Ctx) -> None:
    """sparse: the prompts' K/V go to the host tier and the device holds working sets (top_k
    128 covers every block here, so tokens equal dense)."""
    sparse, dense = run(ctx.path, kv_mode="sparse"), run(ctx.path)
    assert sparse.tokens == dense.tokens
    assert sparse.stats["sparse_host_write_bytes"] == 230 * BYTES_PER_BLOCK // B
    assert sparse.snaps() and not dense.snaps()
    assert "sparse_host_write_bytes" not in dense.stats


@row("top_k")
def _top_k(ctx: Ctx) -> None:
    """Each KV head holds min(top_k, complete blocks) blocks."""
    for kw, k in (({"top_k": 2}, 2), ({}, 128)):
        snaps = run(ctx.path, kv_mode="sparse", **kw).snaps()
        assert snaps
        for s in snaps:
            assert all(len(h) == min(k, s.computed // B) for layer in s.held() for h in layer)


@row("f_hbm")
def _f_hbm(ctx: Ctx) -> None:
    """At most ceil(f_hbm * top_k) blocks enter a head's working set per step once seeded."""
    kw = dict(kv_mode="sparse", top_k=8, params=SamplingParams(temperature=0, max_tokens=40,
                                                                ignore_eos=True))
    quarter, default = run(ctx.path, [LONG], f_hbm=0.25, **kw), run(ctx.path, [LONG], **kw)
    assert (quarter.stats["fetch_cap"], default.stats["fetch_cap"]) == (2, 1)
    assert (most_admitted(quarter), most_admitted(default)) == (2, 1)
    assert default.stats["sparse_wanted"] > default.stats["sparse_admitted"]


@row("host_kv_budget")
def _host_kv_budget(ctx: Ctx) -> None:
    """A request whose history exceeds the host tier is refused; one that fits runs."""
    tight = LLM(ctx.path, kv_mode="sparse", host_kv_budget=8 * BYTES_PER_BLOCK)  # 128 tokens
    with pytest.raises(ValueError, match="host_kv_budget"):
        tight.generate([PROMPTS[0]], GREEDY, use_tqdm=False)  # 100 + 30 tokens
    assert tight.generate([PROMPTS[0][:98]], GREEDY, use_tqdm=False)[0].finish_reason == "length"
    tight.close()
    assert run(ctx.path, [PROMPTS[0]], kv_mode="sparse").outputs[0].finish_reason == "length"


@row("predictor")
def _predictor(ctx: Ctx) -> None:
    """exact selects with the step's own query (no drafts); lookahead with the drafts'."""
    exact, lookahead = run(ctx.path, **SPARSE, predictor="exact"), run(ctx.path, **SPARSE)
    assert exact.stats["drafts"] == 0 < lookahead.stats["drafts"]
    assert exact.sets() != lookahead.sets()


@row("sink_blocks")
def _sink_blocks(ctx: Ctx) -> None:
    def always_first(r: Run) -> bool:
        return all(0 in h for s in r.snaps() for layer in s.held() for h in layer)

    assert always_first(run(ctx.path, **SPARSE, sink_blocks=1))
    assert not always_first(run(ctx.path, **SPARSE))


@row("recent_blocks")
def _recent_blocks(ctx: Ctx) -> None:
    def always_last(r: Run) -> bool:
        return all(s.computed // B - 1 in h for s in r.snaps() for layer in s.held()
                   for h in layer)

    assert always_last(run(ctx.path, **SPARSE, recent_blocks=1))
    assert not always_last(run(ctx.path, **SPARSE))


@row("dense_layers")
def _dense_layers(ctx: Ctx) -> None:
    """1: layer 0 attends densely, with no working set nor selection there (the head maps
    cover layer 1 only, half the default's block predictions, counted per layer), and its
    K/V is a device copy of every block charged beside the summaries: per block 1 layer x 2
    x 2 KV heads x 16 tokens x 16 x 4 B, while a slab block and a summary hold the one sparse
    layer (tests/kv/test_dense_layers.py: layer 0 equals dense mode)."""
    one, default = run(ctx.path, **SPARSE, dense_layers=1), run(ctx.path, **SPARSE)
    assert {s.head_map.shape[0] for s in one.snaps()} == {1}
    assert {s.head_map.shape[0] for s in default.snaps()} == {2}
    assert 2 * one.stats["sparse_predicted"] == default.stats["sparse_predicted"] > 0
    assert one.stats["dense_layer_bytes_per_block"] == 2 * 2 * 16 * 16 * 4
    assert one.stats["kv_bytes_per_block"] == BYTES_PER_BLOCK // 2
    assert one.stats["summary_bytes_per_block"] == 2 * 2 * 16 * 2 + 2 * 2 * 16 * 16 * 4
    assert "dense_layer_bytes_per_block" not in default.stats


@row("score_alpha")
def _score_alpha(ctx: Ctx) -> None:
    assert all(selections_like(ctx.path, 0.0, score_alpha=0.0))
    assert not all(selections_like(ctx.path, 0.0))  # the default (1) ranks otherwise


@row("score_aggregation")
def _score_aggregation(ctx: Ctx) -> None:
    """Working sets are the top-K by the per-head softmaxed bounds, summed or maxed over each
    group, as computed by hand; the default (summed raw bounds) ranks otherwise."""
    for aggregation in ("softmax-sum", "softmax-max"):
        for prompts in (PROMPTS, [LONG]):  # a batch's summaries as one view; one request's
            assert all(selections_like(ctx.path, 1.0, aggregation, prompts))
        assert not all(selections_like(ctx.path, 1.0, aggregation, score_aggregation="sum"))


@row("summary_splits")
def _summary_splits(ctx: Ctx) -> None:
    """2: working sets are the top-K by the largest of each block's two 8-token sub-blocks'
    bounds, as computed by hand (summed over the group, or per head before softmax-sum); the
    default's one summary per block ranks otherwise. Each block pays two summaries (per block
    2 x 2 layers x 2 KV heads x 16 x 2 B each, bf16)."""
    for aggregation in ("sum", "softmax-sum"):
        for prompts in (PROMPTS, [LONG]):  # a batch's summaries as one view; one request's
            assert all(selections_like(ctx.path, 1.0, aggregation, prompts, splits=2,
                                       summary_splits=2))
    assert not all(selections_like(ctx.path, 1.0, splits=2))
    assert not all(selections_like(ctx.path, 1.0, summary_splits=2))
    stats = run(ctx.path, **SPARSE, summary_splits=2).stats
    assert stats["summary_bytes_per_block"] == 2 * (2 * 2 * 2 * 16 * 2)


@row("rerank")
def _rerank(ctx: Ctx) -> None:
    """exact + rerank over every block (8 * top_k = 16 >= 10 blocks) ranks by attention mass
    as the oracle does: the same working sets at every step; exact alone differs."""
    kw = dict(kv_mode="sparse", top_k=2, f_hbm=1.0, rerank_source="host")
    oracle = run(ctx.path, **kw, predictor="oracle").sets()
    assert run(ctx.path, **kw, predictor="exact", rerank=8).sets() == oracle
    assert run(ctx.path, **kw, predictor="exact", rerank=0).sets() != oracle


@row("rerank_source")
def _rerank_source(ctx: Ctx) -> None:
    """int8: the rerank reads the device's int8 key copy, charged beside the summaries (per
    block: 2 layers x 2 KV heads x (16 x 16 codes + a 4-byte scale)). Its working sets are the
    top-K by attention mass over the int8 keys (`int8_keys`, by hand), not over the exact
    ones (int8 is the default); host the other way round."""
    assert all(reranks_like(ctx.path, True))
    assert not all(reranks_like(ctx.path, False))
    assert all(reranks_like(ctx.path, False, rerank_source="host"))
    assert not all(reranks_like(ctx.path, True, rerank_source="host"))
    kw = dict(kv_mode="sparse", top_k=2, rerank=8)
    stats = run(ctx.path, **kw).stats
    assert stats["key_copy_bytes_per_block"] == 2 * 2 * (16 * 16 + 4)
    assert stats["summary_bytes_per_block"] == 2 * 2 * 2 * 16 * 2 + 2 * 2 * (16 * 16 + 4)
    assert "key_copy_bytes_per_block" not in run(ctx.path, **kw, rerank_source="host").stats


@row("summary_dtype")
def _summary_dtype(ctx: Ctx) -> None:
    """Block summaries are stored in that dtype, each min the largest value <= the keys' min
    (auto, for fp32 K/V: bfloat16). rerank=0: a selection that reads them (rerank=inf keeps
    none)."""
    for kw, dtype in (({"summary_dtype": "float16"}, torch.float16), ({}, torch.bfloat16)):
        llm = LLM(ctx.path, kv_mode="sparse", top_k=2, rerank=0, **kw)
        engine = llm.engine
        engine.add_request(PROMPTS[0], GREEDY, request_id="a")
        engine.step()  # the prefill: its 6 complete blocks summarized
        seq, sparse = engine.requests["a"], engine.sparse
        n = len(PROMPTS[0]) // B
        slots = torch.tensor(seq.host_table[:n])[:, None] * B + torch.arange(B)
        true_min = sparse.host_kv[:, 0][:, :, slots].amin(3)  # [L, Hkv, n, d]
        got = sparse.kmin[:, torch.tensor(seq.summary_ids[:n])].transpose(1, 2)
        assert got.dtype == dtype
        nearest = true_min.to(dtype)
        below = torch.where(nearest.float() > true_min,
                            torch.nextafter(nearest, nearest.new_tensor(-torch.inf)), nearest)
        assert torch.equal(got, below)
        llm.close()


@row("remote_store")
def _remote_store(ctx: Ctx) -> None:
    """The complete prompt blocks (6 + 8) go to the store; tokens are unchanged."""
    kw = dict(kv_mode="sparse", top_k=2)
    stored, default = run(ctx.path, remote_store="inprocess", **kw), run(ctx.path, **kw)
    assert stored.stats["remote_put_bytes"] == 14 * BYTES_PER_BLOCK
    assert "remote_put_bytes" not in default.stats
    assert stored.tokens == default.tokens


@row("f_host")
def _f_host(ctx: Ctx) -> None:
    """Below 1 the host keeps part of each prompt and fetches evicted blocks from the store."""
    kw = dict(kv_mode="sparse", top_k=2, remote_store="inprocess")
    half, full = run(ctx.path, f_host=0.5, **kw), run(ctx.path, **kw)
    assert half.stats["host_evictions"] > 0 and half.stats["remote_bytes"] > 0
    assert full.stats["host_evictions"] == full.stats["remote_bytes"] == 0
    assert half.stats["host_cache_peak_blocks"] < full.stats["host_cache_peak_blocks"]
    assert half.tokens == full.tokens


@row("handoff_summaries")
def _handoff_summaries(ctx: Ctx) -> None:
    """int8: a PD hand-over carries int8 summary codes with a float32 scale per row and KV
    head, (d + 2) / (2 d) of bf16 summaries' bytes, and the request still runs to its end."""
    from oasiskv.disagg.pd import DisaggregatedLLM

    sent = {}
    for fmt in ("exact", "int8"):
        pd = DisaggregatedLLM(ctx.path, transfer="slab", kv_mode="sparse", top_k=2, rerank=0,
                              summary_dtype="bfloat16", handoff_summaries=fmt)
        out = pd.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
        assert out.finish_reason == "length"
        sent[fmt] = next(iter(pd.handoffs.values()))
        pd.close()
    exact, int8 = sent["exact"], sent["int8"]
    assert (exact.kmin.dtype, int8.kmin.dtype) == (torch.bfloat16, torch.int8)
    d, n = exact.kmin.shape[-1], exact.kmin.numel()
    assert exact.metadata_bytes - int8.metadata_bytes == 2 * n * 2 - (2 * n + 4 * n // d)


@row("prefix_cache_bytes")
def _prefix_cache_bytes(ctx: Ctx) -> None:
    """A prompt run again after its request ended reads its complete blocks (but the last
    token's) from the prefix cache: all 6 by default, as many as the capacity holds (2 blocks'
    worth), none with 0; the tokens are the same."""
    kw = dict(kv_mode="sparse", top_k=2, remote_store="inprocess")

    def first(llm: LLM) -> None:
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)

    runs = {cap: run(ctx.path, [PROMPTS[0]], setup=first, **kw,
                     **({} if cap is None else {"prefix_cache_bytes": cap}))
            for cap in (None, 2 * BYTES_PER_BLOCK, 0)}
    assert [r.stats["prefix_reused_tokens"] for r in runs.values()] == [6 * B, 2 * B, 0]
    assert [r.stats["prefix_cache_bytes"] for r in runs.values()] == [
        6 * BYTES_PER_BLOCK, 2 * BYTES_PER_BLOCK, 0]
    assert len({str(r.tokens) for r in runs.values()}) == 1


@row("remote_lend")
def _remote_lend(ctx: Ctx) -> None:
    """Mooncake: the memory an engine lends is where its puts land; lending none, with no
    other lender, its prompt blocks have nowhere to go and the request fails."""
    if not mooncake_available():
        pytest.skip(f"Mooncake wheel not installed: run {INSTALL_HINT}")
    ctx.request.getfixturevalue("mooncake_net")
    with start_master() as master:  # its own: no other client's memory to land in
        kw = dict(kv_mode="sparse", top_k=2, remote_store=f"mooncake://{master.address}")
        lent = run(ctx.path, [PROMPTS[0]], setup=lambda _: None, **kw)
        none = run(ctx.path, [PROMPTS[0]], setup=lambda _: None, remote_lend="0", **kw)
    assert lent.outputs[0].finish_reason == "length"
    assert lent.stats["remote_put_bytes"] == 6 * BYTES_PER_BLOCK
    assert none.outputs[0].finish_reason == "error"
    assert "storing the prompt" in none.outputs[0].error


@row("prefetch")
def _prefetch(ctx: Ctx) -> None:
    """async: the next step's selections run on a worker thread; sync: on the caller's."""
    def threads(mode: str) -> tuple[set[str], list[list[int]]]:
        names: set[str] = set()

        def record(llm: LLM) -> None:
            llm.engine.sparse.stage_hooks["select"] = (
                lambda layer, seqs: names.add(threading.current_thread().name))

        return names, run(ctx.path, setup=record, **SPARSE, prefetch=mode).tokens

    (async_names, async_tokens), (sync_names, sync_tokens) = threads("async"), threads("sync")
    assert "oasiskv-select" in async_names
    assert sync_names == {threading.current_thread().name}
    assert async_tokens == sync_tokens


@row("prefetch_group")
def _prefetch_group(ctx: Ctx) -> None:
    """async: layers per prefetch job, as the trace labels them (default: half of 2)."""
    def job_layers(**kw) -> set[str]:
        tracers = []
        run(ctx.path, setup=lambda llm: tracers.append(llm.engine.trace()), **SPARSE,
            prefetch="async", **kw)
        path = ctx.request.getfixturevalue("tmp_path") / f"trace{len(kw)}.json"
        tracers[0].write(path)
        events = json.loads(path.read_text())["traceEvents"]
        select = {e["tid"] for e in events if e["name"] == "thread_name"
                  and e["args"]["name"] == "select"}
        return {e["name"].split(" ")[0] for e in events if e["ph"] == "X" and e["tid"] in select}

    assert "L0-1" in job_layers(prefetch_group=2)
    assert job_layers() == {"L0", "L1"}


# ---------------------------------------------------------------- SpecConfig


@row("drafter")
def _drafter(ctx: Ctx) -> None:
    """ngram drafts by prompt lookup: wherever the last 3, 2 or 1 tokens occurred before, the
    draft is the token that followed the latest occurrence (the longest match first)."""
    ngram, default = run(ctx.path, **SPARSE, drafter="ngram"), run(ctx.path, **SPARSE)
    checked = 0
    for s in (s for step in ngram.steps for s in step.values() if s.drafts):
        want = prompt_lookup(s.tokens)
        if want is not None:
            assert s.drafts == [want]
            checked += 1
    assert checked > 10
    assert drafts_by_step(ngram) != drafts_by_step(default)


@row("num_drafts")
def _num_drafts(ctx: Ctx) -> None:
    """Two distinct drafts per step, the first the one-draft engine's (greedy: the lookahead
    predicts with the first, so both engines decode alike)."""
    two, one = run(ctx.path, **SPARSE, num_drafts=2), run(ctx.path, **SPARSE)
    pairs = drafts_by_step(two)
    assert pairs and all(len(set(p)) == 2 for p in pairs)
    assert [p[:1] for p in pairs] == drafts_by_step(one)
    assert two.tokens == one.tokens


@row("draft_model")
def _draft_model(ctx: Ctx) -> None:
    """drafter=model drafts with that model: the target itself guesses its own greedy tokens
    (every draft right), another model mostly not."""
    kw = dict(drafter="model", speculative="accept")
    itself, other = (run(ctx.path, draft_model=m, **kw).stats for m in (ctx.path, ctx.other))
    assert itself["drafts"] > 0 and itself["drafts_right"] == itself["drafts"]
    assert other["drafts_right"] < other["drafts"] / 2


@row("speculative")
def _speculative(ctx: Ctx) -> None:
    """accept: a right draft is kept, so steps emit two tokens; the output is unchanged."""
    spec, plain = run(ctx.path, [PROMPTS[0]], speculative="accept"), run(ctx.path, [PROMPTS[0]])
    assert spec.stats["spec_accepted"] > 0 and plain.stats["spec_accepted"] == 0
    assert spec.stats["steps"] == plain.stats["steps"] - spec.stats["spec_accepted"]
    assert spec.tokens == plain.tokens


@row("forced_drafts")
def _forced_drafts(ctx: Ctx) -> None:
    """known: a forced request's draft is its next forced token; guessed: the drafter's."""
    params = SamplingParams(temperature=0, max_tokens=20, forced_tokens=PROMPTS[0][:20])
    known = run(ctx.path, [PROMPTS[1]], params, **SPARSE).stats
    guessed = run(ctx.path, [PROMPTS[1]], params, **SPARSE, forced_drafts="guessed").stats
    assert known["drafts"] == known["drafts_right"] == 19
    assert guessed["drafts"] == 19 and guessed["drafts_right"] < 19
