"""Under load and at the edges of a request's life: 32 concurrent streams (continuous batching
over HTTP, none lost, each its offline greedy text), a client that leaves mid-stream (its
blocks freed, seen on /metrics), /metrics parsed by prometheus-client and moving, and the sparse
engine served."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import requests_in

from oasiskv import LLM, SamplingParams
from oasiskv.serve.server import ServeOptions

pytest_plugins = ["live"]

GREEDY = dict(temperature=0, max_tokens=16, extra_body={"ignore_eos": True})
SPARSE = dict(kv_mode="sparse", top_k=3, host_kv_budget="1MiB")
REMOTE = dict(SPARSE, remote_store="inprocess://{}", f_host=0.5)  # {}: a store per engine


def test_32_concurrent_streams_each_equal_its_offline_greedy_run(live, ref):
    prompts = [f"{w} number {i}" for i, w in enumerate(["The quick", "It is a", "Numbers"] * 11)]
    prompts = prompts[:32]
    want = ref.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    before = live.metrics()

    async def one(client, prompt):
        text, reasons = "", []
        stream = await client.completions.create(model=live.state.model_name, prompt=prompt,
                                                 stream=True, **GREEDY)
        async for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        return text, reasons[-1]

    async def all_of_them():
        client = live.async_client()
        return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(all_of_them())
    assert [g[0] for g in got] == [w.text for w in want]
    assert all(g[1] == "length" for g in got)
    after = live.wait_idle()
    key = "oasiskv:request_finished_total{finished_reason=length}"
    assert after[key] - before.get(key, 0) == 32
    # max_num_seqs=8: the 32 requests waited their turn and joined the batch between steps
    assert after["oasiskv:time_to_first_token_seconds_count"] - \
        before["oasiskv:time_to_first_token_seconds_count"] == 32


def test_metrics_parse_and_move_as_a_request_runs(live, ref):
    prompt = "It is a truth universally"
    n_prompt = len(ref.tokenizer.encode(prompt))
    before = live.metrics()
    r = live.client().completions.create(model=live.state.model_name, prompt=prompt,
                                         max_tokens=7, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7
    after = live.wait_idle()

    def moved(name):
        return after[name] - before.get(name, 0)

    assert moved("oasiskv:prompt_tokens_total") == n_prompt
    assert moved("oasiskv:generation_tokens_total") == 7
    assert moved("oasiskv:time_to_first_token_seconds_count") == 1
    assert moved("oasiskv:inter_token_latency_seconds_count") == 6  # between 7 tokens
    assert moved("oasiskv:time_per_output_token_seconds_count") == 1
    assert moved("oasiskv:e2e_request_latency_seconds_count") == 1
    assert moved("oasiskv:request_finished_total{finished_reason=length}") == 1
    assert moved("oasiskv:e2e_request_latency_seconds_sum") >= \
        moved("oasiskv:time_to_first_token_seconds_sum") > 0
    assert after["oasiskv:kv_device_bytes_budget"] == 2**20
    assert after["oasiskv:kv_device_bytes_used"] == 0


@pytest.mark.parametrize("mode", ["dense", "sparse", "sparse+remote"])
def test_a_client_that_leaves_mid_stream_frees_its_blocks(start_server, mode):
    config = {"dense": {}, "sparse": SPARSE,
              "sparse+remote": {**REMOTE, "remote_store": "inprocess://leaves"}}[mode]
    with start_server(**config) as live:
        live.slow_steps(0.02)
        body = {"model": live.state.model_name, "prompt": "The quick brown fox " * 4,
                "max_tokens": 300, "stream": True, "ignore_eos": True}
        with live.http() as h, h.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(lines)
            busy = live.metrics()
            assert busy["oasiskv:num_requests_running"] == 1
            assert busy["oasiskv:kv_device_bytes_used"] > 0
            if mode != "dense":
                assert busy["oasiskv:kv_host_bytes_used"] > 0
            if mode == "sparse+remote":  # its prompt blocks went to the store
                assert live.llm.engine.sparse.remote.store.namespaces()
        # the client is gone: the request leaves the batch at the next step, blocks freed
        m = live.wait_idle()
        assert m["oasiskv:request_finished_total{finished_reason=abort}"] == 1
        assert m["oasiskv:kv_device_bytes_used"] == 0
        assert m["oasiskv:kv_host_bytes_used"] == 0
        assert m["oasiskv:generation_tokens_total"] < 300
        live.llm.engine.check_invariants()  # nothing leaked: pools, store namespaces
        if mode == "sparse+remote":
            assert not requests_in(live.llm.engine.sparse.remote.store)
        live.llm.engine.step_hooks.clear()
        r = live.client().completions.create(model=live.state.model_name, prompt="hi",
                                             max_tokens=3)  # and it serves on
        assert r.usage.completion_tokens <= 3


@pytest.mark.parametrize("config", ["sparse", "sparse+remote", "speculative"])
def test_engine_configs_served_equal_offline(start_server, tiny_llama, config):
    """What the library runs, the server runs: sparse, sparse over a remote store (its own
    store per engine), speculative acceptance."""
    kw = {"sparse": SPARSE, "sparse+remote": REMOTE, "speculative": {"speculative": "accept"}}
    kw = kw[config]

    def named(who):  # the server and the reference each get their own in-process store
        return {k: v.format(who) if k == "remote_store" else v for k, v in kw.items()}

    ref = LLM(str(tiny_llama), num_threads=1, device_kv_budget="1MiB", **named("ref"))
    prompt = "Elizabeth and Darcy walked " * 12  # more blocks than top_k: a working set
    want = ref.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0]
    ref.close()
    with start_server(**named("served")) as live:
        r = live.client().completions.create(model=live.state.model_name, prompt=prompt,
                                             **GREEDY)
        assert r.choices[0].text == want.text
        m = live.wait_idle()
        if config == "speculative":
            assert live.llm.stats()["spec_accepted"] == want.metrics.num_drafts_right
            return
        assert m["oasiskv:sparse_blocks_predicted_total"] > 0
        assert m["oasiskv:sparse_h2d_bytes_total"] > 0
        assert 0 <= m["oasiskv:sparse_hit_rate"] <= 1
        assert m["oasiskv:sparse_block_hits_total"] <= m["oasiskv:sparse_blocks_predicted_total"]
        assert m["oasiskv:kv_host_bytes_budget"] == 2**20
        if config == "sparse+remote":
            assert m["oasiskv:sparse_store_to_host_bytes_total"] == \
                live.llm.stats()["remote_bytes"] > 0


def test_long_waits_get_keepalive_comments_and_a_stream_that_started(start_server):
    with start_server(ServeOptions(sse_keepalive=0.05)) as live:
        live.slow_steps(0.3)  # each token takes several keep-alive periods
        body = {"model": live.state.model_name, "prompt": "hi", "max_tokens": 3,
                "stream": True, "ignore_eos": True}
        with live.http().stream("POST", "/v1/completions", json=body) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert lines[0] == ": keep-alive"  # the stream started before the first token
        assert lines[-1] == "data: [DONE]"
        assert lines.count(": keep-alive") >= 3  # one per period of each step, roughly
        assert all(line == ": keep-alive" or line.startswith("data: ") for line in lines)


def test_a_non_streaming_client_that_leaves_is_aborted(start_server):
    with start_server() as live:
        live.slow_steps(0.05)
        body = {"model": live.state.model_name, "prompt": "hi", "max_tokens": 300,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
            live.http(timeout=0.5).post("/v1/completions", json=body)
        m = live.wait_idle()  # seen within a poll (DISCONNECT_POLL_S), not after 300 tokens
        assert m["oasiskv:request_finished_total{finished_reason=abort}"] == 1
        assert m["oasiskv:generation_tokens_total"] < 300
        assert m["oasiskv:kv_device_bytes_used"] == 0
