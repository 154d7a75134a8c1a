"""Disaggregated serving with real processes on loopback (a private network namespace where
the kernel allows it): a Mooncake master and a storage node, two prefill and two decode workers
(`oasiskv serve --role`), routers in front of 1 prefill + 2 decode and 2 prefill + 1 decode.

Checked against a single-node `oasiskv serve` with the same sparse settings: greedy outputs
equal for every transfer mode, streamed and not; the same error answers; the store empty after
the requests end. Then failures: a decode worker killed mid-stream fails only its request,
within the router's deadline, and the next request is served; a dead prefill worker's request
goes to the other one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import needs_mooncake
from live import live_server
from pd_cluster import (
    SPARSE,
    TOKEN,
    counter,
    live_router,
    start_worker,
    store_leftovers,
    wait_healthy,
)

from oasiskv.serve import pd_launch as launch
from oasiskv.store.mooncake import free_port, start_master
from oasiskv.store.store_node import StoreNode

pytestmark = needs_mooncake
PROMPTS = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (200, 90)]
ENTRY_BLOCKS = 2  # store blocks of one prefix-cache entry: the tiny model's 2 layers
PREFIX_CACHE = 4 * ENTRY_BLOCKS * 2 * 2 * 16 * 16 * 4  # 4 prompt blocks' K/V per prefill worker
GREEDY = dict(temperature=0, max_tokens=24, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def cluster(tiny_llama, mooncake_net):
    """{'master', 'prefill': [p1, p2], 'decode': [d1, d2]} (processes), with its own master
    so that the store's contents are this module's alone."""
    with start_master(client_ttl_s=2, lease_ttl_ms=500) as master, \
            StoreNode(master.address, 256 << 20):
        workers = {"prefill": [start_worker("prefill", tiny_llama, master,
                                            prefix_cache_bytes=PREFIX_CACHE) for _ in range(2)],
                   "decode": [start_worker("decode", tiny_llama, master, f_host=0.25)
                              for _ in range(2)]}
        try:
            wait_healthy(workers["prefill"] + workers["decode"])
            yield {"master": master, **workers}
        finally:
            for w in workers["prefill"] + workers["decode"]:
                w.stop()


@pytest.fixture(scope="module")
def single(tiny_llama):
    """The reference: one `oasiskv serve` (the same sparse settings, no remote store)."""
    with live_server(tiny_llama, **SPARSE) as live:
        yield live


def urls(ws) -> list[str]:
    return [w.url for w in ws]


def answers(client: openai.OpenAI, model: str) -> dict:
    batch = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
    stream = client.completions.create(model=model, prompt=PROMPTS[0], stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    return {"texts": [c.text for c in batch.choices],
            "reasons": [c.finish_reason for c in batch.choices], "usage": batch.usage,
            "streamed": "".join(c.choices[0].text for c in chunks if c.choices),
            "stream_usage": chunks[-1].usage}


@pytest.mark.parametrize("transfer", ["partial", "slab", "full"])
def test_router_answers_as_one_serve_for_each_transfer(cluster, single, transfer):
    want = answers(single.client(), single.state.model_name)
    assert want["reasons"] == ["length", "length"]
    layouts = {"1P+2D": (cluster["prefill"][:1], cluster["decode"]),
               "2P+1D": (cluster["prefill"], cluster["decode"][:1])}
    for name, (prefill, decode) in layouts.items():
        with live_router(urls(prefill), urls(decode), transfer) as router:
            got = answers(router.client(), single.state.model_name)
            assert got == want, name
            used = {w["url"] for w in router.http().get("/workers").json()["workers"]
                    if w["load"].get("transfer")}
            assert used == set(urls(prefill) + urls(decode))  # all reported their load
    assert store_leftovers(cluster["master"]) == 0  # finished requests left nothing


def test_errors_are_the_ones_serve_gives(cluster, single):
    model = single.state.model_name
    bodies = [{"model": model, "prompt": "hi", "max_tokens": 0},
              {"model": "nope", "prompt": "hi"},
              {"model": model, "prompt": "hi", "frequency_penalty": 1.0},
              {"model": model, "prompt": "hi", "bogus": 1},
              {"model": model, "prompt": [1] * 600}]  # past the context
    with live_router(urls(cluster["prefill"][:1]), urls(cluster["decode"][:1])) as router:
        for body in bodies:
            want = single.http().post("/v1/completions", json=body)
            got = router.http().post("/v1/completions", json=body)
            assert (got.status_code, got.json()) == (want.status_code, want.json()), body
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        got = router.http().post("/v1/chat/completions", json=chat)  # no template here
        assert got.status_code == 400 and "chat template" in got.json()["error"]["message"]
        assert router.http().get("/v1/models").json()["data"][0]["id"] == model
        # the workers answer only the router's token
        bare = httpx.post(cluster["decode"][0].url + "/internal/decode", json={})
        assert bare.status_code == 401
        wrong = httpx.get(cluster["prefill"][0].url + "/internal/load",
                          headers={"Authorization": "Bearer not-" + TOKEN})
        assert wrong.status_code == 401


def test_router_command_serves_and_a_closed_stream_aborts_on_the_worker(cluster, single):
    """`oasiskv router` as its own process; a client that leaves mid-stream cancels the
    request on the decode worker that holds it."""
    model = single.state.model_name
    port = free_port()
    decode = cluster["decode"][0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "oasiskv.cli", "router", "--port", str(port), "--prefill",
         cluster["prefill"][0].url, "--decode", decode.url],
        env=dict(os.environ, OASISKV_WORKER_TOKEN=TOKEN), stderr=subprocess.PIPE, text=True)
    try:
        assert "oasiskv router: 1 prefill, 1 decode workers" in proc.stderr.readline()
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 30
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < end
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        want = single.client().completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
        got = client.completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
        assert got.choices[0].text == want.choices[0].text

        def aborted() -> float:
            text = httpx.get(decode.url + "/metrics").text
            return sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith('oasiskv:request_finished_total{finished_reason="abort"'))

        before = aborted()
        stream = client.completions.create(model=model, prompt=PROMPTS[1], stream=True,
                                           max_tokens=400, temperature=0,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()  # the client leaves
        end = time.monotonic() + 10
        while aborted() == before:
            assert time.monotonic() < end, "the decode worker never aborted the request"
            time.sleep(0.05)
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_a_shared_prefix_is_reused_through_another_prefill_worker(cluster, single):
    """2 prefill + 1 decode: the first request's prompt blocks stay in the store's prefix cache
    after it ends (as many as its prefill worker's capacity holds: 4 blocks); the next request
    with the same first 80 tokens goes to the other prefill worker (the router counts the
    first one busier), which reads those 64 tokens' K/V from the store instead of computing
    them. The answers are a single `oasiskv serve`'s; the store keeps nothing of the requests
    but prefix-cache entries within the two workers' capacities."""
    model = single.state.model_name
    store_leftovers(cluster["master"])  # what the tests before left in the prefix cache
    shared = [(11 * i + 5) % 290 + 3 for i in range(80)]  # 5 complete blocks
    prompts = [shared + [(13 * i + 1) % 280 + 3 for i in range(30)],
               shared + [(17 * i + 2) % 280 + 3 for i in range(25)]]
    want = [single.client().completions.create(model=model, prompt=p, **GREEDY).choices[0].text
            for p in prompts]
    first, second = cluster["prefill"]
    name = "oasiskv:prefix_reused_tokens_total"
    reused = {w.url: counter(w.url, name) for w in (first, second)}
    # no polls after the first: each request adds its prompt to its worker's count
    with live_router(urls(cluster["prefill"]), urls(cluster["decode"][:1]),
                     interval_s=3600) as router:
        for p, text in zip(prompts, want, strict=True):
            got = router.client().completions.create(model=model, prompt=p, **GREEDY)
            assert got.choices[0].text == text
    assert counter(first.url, name) - reused[first.url] == 0
    assert counter(second.url, name) - reused[second.url] == 64  # the 4 cached blocks
    assert counter(first.url, "oasiskv:prefix_cache_bytes") == PREFIX_CACHE
    entries = []
    assert store_leftovers(cluster["master"], entries) == 0  # nothing of the requests
    # the first worker's 4 entries, and the second's 2 (blocks 4 and 5 of its prompt)
    assert entries == [(4 + 2) * ENTRY_BLOCKS]


@pytest.mark.parametrize("args, words", [
    (["router", "--prefill", "http://a:1", "--decode", "http://b:2"], "needs the workers' token"),
    (["router", "--worker-token", "t", "--prefill", "a:1"], "must be http://HOST:PORT"),
    (["serve", "--role", "prefill"], "needs the token it shares with the router"),
    (["serve", "--worker-token", "t"], "--worker-token is for a --role worker"),
])
def test_bad_flags_are_one_line_and_exit_2(args, words, capsys, monkeypatch):
    from oasiskv.cli import main

    monkeypatch.delenv("OASISKV_WORKER_TOKEN", raising=False)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def _holder(router, decode) -> object:
    """The decode worker process that holds the router's one request in flight."""
    for w in router.router.pool.of("decode"):
        if w.inflight:
            return next(d for d in decode if d.url == w.url)
    return None


def test_decode_worker_killed_mid_stream_fails_only_its_request(cluster, single):
    model = single.state.model_name
    long = dict(temperature=0, max_tokens=400, extra_body={"ignore_eos": True})
    want_other = single.client().completions.create(model=model, prompt=PROMPTS[0],
                                                    **GREEDY).choices[0].text
    with live_router(urls(cluster["prefill"][:1]), urls(cluster["decode"]),
                     worker_timeout_s=5.0) as router:
        client = router.client()
        stream = client.completions.create(model=model, prompt=PROMPTS[1], stream=True, **long)
        first = next(iter(stream))  # decoding has started on one worker
        victim = _holder(router, cluster["decode"])
        assert victim is not None and first.choices[0].text is not None
        victim.process.send_signal(signal.SIGSTOP)  # mid-stream (the tiny model is quick)
        other = {}
        t = threading.Thread(target=lambda: other.update(text=client.completions.create(
            model=model, prompt=PROMPTS[0], **GREEDY).choices[0].text))
        t.start()  # goes to the other decode worker (the victim's budget is in use)
        victim.kill()
        killed_at = time.monotonic()
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in stream:
                pass
        assert time.monotonic() - killed_at < 10  # within the deadline, no hang
        t.join(120)
        assert other["text"] == want_other  # only its request failed
        again = client.completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
        assert again.choices[0].text == want_other  # the next request is served
        down = [w.url for w in router.router.pool.of("decode") if not w.healthy]
        assert down == [victim.url]
        end = time.monotonic() + 10  # the router drops the failed request's blocks, in the
        while not router.router.dropped._value.get():  # background, through a live worker
            assert time.monotonic() < end, "the router dropped nothing"
            time.sleep(0.05)
    assert store_leftovers(cluster["master"]) == 0


def test_prompt_on_a_dead_prefill_worker_is_retried_on_the_other(cluster, single):
    model = single.state.model_name
    dead, alive = cluster["prefill"][1], cluster["prefill"][0]
    decode = [d for d in cluster["decode"] if d.process.poll() is None]
    want = single.client().completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
    # no polls after the first: the router finds out when it sends the request there
    with live_router([dead.url, alive.url], urls(decode), interval_s=3600) as router:
        assert router.router.pool.pick("prefill").url == dead.url  # the first pick
        dead.kill()
        got = router.client().completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
        assert got.choices[0].text == want.choices[0].text
        pool = {w.url: w for w in router.router.pool.workers}
        assert not pool[dead.url].healthy and pool[alive.url].healthy
        assert router.router.retries._value.get() == 1
        # new prompts go to the live one straight away
        again = router.client().completions.create(model=model, prompt=PROMPTS[0], **GREEDY)
        assert again.choices[0].text == want.choices[0].text
        assert router.router.retries._value.get() == 1
    assert store_leftovers(cluster["master"]) == 0


def test_pd_serve_launches_the_whole_deployment_on_one_machine(tiny_llama, single):
    """`oasiskv pd --serve`: master, storage node, workers and router from one command; the
    router answers as one serve; SIGTERM takes it all down and exits 0."""
    port = free_port()
    args = [sys.executable, "-m", "oasiskv.cli", "pd", "--serve", "--port", str(port),
            "--model", str(tiny_llama), "--decode-workers", "2", "--store-bytes", "128MiB",
            *launch.flags(SPARSE)]
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or "router on" not in lines[-1]:
            line = proc.stderr.readline()
            assert line, "the launcher exited:\n" + "".join(lines)
            lines.append(line)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        model = single.state.model_name
        want = single.client().completions.create(model=model, prompt=PROMPTS, **GREEDY)
        got = client.completions.create(model=model, prompt=PROMPTS, **GREEDY)
        assert [c.text for c in got.choices] == [c.text for c in want.choices]
        workers = httpx.get(f"http://127.0.0.1:{port}/workers").json()["workers"]
        assert sorted(w["role"] for w in workers if w["healthy"]) == ["decode", "decode",
                                                                      "prefill"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
