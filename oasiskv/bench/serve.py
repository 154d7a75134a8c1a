"""`oasiskv bench serve`: one request trace replayed over HTTP against each server, shaped like
vLLM's serving benchmark (`vllm bench serve`).

The servers in --servers are started here on loopback, one at a time (`bench/servers.py`): our
dense and sparse engines under `oasiskv serve`, and llama.cpp's own `llama-server` on the same
GGUF; --url points it at one it did not start. Every server gets the same trace
(`bench/serve_client.py`): per --request-rate, --num-prompts unique Austen prompts of
--input-len tokens arriving as a seeded Poisson process, each generating --output-len tokens
(ignore_eos); no prompt is sent twice to a server, so no prompt cache helps. Or, with
--shared-prefix-fraction h, the paper's prefill-decode workload (`bench/serve_workload.py`):
groups of --group-size prompts sharing their first h, one per group sent first to warm the
store. A cell (server, rate) reports the figures of `bench/serve_metrics.py` and, while its
trace runs, the bytes reaching the decode side from the store in each 1 s window
(`bench/serve_bytes.py`), written to --json as it completes.

The SLO is fixed before the sweep: by flags, or by --slo-tpot-x-dense-1 X as X times the TPOT
of the first server (dense) with one request in flight, measured first in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from oasiskv.bench.common import print_model_note, unique_prompts
from oasiskv.bench.serve_bytes import ByteSampler
from oasiskv.bench.serve_client import make_trace, run_trace, served_model
from oasiskv.bench.serve_metrics import Slo, cell_metrics, distribution
from oasiskv.bench.serve_report import report
from oasiskv.bench.serve_workload import check_groups, make_workload, passages_needed
from oasiskv.bench.servers import (
    KINDS,
    RunningServer,
    ServerSettings,
    parse_servers,
    server_command,
    start_server,
)
from oasiskv.engine_args import add_device_flag
from oasiskv.report import save_json

WARMUP_TOKENS = 4  # the untimed first request of each server: prefill and a few steps


def command(args: argparse.Namespace) -> str:
    """The command that repeats this run, every setting spelled out."""
    argv = ["oasiskv", "bench", "serve"]
    for flag in ("url" if args.url else "servers", "model", "input_len", "output_len",
                 "num_prompts", "shared_prefix_fraction", "group_size", "request_rate",
                 "max_concurrency", "seed", "slo_tpot_ms",
                 "slo_ttft_ms", "slo_e2e_ms", "slo_tpot_x_dense_1", "slo_calibration_requests",
                 "max_num_seqs", "device_kv_budget", "dtype", "num_threads", "pareto_json",
                 "json", "plot", "bytes_plot"):
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    return shlex.join(argv)


def parse_rates(text: str) -> list[float]:
    """"0.05,0.1,inf" -> [0.05, 0.1, inf]: requests per second, each positive, inf = all at
    once."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    try:
        rates = [float(x) for x in items]
    except ValueError:
        rates = []
    if not rates or any(not (r > 0) for r in rates):
        raise ValueError(f"--request-rate takes positive numbers or inf, comma-separated, got "
                         f"{text!r}")
    if len(set(rates)) < len(rates):
        raise ValueError(f"--request-rate {text!r}: a rate twice")
    return rates


def rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def check_args(args: argparse.Namespace) -> None:
    """Every flag, before any server starts."""
    for flag in ("input_len", "output_len", "num_prompts", "max_num_seqs",
                 "slo_calibration_requests"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, flag)}")
    check_groups(args.num_prompts, args.shared_prefix_fraction, args.group_size)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    x = args.slo_tpot_x_dense_1
    if x is not None:
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"--slo-tpot-x-dense-1 must be a positive number, got {x}")
        if args.slo_tpot_ms is not None:
            raise ValueError("give --slo-tpot-ms or --slo-tpot-x-dense-1, not both")
        if args.url or parse_servers(args.servers)[0].kind != "dense":
            raise ValueError("--slo-tpot-x-dense-1 measures the first of --servers, which "
                             "must be dense (and is started here, not --url)")
    if args.output_len < 2 and (args.slo_tpot_ms is not None or x is not None):
        raise ValueError("a TPOT SLO needs --output-len of at least 2")


