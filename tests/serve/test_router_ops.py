"""The router's operations side, with real processes on loopback (a Mooncake master, a storage
node, one prefill and one decode worker): its /metrics, the workers' pages re-labelled with
`worker` and `role` beside its own counters, parsed by prometheus-client's parser and checked
against each worker's own page; a worker that is down is left out, never failing the scrape;
and `POST /admin/workers` adding a decode worker started after the router, which then serves
(refused without the workers' token; bad input a 400 naming the problem)."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import needs_mooncake
from pd_cluster import TOKEN, live_router, start_worker, wait_healthy
from prometheus_client.parser import text_string_to_metric_families

from oasiskv.store.mooncake import free_port, start_master
from oasiskv.store.store_node import StoreNode

pytestmark = needs_mooncake
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(90)]
N = 24  # output tokens per request (ignore_eos)


@pytest.fixture(scope="module")
def cluster(tiny_llama, mooncake_net):
    with start_master(client_ttl_s=2, lease_ttl_ms=500) as master, \
            StoreNode(master.address, 256 << 20):
        workers = {"prefill": start_worker("prefill", tiny_llama, master),
                   "decode": start_worker("decode", tiny_llama, master, f_host=0.25)}
        try:
            wait_healthy(list(workers.values()))
            yield {"master": master, "model": tiny_llama, **workers}
        finally:
            for w in workers.values():
                w.stop()


def samples(text: str) -> dict[tuple, float]:
    """A /metrics page through prometheus-client's parser: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def of_worker(page: dict[tuple, float], url: str, role: str) -> dict[tuple, float]:
    """The worker's samples on the router's page, those labels taken off (the router's own
    series about the worker left aside)."""
    out = {}
    for (name, labels), value in page.items():
        if name.startswith("oasiskv_router:"):
            continue
        d = dict(labels)
        if d.pop("worker", None) == url and d.pop("role", None) == role:
            out[(name, tuple(sorted(d.items())))] = value
    return out


def value(page: dict[tuple, float], name: str, **labels: str) -> float:
    return page[(name, tuple(sorted(labels.items())))]


def settled(url: str) -> dict[tuple, float]:
    """A worker's own page once it is idle and its engine loop has published its last step
    (outputs reach clients before the loop's gauges are set): two pages alike, in a row."""
    last, end = None, time.monotonic() + 30
    while True:
        page = samples(httpx.get(url + "/metrics").text)
        if page == last and page[("oasiskv:num_requests_running", ())] == 0:
            return page
        assert time.monotonic() < end, "the worker did not settle"
        last = page
        time.sleep(0.1)


def scrape_until(http: httpx.Client, condition) -> dict[tuple, float]:
    """The router's page once `condition(page)` holds (the loops publish between steps)."""
    end = time.monotonic() + 10
    while not condition(page := samples(http.get("/metrics").text)):
        assert time.monotonic() < end, "timed out waiting on the router's /metrics"
        time.sleep(0.02)
    return page


def body(model: str, **kw) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "ignore_eos": True, **kw}


def test_router_metrics_are_the_workers_pages_labelled_and_move_with_requests(cluster):
    p, d = cluster["prefill"], cluster["decode"]
    dead = f"http://127.0.0.1:{free_port()}"  # a decode worker that never answers
    gen = "oasiskv:generation_tokens_total"
    with live_router([p.url], [d.url, dead]) as router:
        http = router.http()
        model = http.get("/v1/models").json()["data"][0]["id"]
        first = samples(http.get("/metrics").text)
        assert value(first, "oasiskv_router:worker_up", worker=dead, role="decode") == 0
        assert value(first, "oasiskv_router:worker_up", worker=d.url, role="decode") == 1
        assert value(first, "oasiskv_router:worker_up", worker=p.url, role="prefill") == 1
        assert not of_worker(first, dead, "decode")  # left out
        before = value(first, gen, worker=d.url, role="decode")

        with http.stream("POST", "/v1/completions",
                         json=body(model, max_tokens=400, stream=True)) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            mid = scrape_until(http, lambda m: value(  # the request is decoding now
                m, "oasiskv:num_requests_running", worker=d.url, role="decode") == 1)
            assert value(mid, "oasiskv:num_requests_running", worker=p.url, role="prefill") == 0
            assert before < value(mid, gen, worker=d.url, role="decode") < before + 400
            assert [line for line in lines if line][-1] == "data: [DONE]"
        r = http.post("/v1/completions", json=body(model))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == N

        own = {w.url: settled(w.url) for w in (p, d)}
        end = samples(http.get("/metrics").text)
        # every token of both requests counted by the decode worker, as the router shows it
        assert value(end, gen, worker=d.url, role="decode") == before + 400 + N
        assert value(end, "oasiskv:num_requests_running", worker=d.url, role="decode") == 0
        assert value(end, "oasiskv:sparse_handoff_bytes_total", worker=d.url, role="decode") > 0
        skips = [value(m, "oasiskv_router:worker_scrapes_skipped_total", worker=dead,
                       role="decode") for m in (first, mid, end)]
        assert skips[0] == 1 and skips[0] < skips[1] < skips[2] == skips[1] + 1  # one a scrape
        assert value(end, "oasiskv_router:requests_total", outcome="routed") == 2
        # idle now: the router's copy of each worker's page is that page, sample for sample
        for w in (p, d):
            assert of_worker(end, w.url, w.role) == own[w.url]
            assert own[w.url][(gen, ())] == value(end, gen, worker=w.url, role=w.role)


def test_admin_adds_a_worker_started_after_the_router(cluster):
    p = cluster["prefill"]
    with live_router([p.url], []) as router:
        http = router.http()
        model = http.get("/v1/models").json()["data"][0]["id"]
        r = http.post("/v1/completions", json=body(model))
        assert r.status_code == 503 and "no decode worker is up" in r.text

        late = start_worker("decode", cluster["model"], cluster["master"], f_host=0.25)
        try:
            wait_healthy([late])
            add = {"role": "decode", "url": late.url}
            for headers in ({}, {"X-OasisKV-Worker-Token": "not-" + TOKEN}):
                r = http.post("/admin/workers", json=add, headers=headers)
                assert r.status_code == 401 and "X-OasisKV-Worker-Token" in r.text
            auth = {"X-OasisKV-Worker-Token": TOKEN}
            for bad, words in (({"role": "router", "url": late.url}, "role: Input should be"),
                               ({"role": "decode"}, "url: Field required"),
                               ({"role": "decode", "url": "127.0.0.1:1"}, "http://HOST:PORT"),
                               ({"role": "decode", "url": p.url}, "already a prefill worker"),
                               ({"role": "decode", "url": late.url, "x": 1},
                                "unsupported parameter 'x'"),
                               ([late.url], "Input should be a valid dictionary")):
                r = http.post("/admin/workers", json=bad, headers=auth)
                assert r.status_code == 400 and words in r.json()["error"]["message"], bad
            r = http.post("/admin/workers", content=b"decode please", headers=auth)
            assert r.status_code == 400 and "must be JSON" in r.json()["error"]["message"]
            assert [w["url"] for w in http.get("/workers").json()["workers"]] == [p.url]

            r = http.post("/admin/workers", json=add, headers=auth)
            assert r.status_code == 200 and r.json()["healthy"], r.text
            r = http.post("/v1/completions", json=body(model))
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == N
            own = samples(httpx.get(late.url + "/metrics").text)
            assert own[("oasiskv:generation_tokens_total", ())] == N  # it served the request
        finally:
            late.stop()
