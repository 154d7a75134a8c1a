"""The prefetch pipeline: async equals sync, the foreground waits only at a slowed layer,
workers stop with the engine, a failing stage fails only its requests, traces and f_hbm=auto.
"""

import gc
import json
import random
import threading
import time

import pytest
from conftest import build_model_dir

from oasiskv import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
TOTALS = ("sparse_predicted", "sparse_hits", "sparse_wanted", "sparse_admitted",
          "sparse_h2d_bytes", "sparse_d2h_bytes")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Four layers, so that 'only at the slowed layer' has layers before and after it."""
    return str(build_model_dir(tmp_path_factory.mktemp("four_layers"), num_hidden_layers=4))


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(rng.randrange(20, 120))] for _ in range(n)]


def run_staggered(llm: LLM, ids: list[list[int]], params=GREEDY) -> dict:
    """Requests arrive over time (varied batch composition); returns outputs by request id."""
    engine, pending, outs = llm.engine, list(ids), {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 5 == 0:
            engine.add_request(pending.pop(0), params, request_id=f"r{len(ids) - len(pending)}")
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
    return outs


@pytest.mark.parametrize("predictor, rerank, group", [
    ("lookahead", 0, 0), ("previous", 0, 0), ("exact", 0, 0), ("lookahead", 2, 0),
    ("lookahead", 0, 1), ("previous", 0, 3)])  # async jobs of 2 (default), 1, or 3 + 1 layers
def test_async_and_sync_give_the_same_tokens_and_traffic(model, predictor, rerank, group):
    kw = dict(kv_mode="sparse", top_k=3, f_hbm=0.34, predictor=predictor, rerank=rerank,
              max_num_seqs=3, max_num_batched_tokens=64, prefetch_group=group)
    got = {}
    for mode in ("sync", "async"):
        llm = LLM(model, prefetch=mode, **kw)
        outs = run_staggered(llm, prompts(7))
        got[mode] = ({r: o.token_ids for r, o in outs.items()},
                     {k: llm.stats()[k] for k in TOTALS})
        assert all(o.finish_reason == "length" for o in outs.values())
        llm.close()
    assert got["async"] == got["sync"]
    assert got["sync"][1]["sparse_admitted"] > 0


def hold_layer_fetch(model: str, group: int, ids: list[list[int]], max_tokens: int,
                     timeout: float = 20) -> tuple[int, int]:
    """Decodes with layer 2's fetches held until the foreground waits for layer 2 (no wall
    time: a handshake). Were the foreground to wait for such a fetch before layer 2, it would
    never get there: the fetch gives up after `timeout` s. Returns (fetches held, given up)."""
    llm = LLM(model, kv_mode="sparse", top_k=2, predictor="previous", prefetch="async",
              prefetch_group=group)
    sparse = llm.engine.sparse
    pipeline, slow_layer = sparse.pipeline, 2
    changed = threading.Condition()
    waiting_at: list[int | None] = [None]  # the layer the foreground is waiting for
    counts = [0, 0]  # held, given up
    wait = pipeline.wait

    def watch(layer):
        with changed:
            waiting_at[0] = layer
            changed.notify_all()
        try:
            wait(layer)
        finally:
            with changed:
                waiting_at[0] = None

    def slow(layer, seqs):
        # the first decode step selects on the foreground itself: nothing to hold there
        if layer != slow_layer or threading.current_thread() is threading.main_thread():
            return
        if counts[1]:  # once is enough to fail; the rest run free
            return
        with changed:
            arrived = changed.wait_for(lambda: waiting_at[0] == slow_layer,
                                         timeout=timeout)
        counts[0 if arrived else 1] += 1

    pipeline.wait = watch
    sparse.stage_hooks["local"] = slow
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                            ignore_eos=True), use_tqdm=False)
    llm.close()
    assert all(o.finish_reason == "length" for o in outs)
    return counts[0], counts[1]


@pytest.mark.parametrize("group", [1, 0])  # a job per layer; per half of the layers (default)
def test_a_slow_fetch_stalls_only_its_layer(model, group):
    """The foreground gets past layers 0 and 1 while layer 2's fetch is still running, and
    waits for it at layer 2 only (with two-layer jobs layer 2 is the first of its job). These
    prompts (50 and 88 tokens, 8 steps) never complete blocks in the same step."""
    held, gave_up = hold_layer_fetch(model, group, prompts(2), 8)
    assert gave_up == 0, "the foreground waited for layer 2's fetch before layer 2"
    assert held >= 5  # every step after the first


@pytest.mark.parametrize("group", [1, 0])
def test_a_slow_fetch_stalls_only_its_layer_when_requests_fill_together(model, group):
    """40 and 56 tokens: both requests complete a block in the same steps."""
    rng = random.Random(5)
    ids = [[rng.randrange(2, 300) for _ in range(n)] for n in (40, 56)]
    assert hold_layer_fetch(model, group, ids, 12, timeout=3)[1] == 0


def test_no_worker_survives_shutdown(model):
    def workers():
        return {t for t in threading.enumerate() if t.name.startswith("oasiskv-")}

    before = workers()
    llm = LLM(model, kv_mode="sparse", top_k=2, prefetch="async")
    assert len(workers() - before) == 5  # one per stage
    llm.generate(prompts(2), GREEDY, use_tqdm=False)
    llm.close()
    assert workers() == before
    llm = LLM(model, kv_mode="sparse", top_k=2, prefetch="async")
    del llm  # dropped without close: the engine's finalizer stops the workers
    gc.collect()
    assert workers() == before


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_failing_stage_fails_only_its_requests(model, mode):
    llm = LLM(model, kv_mode="sparse", top_k=2, predictor="lookahead", prefetch=mode)

    def fault(layer, seqs):
        if any(s.request_id == "bad" for s in seqs):
            raise OSError("injected fetch fault")

    llm.engine.sparse.stage_hooks["select"] = fault
    engine = llm.engine
    ids = prompts(3)
    for rid, p in zip(["a", "bad", "b"], ids, strict=True):
        engine.add_request(p, GREEDY, request_id=rid)
    outs = {}
    deadline = time.time() + 60
    while engine.has_unfinished() and time.time() < deadline:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["bad"].finish_reason == "error"
    assert "prefetch stage 'select'" in outs["bad"].error
    assert "injected fetch fault" in outs["bad"].error
    ref = LLM(model, kv_mode="sparse", top_k=2, predictor="lookahead", prefetch=mode)
    alone = ref.generate([ids[0], ids[2]], GREEDY, use_tqdm=False)
    assert outs["a"].finish_reason == outs["b"].finish_reason == "length"
    # re-seeded after the failed batch step, the others still decode like a clean run
    assert [outs["a"].token_ids, outs["b"].token_ids] == [o.token_ids for o in alone]
    # the engine goes on serving
    assert llm.generate([ids[0]], GREEDY, use_tqdm=False)[0].finish_reason == "length"
    llm.close()
    ref.close()


def test_trace_has_a_track_per_stage_and_the_foreground(model, tmp_path):
    llm = LLM(model, kv_mode="sparse", top_k=2, predictor="lookahead", prefetch="async")
    tracer = llm.engine.trace()
    llm.generate(prompts(2), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                 use_tqdm=False)
    llm.close()
    path = tmp_path / "trace.json"
    tracer.write(path)
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"predict", "select", "remote", "local", "fill", "foreground"} <= tracks
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)
    assert any(e["name"].startswith("L3 step") for e in spans)


def test_f_hbm_auto_picks_the_cap_whose_fetches_fit_in_a_forward_pass(model):
    """cap = int(bandwidth * forward time / bytes of one cap unit), clamped to [1, top_k]; a
    unit is one block's K and V in every layer and KV head of each decoding request."""
    top_k = 512  # far above the cap set below: the formula decides, not the clamp
    llm = LLM(model, kv_mode="sparse", top_k=top_k, f_hbm="auto")
    sparse, mc = llm.engine.sparse, llm.engine.model_config
    unit = 2 * 16 * mc.head_dim * 4 * mc.num_layers * mc.num_kv_heads  # fp32, block_size 16
    assert sparse.cap.bandwidth > 0
    one = prompts(1)
    llm.generate(one, GREEDY, use_tqdm=False)  # one request: one unit per cap
    assert sparse.cap.forward_s > 0
    assert llm.stats()["fetch_cap"] == max(1, min(top_k, int(
        sparse.cap.bandwidth * sparse.cap.forward_s / unit)))
    # a bandwidth at which the cap is 16 at the current forward time; one decode step moves
    # the forward time's moving average (0.8 old + 0.2 new) by far less than 32x
    sparse.cap.bandwidth = 16 * unit / sparse.cap.forward_s
    llm.generate(one, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)  # a prefill step, then one decode step
    cap = llm.stats()["fetch_cap"]
    assert cap == int(sparse.cap.bandwidth * sparse.cap.forward_s / unit)
    assert 12 <= cap < top_k
    with pytest.raises(ValueError, match="f_hbm must be"):
        LLM(model, kv_mode="sparse", f_hbm="sometimes")
    llm.close()