def settings_of(args: argparse.Namespace) -> ServerSettings:
    threads = args.num_threads or len(os.sched_getaffinity(0))
    return ServerSettings(model=args.model, max_num_seqs=args.max_num_seqs,
                          context=args.input_len + args.output_len, dtype=args.dtype,
                          device_kv_budget=args.device_kv_budget, threads=threads,
                          device=args.device,
                          llama_server=args.llama_server, startup_timeout=args.startup_timeout)


def pareto_accuracy(path: str | None) -> dict[str, float]:
    """--pareto-json: each configuration's accuracy (passkey and needle) from `bench pareto`."""
    if not path:
        return {}
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--pareto-json {path}: not a bench pareto JSON ({e})") from None
    return {r["setting"]: r["accuracy"] for r in rows if r.get("accuracy") is not None}


def setting_name(spec) -> str | None:
    """The name `bench pareto` gives the same configuration (None for llama-server)."""
    from oasiskv.bench.sparse_options import parse_sparse, sparse_setting

    if spec.kind == "dense":
        return "dense"
    if spec.kind == "sparse":
        opts = ",".join(f"{k}={v}" for k, v in spec.options) or "default"
        return sparse_setting(parse_sparse(opts)).name
    return None


class ServeBench:
    def __init__(self, args: argparse.Namespace) -> None:
        check_args(args)
        self.args = args
        self.rates = parse_rates(args.request_rate)
        self.specs = [] if args.url else parse_servers(args.servers)
        self.settings = settings_of(args)
        self.slo = Slo(args.slo_tpot_ms, args.slo_ttft_ms, args.slo_e2e_ms)
        for spec in self.specs:  # a missing binary or a non-GGUF model fails now
            server_command(spec, self.settings, 0)
        self.accuracy = pareto_accuracy(args.pareto_json)
        self.log_dir = Path(args.log_dir) if args.log_dir else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.result: dict = {
            "bench": "serve", "model": args.model, "input_len": args.input_len,
            "output_len": args.output_len, "num_prompts": args.num_prompts,
            "shared_prefix_fraction": args.shared_prefix_fraction,
            "group_size": args.group_size if args.shared_prefix_fraction is not None else None,
            "request_rates": [rate_label(r) for r in self.rates],
            "max_concurrency": args.max_concurrency, "max_num_seqs": args.max_num_seqs,
            "device_kv_budget": args.device_kv_budget, "dtype": args.dtype,
            "threads": self.settings.threads, "seed": args.seed,
            "servers": [s.label for s in self.specs] or [args.url],
            "command": command(args),
            "slo": self.slo.as_dict(), "calibration": None, "errors": [], "cells": [],
            "complete": False}

    def save(self) -> None:
        save_json(self.args.json, self.result)

    def prompts(self, tokenizer) -> None:
        """One pool of passages, sliced: the warm-up prompt, the calibration prompts, then one
        slice per rate (its workload); every server gets the same slices."""
        a = self.args
        self.n_calib = a.slo_calibration_requests if a.slo_tpot_x_dense_1 else 0
        per_rate = passages_needed(a.num_prompts, a.shared_prefix_fraction, a.group_size)
        count = 1 + self.n_calib + len(self.rates) * per_rate
        pool, self.result["text"] = unique_prompts(tokenizer, count, a.input_len, a.seed)
        if len({tuple(p) for p in pool}) < count:
            raise ValueError(f"the text holds too few distinct {a.input_len}-token prompts for "
                             f"{count} requests")
        self.warmup, self.calib = pool[0], pool[1:1 + self.n_calib]
        rest = pool[1 + self.n_calib:]
        loads = [make_workload(rest[i * per_rate:(i + 1) * per_rate], a.num_prompts,
                               a.input_len, a.shared_prefix_fraction, a.group_size)
                 for i in range(len(self.rates))]
        self.warms = [w.warm for w in loads]
        self.traces = [make_trace(w.timed, rate, a.seed + i)
                       for i, (w, rate) in enumerate(zip(loads, self.rates, strict=True))]

    def run(self) -> dict:
        from oasiskv.models.byte_tokenizer import byte_tokenizer
        from oasiskv.models.loader import load_tokenizer
        from oasiskv.models.random_model import is_random
        from oasiskv.models.registry import resolve_model

        t0 = time.perf_counter()
        model = self.args.model
        print_model_note(model)
        self.prompts(byte_tokenizer() if is_random(model) else
                     load_tokenizer(resolve_model(model)))
        if self.args.url:
            self.sweep(RunningServer(self.args.url, self.args.url.rstrip("/"), None), None)
        for spec in self.specs:
            try:
                with start_server(spec, self.settings, self.log_dir) as server:
                    self.sweep(server, spec)
            except RuntimeError as e:  # one server that fails to start or serve: the others go on
                print(f"warning: {spec.label}: {e}", file=sys.stderr)
                self.result["errors"].append({"server": spec.label, "error": str(e)})
                self.save()
        self.result.update(complete=True, time_s=time.perf_counter() - t0)
        self.save()
        return self.result

    def trace(self, server: RunningServer, model: str, trace, desc: str,
              max_concurrency: int | None):
        return asyncio.run(run_trace(server.url, model, trace, self.args.output_len,
                                     max_concurrency, desc, self.args.request_timeout))

    def sweep(self, server: RunningServer, spec) -> None:
        a = self.args
        model = served_model(server.url)
        warm, _ = asyncio.run(run_trace(server.url, model, make_trace([self.warmup], math.inf, 0),
                                        WARMUP_TOKENS, 1, f"{server.label} warm-up"))
        if not warm[0].ok:
            raise RuntimeError(f"its warm-up request failed: {warm[0].error}")
        if self.n_calib and self.result["calibration"] is None:
            results, _ = self.trace(server, model, make_trace(self.calib, math.inf, a.seed),
                                    f"{server.label} TPOT with 1 in flight", 1)
            tpot = distribution([r.tpot_s for r in results if r.tpot_s is not None])
            if not tpot["n"]:
                raise RuntimeError(f"no calibration request succeeded: {results[0].error}")
            self.slo = Slo(a.slo_tpot_x_dense_1 * tpot["p50"], self.slo.ttft_ms,
                           self.slo.e2e_ms)
            self.result["slo"] = self.slo.as_dict()
            self.result["calibration"] = {
                "server": server.label, "tpot_ms": tpot, "x": a.slo_tpot_x_dense_1,
                "requests": [r.as_dict() for r in results]}
            print(f"SLO: TPOT <= {a.slo_tpot_x_dense_1:g} x {tpot['p50']:.1f} ms (the median "
                  f"TPOT of {server.label} with 1 request in flight, n={tpot['n']}) = "
                  f"{self.slo.tpot_ms:.1f} ms", file=sys.stderr)
        name = setting_name(spec) if spec is not None else None
        for rate, warm, trace in zip(self.rates, self.warms, self.traces, strict=True):
            label = f"{server.label} @ {rate_label(rate)} req/s"
            cell = {"server": server.label, "rate": rate_label(rate),
                    "max_concurrency": a.max_concurrency, "warm": None}
            done = []
            if warm:  # each group's first request, before the clock starts
                done, _ = self.trace(server, model, make_trace(warm, math.inf, 0),
                                     f"{label}: warm", a.max_concurrency)
                cell["warm"] = {"requests": len(done), "completed": sum(r.ok for r in done),
                                "per_request": [r.as_dict() for r in done]}
            with ByteSampler(server.url) as sampler:
                results, duration = self.trace(server, model, trace, label, a.max_concurrency)
            cell.update(**cell_metrics(results, duration, self.slo),
                        store_to_decode=sampler.result(),
                        accuracy=self.accuracy.get(name) if name else None,
                        per_request=[r.as_dict() for r in results])
            self.result["cells"].append(cell)
            for r in done + results:
                if not r.ok and not r.rejected:
                    print(f"warning: {server.label} @ {rate_label(rate)}: request {r.index} "
                          f"failed: {r.error}", file=sys.stderr)
            self.save()  # a later crash keeps this cell


