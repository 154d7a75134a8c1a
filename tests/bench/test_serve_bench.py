"""`oasiskv bench serve`: its figures from hand-computed timestamps (vLLM's definitions), the
seeded Poisson trace, 503s counted apart from failures against a live server, --url with
--max-concurrency 1 against one, an end-to-end run that starts our dense and sparse servers
itself on loopback (every request exactly
--output-len tokens, the JSON whole, the servers stopped gracefully), llama.cpp's
`llama-server` when it is built, and bad input as one line and exit status 2."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import build_model_dir

from oasiskv import LLM, SamplingParams
from oasiskv.bench.serve import parse_rates
from oasiskv.bench.serve_client import (
    RequestResult,
    TraceRequest,
    make_trace,
    poisson_arrivals,
    run_trace,
)
from oasiskv.bench.serve_metrics import Slo, cell_metrics
from oasiskv.bench.servers import ServerSpec, llama_server_binary, parse_servers
from oasiskv.cli import main
from oasiskv.serve.server import ServeOptions

sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))  # the live-server fixtures
from live import live_server  # noqa: E402


def result(index, chunks, e2e, tokens, status=200, error=None) -> RequestResult:
    return RequestResult(index, 0.0, 8, status=status, error=error, chunk_s=chunks, e2e_s=e2e,
                         output_tokens=tokens)


# r0: 4 tokens, TTFT 0.5, TPOT (1.2 - 0.5) / 3; r1: 2 tokens, TPOT 0.1; r2: one token (no
# TPOT, no gap); then a 503, a 500 and a stream that broke after two chunks
RESULTS = [result(0, [0.5, 0.6, 0.8, 1.1], 1.2, 4), result(1, [0.2, 0.25], 0.3, 2),
           result(2, [1.0], 1.0, 1), result(3, [], None, None, 503, "HTTP 503: full"),
           result(4, [], None, None, 500, "HTTP 500: boom"),
           result(5, [0.1, 0.2], 0.3, None, 200, "stream error: engine failed")]


def test_cell_figures_from_hand_computed_timestamps():
    m = cell_metrics(RESULTS, 2.0, Slo())
    assert (m["requests"], m["completed"], m["rejected"], m["failed"]) == (6, 3, 1, 2)
    assert m["request_throughput"] == pytest.approx(3 / 2.0)
    assert m["output_tokens"] == 7 and m["output_throughput"] == pytest.approx(7 / 2.0)
    by_hand = {"ttft_ms": [500, 200, 1000], "tpot_ms": [700 / 3, 100],
               "itl_ms": [100, 200, 300, 50], "e2e_ms": [1200, 300, 1000]}
    for key, values in by_hand.items():
        d = m[key]
        assert d["n"] == len(values), key
        assert d["mean"] == pytest.approx(np.mean(values)), key
        for name, q in (("p50", 50), ("p90", 90), ("max", 100)):
            assert d[name] == pytest.approx(np.percentile(values, q)), (key, name)
    assert m["ttft_ms"]["p90"] == pytest.approx(900)  # 500 + 0.8 * (1000 - 500)
    assert "goodput" not in m  # no SLO given


@pytest.mark.parametrize("slo, good", [
    (Slo(tpot_ms=200), 2),  # r0's TPOT 233 ms breaks it; r2 has no TPOT to break
    (Slo(tpot_ms=250, ttft_ms=400), 1),  # r0 and r2 start too late
    (Slo(e2e_ms=1100), 2),  # r0 ends too late
    (Slo(tpot_ms=1e9, ttft_ms=1e9, e2e_ms=1e9), 3),  # every completed request; never a failed one
])
def test_goodput_counts_requests_meeting_every_slo(slo, good):
    m = cell_metrics(RESULTS, 2.0, slo)
    assert m["good"] == good and m["goodput"] == pytest.approx(good / 2.0)
    if slo.tpot_ms is not None:  # TPOT p90 over [233.3, 100]: 100 + 0.9 * 133.3 = 220
        assert m["tpot_p90_meets_slo"] == (220 <= slo.tpot_ms)


def test_poisson_trace_is_seeded_and_has_the_mean_rate():
    t = poisson_arrivals(20001, 4.0, seed=3)
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(1 / 4.0, rel=0.03)  # 20000 gaps: sd of the mean 0.7 %
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert np.array_equal(t, poisson_arrivals(20001, 4.0, seed=3))
    assert not np.array_equal(t[:50], poisson_arrivals(50, 4.0, seed=4))
    assert (poisson_arrivals(5, math.inf, seed=3) == 0).all()
    with pytest.raises(ValueError, match="positive"):
        poisson_arrivals(5, 0.0, seed=3)
    trace = make_trace([[1], [2], [3]], 2.0, seed=1)
    assert [r.prompt for r in trace] == [[1], [2], [3]] and [r.index for r in trace] == [0, 1, 2]
    assert [r.arrival_s for r in trace] == list(poisson_arrivals(3, 2.0, seed=1))


def test_server_and_rate_lists():
    specs = parse_servers("dense,sparse:top_k=64,f_hbm=0.1,sparse,llama-server")
    assert specs == [ServerSpec("dense"), ServerSpec("sparse", (("top_k", "64"), ("f_hbm", "0.1"))),
                     ServerSpec("sparse"), ServerSpec("llama-server")]
    assert [s.label for s in specs] == ["dense", "sparse:top_k=64,f_hbm=0.1", "sparse",
                                        "llama-server"]
    assert parse_rates("0.5, 2,inf") == [0.5, 2.0, math.inf]
    for bad, why in (("dense,vllm", "unknown server 'vllm'"), ("sparse:nope=1", "unknown key"),
                     ("sparse:top_k=x", "expected an integer"), ("dense:top_k=2", "no options"),
                     ("top_k=2", "without a sparse"), ("dense,dense", "dense twice"),
                     ("sparse:kv_mode=dense", "kv_mode"), (",", "no server")):
        with pytest.raises(ValueError, match=why):
            parse_servers(bad)
    for bad in ("fast", "0,1", "-1", "", "1,1", "nan"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_rates(bad)


PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def eos_first(tmp_path_factory):
    """The tiny model again (same seed, same weights) with its greedy first token after PROMPT
    made the EOS token: without ignore_eos every answer to PROMPT is one token long."""
    base = build_model_dir(tmp_path_factory.mktemp("tiny"), "llama")
    llm = LLM(str(base), num_threads=1, device_kv_budget="1MiB")
    first = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)[0].token_ids[0]
    llm.close()
    return build_model_dir(tmp_path_factory.mktemp("tiny_eos"), "llama", eos_token_id=first)


def test_503s_are_counted_apart_from_failures(eos_first):
    """One request runs (max_num_seqs 1, steps of 0.2 s: it takes 0.8 s) and one may wait
    (--max-waiting 1): of five more sent together at 0.3 s, one waits and four are turned away
    with 503; none fails. Both answered in full although their first token is EOS."""
    with live_server(eos_first, ServeOptions(max_waiting=1), max_num_seqs=1) as live:
        live.slow_steps(0.2)
        trace = [TraceRequest(i, PROMPT, 0.0 if i == 0 else 0.3) for i in range(6)]
        results, duration = asyncio.run(run_trace(live.url, live.state.model_name, trace, 4))
        live.wait_idle()
    m = cell_metrics(results, duration, Slo(tpot_ms=1e9))
    assert (m["completed"], m["rejected"], m["failed"]) == (2, 4, 0)
    assert m["good"] == 2  # a 503 is never good
    assert all(r.output_tokens == 4 for r in results if r.ok)
    assert all("HTTP 503" in r.error for r in results if r.rejected)


def test_url_of_a_running_server_with_max_concurrency(tiny_llama, tmp_path):
    """--url: a server the bench did not start (the model only gives the tokenizer);
    --max-concurrency 1 sends each request only after the one before has ended."""
    out = tmp_path / "u.json"
    with live_server(tiny_llama) as live:
        assert main(["bench", "serve", "--url", live.url, "--model", str(tiny_llama),
                     "--input-len", "16", "--output-len", "4", "--num-prompts", "3",
                     "--request-rate", "inf", "--max-concurrency", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (cell,) = data["cells"]
    assert data["servers"] == [live.url] and cell["server"] == live.url
    assert (cell["completed"], cell["max_concurrency"]) == (3, 1)
    reqs = sorted(cell["per_request"], key=lambda r: r["sent_s"])
    for a, b in zip(reqs, reqs[1:], strict=False):
        assert b["sent_s"] >= a["sent_s"] + a["e2e_s"]


def test_end_to_end_dense_and_sparse_servers_started_here(tiny_llama, tmp_path, capsys):
    out, png, logs = tmp_path / "s.json", tmp_path / "s.png", tmp_path / "logs"
    pareto = tmp_path / "pareto.json"  # accuracy by bench pareto's configuration names
    pareto.write_text(json.dumps({"rows": [
        {"setting": "dense", "accuracy": 90.0},
        {"setting": "sparse K=2 lookahead host_kv_budget=1048576", "accuracy": 80.0},
        {"setting": "sparse K=2 lookahead", "accuracy": 70.0}]}))
    argv = ["bench", "serve", "--model", str(tiny_llama), "--servers",
            "dense,sparse:top_k=2,host_kv_budget=1MiB", "--input-len", "32", "--output-len", "6",
            "--num-prompts", "3", "--request-rate", "20,inf", "--max-num-seqs", "4",
            "--device-kv-budget", "1MiB", "--dtype", "float32", "--num-threads", "1",
            "--slo-tpot-x-dense-1", "2", "--slo-calibration-requests", "2",
            "--json", str(out), "--plot", str(png), "--log-dir", str(logs),
            "--pareto-json", str(pareto)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["complete"] and not data["errors"]
    assert data["request_rates"] == [20.0, "inf"]
    cal = data["calibration"]
    assert cal["server"] == "dense" and cal["tpot_ms"]["n"] == 2
    assert data["slo"]["tpot_ms"] == pytest.approx(2 * cal["tpot_ms"]["p50"])
    cells = data["cells"]
    assert [(c["server"], c["rate"]) for c in cells] == [
        ("dense", 20.0), ("dense", "inf"), ("sparse:top_k=2,host_kv_budget=1MiB", 20.0),
        ("sparse:top_k=2,host_kv_budget=1MiB", "inf")]
    assert [c["accuracy"] for c in cells] == [90.0, 90.0, 80.0, 80.0]
    prompts = {}
    for c in cells:
        assert (c["requests"], c["completed"], c["failed"], c["rejected"]) == (3, 3, 0, 0)
        assert c["output_tokens"] == 18 and c["ttft_ms"]["n"] == c["tpot_ms"]["n"] == 3
        slo = data["slo"]["tpot_ms"]  # good: the requests whose own TPOT meets the SLO
        assert c["good"] == sum(1e3 * r["tpot_s"] <= slo for r in c["per_request"])
        assert c["tpot_p90_meets_slo"] == (c["tpot_ms"]["p90"] <= slo)
        for r in c["per_request"]:
            assert r["ok"] and r["output_tokens"] == 6 and r["usage_prompt_tokens"] == 32
            assert 1 <= len(r["chunk_s"]) <= 6 and r["ttft_s"] == r["chunk_s"][0]
        prompts.setdefault(c["rate"], []).append([r["arrival_s"] for r in c["per_request"]])
    # each rate's trace is the same for both servers; inf sends everything at once
    assert prompts[20.0][0] == prompts[20.0][1] and prompts["inf"][0] == [0.0] * 3
    assert png.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| dense | 90 | 20 | 3/3 |" in printed and "| sparse:top_k=2,host_kv_budget=1MiB |" \
        in printed
    for log in logs.iterdir():  # SIGTERM: uvicorn's graceful shutdown, the lifespan's end
        assert "Application shutdown complete" in log.read_text(), log.name


def _llama_server_or_skip() -> str:
    from oasiskv.models.registry import resolve_model

    try:
        llama_server_binary()
        resolve_model("smollm2-135m")
    except ValueError as e:
        pytest.skip(str(e))
    return "smollm2-135m"


def test_end_to_end_llama_server(tmp_path):
    model = _llama_server_or_skip()
    out = tmp_path / "l.json"
    assert main(["bench", "serve", "--model", model, "--servers", "llama-server",
                 "--input-len", "64", "--output-len", "8", "--num-prompts", "3",
                 "--request-rate", "inf", "--max-num-seqs", "2", "--num-threads", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert not data["errors"]
    (cell,) = data["cells"]
    assert (cell["server"], cell["completed"], cell["failed"]) == ("llama-server", 3, 0)
    assert [r["output_tokens"] for r in cell["per_request"]] == [8] * 3
    assert [r["usage_prompt_tokens"] for r in cell["per_request"]] == [64] * 3


@pytest.mark.parametrize("args, why", [
    (["--servers", "dense,vllm"], "unknown server 'vllm'"),
    (["--servers", "sparse:top_k=64,nope=1"], "unknown key 'nope'"),
    (["--request-rate", "1,fast"], "--request-rate takes positive numbers"),
    (["--input-len", "0"], "--input-len must be at least 1"),
    (["--servers", "sparse,dense", "--slo-tpot-x-dense-1", "2"], "must be dense"),
    (["--slo-tpot-ms", "50", "--slo-tpot-x-dense-1", "2"], "not both"),
    (["--slo-ttft-ms", "-5"], "--slo-ttft-ms must be a positive number"),
    (["--servers", "dense", "--pareto-json", "/nonexistent.json"], "not a bench pareto JSON"),
    (["--servers", "llama-server", "--llama-server", "/nonexistent/llama-server"],
     "no llama-server at /nonexistent/llama-server"),
])
def test_bad_input_is_one_line_and_exit_2(args, why, tiny_llama, capsys):
    assert main(["bench", "serve", "--model", str(tiny_llama), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("oasiskv: error:") and why in err and err.count("\n") == 1, err