def run_serve_bench(args: argparse.Namespace) -> dict:
    bench = ServeBench(args)
    result = bench.run()
    report(result)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        from oasiskv.bench.serve_plot import plot

        plot(result["cells"], args.plot, f"{args.model}: {args.input_len}-token prompts, "
             f"{args.output_len} output tokens", result["slo"]["tpot_ms"])
    if args.bytes_plot:
        from oasiskv.bench.serve_plot import plot_bytes

        plot_bytes(result["cells"], args.bytes_plot, f"{args.model}: {args.input_len}-token "
                   f"prompts, {args.output_len} output tokens")
    return result


COMMANDS = {"serve": ("a serving benchmark over HTTP (vLLM's bench serve): "
                      "request rates against servers started here or at --url")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`bench serve`'s flags."""
    p.add_argument("--servers", default="dense,sparse,llama-server",
                   help=f"servers started here on loopback, one at a time: {', '.join(KINDS)}; "
                   "sparse:KEY=VAL,... sets CacheConfig fields (top_k=64,f_hbm=0.1); "
                   "pd:transfer=partial|slab|full,... is `oasiskv pd --serve` (1 prefill + 1 "
                   "decode worker and the router; also prefill_workers=, decode_workers=, "
                   "store_bytes=, CacheConfig fields; f_host goes to the decode workers; the "
                   "threads are shared out among the workers)")
    p.add_argument("--url", default=None, help="a running server to measure instead")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--input-len", type=int, default=4096, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=1024,
                   help="output tokens per request (ignore_eos)")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="requests per rate (with --shared-prefix-fraction: whole groups, the "
                   "warming ones included)")
    p.add_argument("--shared-prefix-fraction", type=float, default=None, metavar="H",
                   help="the paper's PD workload: groups of --group-size prompts that share "
                   "their first H of --input-len tokens; each group's first request is sent "
                   "before the timed trace (warms the store)")
    p.add_argument("--group-size", type=int, default=4,
                   help="requests per shared-prefix group")
    p.add_argument("--request-rate", default="inf",
                   help="requests per second, comma-separated (Poisson arrivals; inf: all at "
                   "once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (later arrivals wait)")
    p.add_argument("--seed", type=int, default=0, help="fixes the prompts and arrival times")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="per-request TPOT limit")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="per-request TTFT limit")
    p.add_argument("--slo-e2e-ms", type=float, default=None, help="per-request E2E limit")
    p.add_argument("--slo-tpot-x-dense-1", type=float, default=None, metavar="X",
                   help="TPOT limit = X times the first server's (dense) TPOT with one request "
                   "in flight, measured first in the same run")
    p.add_argument("--slo-calibration-requests", type=int, default=3,
                   help="requests, one at a time, that --slo-tpot-x-dense-1 measures")
    p.add_argument("--max-num-seqs", type=int, default=32,
                   help="requests a server runs at once (ours: --max-num-seqs; llama-server: "
                   "-np slots)")
    p.add_argument("--device-kv-budget", default="1GiB", help="our servers' device KV budget")
    p.add_argument("--dtype", default="bfloat16", help="our servers' dtype")
    add_device_flag(p)
    p.add_argument("--num-threads", type=int, default=None,
                   help="threads of every server (default: the CPUs this process may use)")
    p.add_argument("--llama-server", default=None,
                   help="the llama-server binary (default: $OASISKV_LLAMA_SERVER, else the "
                   "one scripts/setup_llama_server.sh builds into .venv)")
    p.add_argument("--pareto-json", default=None,
                   help="a bench pareto JSON: each configuration's accuracy beside its rows")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds one request may take")
    p.add_argument("--log-dir", default=None, help="keep each server's log here")
    p.add_argument("--json", help="write the figures here, as each cell completes")
    p.add_argument("--plot", help="write TPOT, TTFT and goodput against throughput (PNG)")
    p.add_argument("--bytes-plot", help="write the store->decode bytes per second over each "
                   "trace (PNG)")


def run(args: argparse.Namespace) -> int:
    run_serve_bench(args)
    return 0
