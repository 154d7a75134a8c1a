"""`oasiskv bench pipeline`: what the prefetch pipeline costs and hides, in one run.

The prompts (unique Austen passages) are prefilled once; every configuration gets the same
prefix K/V (`add_request(prefix_kv=)`), computes the last prompt token, seeds its working sets
(first decode step, uncapped, on the critical path) and warms up, then the next --steps
decode steps of the whole batch are measured. Per f_hbm:
- frozen: no prefetch at all once seeded (working sets frozen): the compute floor;
- sync: the same stages inline, on the critical path;
- async: stages in background workers, waited for per layer.
With --repeats R the three modes run in turn, R rounds per f_hbm; a row is the mode's
median-step-time run, with the median of its per-round ratios to that round's frozen run.
Printed per row: mean decode step time, its ratio to frozen, the stall fraction (foreground
time waiting for prefetch / step time), bytes moved per step (host->device + device->host, and
remote store -> host), blocks admitted / wanted per step, and the cap in force.

With --remote-store and --f-host < 1 the host keeps only part of each prompt and the misses
are read from the store by the remote fetch stage: `mooncake` starts a master and a storage
node process (`store.store_node`) in a private network, so every read crosses Mooncake's TCP
transport: sync pays it on the critical path, async in the workers (hidden where they have a
core of their own; the Mooncake client itself keeps cores busy while a read is in flight).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load

from oasiskv.bench.common import prefix_kv_files, print_model_note, summary_label, unique_prompts
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine_args import add_device_flag
from oasiskv.report import (
    markdown_table,
    parse_f_hbms,
    platform_name,
    pyplot,
    save_figure,
    write_json,
)
from oasiskv.sampling_params import SamplingParams
from oasiskv.store.mooncake import local_master
from oasiskv.store.store_node import StoreNode

MODES = ("frozen", "sync", "async")


def measure(engine: LLMEngine, prompts: list[list[int]], kvs: list[torch.Tensor],
            warmup: int, steps: int, frozen: bool, trace: str | None = None) -> dict:
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0, ignore_eos=True)
    for p, kv in zip(prompts, kvs, strict=True):
        engine.add_request(p, params, prefix_kv=kv)
    sparse = engine.sparse
    for _ in range(warmup + 1):  # last prompt token, seeding step, warm-up
        engine.step()
    sparse.frozen = frozen
    sparse.flush()
    tracer = engine.trace() if trace else None
    start = len(engine.step_log)
    before = dict(vars(sparse.counters))
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sparse.flush()
    wall = time.perf_counter() - t0
    log = list(engine.step_log)[start:]
    after = vars(sparse.counters)
    delta = {k: after[k] - before[k] for k in after}
    if tracer is not None:
        tracer.write(trace)
    for rid in list(engine.requests):
        engine.abort(rid)
    step_s = wall / steps
    return {"step_ms": step_s * 1e3, "engine_step_ms": sum(e["time_s"] for e in log)
            / len(log) * 1e3, "stall_frac": delta["stall_s"] / wall,
            "bytes_per_step": (delta["h2d_bytes"] + delta["d2h_bytes"]) / steps,
            "remote_bytes_per_step": delta["remote_bytes"] / steps,
            "admitted_per_step": delta["admitted"] / steps,
            "wanted_per_step": delta["wanted"] / steps,
            "hit_rate": delta["hits"] / max(delta["predicted"], 1),
            "fetch_cap": sparse.fetch_cap, "steps": steps}


def median_round(runs: list[dict], floors: list[float]) -> dict:
    """One mode's rounds: the median-step-time run, with every round's step time and its
    ratio to the frozen run of the same round (the ratio is what holds on a noisy machine:
    the modes of one round run minutes apart, rounds further)."""
    ratios = [r["step_ms"] / floor for r, floor in zip(runs, floors, strict=True)]
    median = sorted(runs, key=lambda r: r["step_ms"])[(len(runs) - 1) // 2]
    return median | {"vs_frozen": statistics.median(ratios), "vs_frozen_runs": ratios,
                     "step_ms_runs": [r["step_ms"] for r in runs],
                     "rounds": ", ".join(f"{x:.2f}" for x in ratios)}


COLUMNS = [("f_hbm", "f_hbm"), ("mode", "mode"), ("step_ms", "step ms"),
           ("vs_frozen", "x frozen"), ("rounds", "x frozen, each round"), ("stall_frac", "stall"),
           ("bytes_per_step", "bytes/step"), ("remote_bytes_per_step", "remote bytes/step"),
           ("admitted_per_step", "admitted/step"),
           ("wanted_per_step", "wanted/step"), ("hit_rate", "hit rate"), ("fetch_cap", "cap")]


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(str(r["f_hbm"]) for r in rows))
    for i, mode in enumerate(MODES):
        picked = [next(r for r in rows if r["mode"] == mode and str(r["f_hbm"]) == f)
                  for f in labels]
        ys = [r["step_ms"] for r in picked]
        spread = [[y - min(r["step_ms_runs"]) for y, r in zip(ys, picked, strict=True)],
                  [max(r["step_ms_runs"]) - y for y, r in zip(ys, picked, strict=True)]]
        xs = [j + (i - 1) * 0.27 for j in range(len(labels))]
        ax.bar(xs, ys, width=0.27, label=mode, yerr=spread, capsize=3)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("f_hbm (admission cap = ceil(f_hbm * K) per head, layer, step)")
    ax.set_ylabel("decode step time (ms), median of rounds (bars: min-max)")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def store_label(args: argparse.Namespace) -> str:
    if args.remote_store == "none":
        return "no remote store"
    return f"remote store {args.remote_store}, host keeps {args.f_host:g} of each prompt"


def mooncake_node(stack: contextlib.ExitStack, kvs: list[torch.Tensor]) -> str:
    """A master and a storage node lending room for two engines' prompts (the next engine puts
    its copy while the last one's may still be leased), in a private network; the spec."""
    master = stack.enter_context(local_master())
    prompt_bytes = sum(kv.numel() * kv.element_size() for kv in kvs)
    stack.enter_context(StoreNode(master.address, 2 * prompt_bytes + (64 << 20)))
    return f"mooncake://{master.address}"


def run_pipeline_bench(args: argparse.Namespace) -> list[dict]:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    t_start = time.perf_counter()
    print_model_note(args.model)
    fractions = parse_f_hbms(args.f_hbm)
    base = {"model": args.model, "kv_mode": "sparse", "top_k": args.top_k,
            "predictor": args.predictor, "drafter": args.drafter, "dtype": args.dtype,
            "summary_dtype": args.summary_dtype, "max_num_seqs": args.batch,
            "device": args.device}
    if args.num_threads:
        base["num_threads"] = args.num_threads
    remote = {"f_host": args.f_host, "remote_store": args.remote_store}
    EngineConfig.from_kwargs(**base, **remote | {  # bad settings fail now, not after prefill
        "remote_store": "inprocess" if args.remote_store == "mooncake" else args.remote_store})
    prefill_engine = LLMEngine(EngineConfig.from_kwargs(**base))
    prompts, source = unique_prompts(prefill_engine.tokenizer, args.batch, args.context)
    with tempfile.TemporaryDirectory(prefix="oasiskv-bench-") as tmp:
        files, prefill_s = prefix_kv_files(prefill_engine, prompts,
                                           Path(args.kv_cache_dir or tmp))
        kvs = [load(f.read_bytes())["kv"] for f in files]
    prefill_engine.close()
    del prefill_engine
    rows = []
    with contextlib.ExitStack() as stack:
        if args.remote_store == "mooncake":
            remote |= {"remote_store": mooncake_node(stack, kvs), "remote_lend": "0"}
        for f in fractions:
            runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for round_ in range(args.repeats):  # every mode once per round, in turn
                for mode in MODES:
                    engine = LLMEngine(EngineConfig.from_kwargs(
                        **base, **remote, f_hbm=f,
                        prefetch="sync" if mode != "async" else "async"))
                    trace = args.trace if (args.trace and mode == "async"
                                           and f == fractions[0] and round_ == 0) else None
                    runs[mode].append(measure(engine, prompts, kvs, args.warmup, args.steps,
                                              mode == "frozen", trace))
                    engine.close()
                    print(f"f_hbm {f} {mode}: {runs[mode][-1]['step_ms']:.1f} ms/step",
                          flush=True)
            for mode in MODES:
                rows.append({"f_hbm": f, "mode": mode, **median_round(
                    runs[mode], [r["step_ms"] for r in runs["frozen"]])})
    elapsed = time.perf_counter() - t_start
    print(f"\n## prefetch pipeline, {args.model}: batch {args.batch} x {args.context} tokens "
          f"({source}), K={args.top_k}, predictor {args.predictor}, {args.dtype} K/V, "
          f"summaries {summary_label(args.summary_dtype, args.dtype)}, {store_label(args)}, "
          f"{args.steps} measured "
          f"decode steps after {args.warmup} warm-up; {torch.get_num_threads()} threads, "
          f"{platform_name()}\n")
    print(markdown_table(rows, COLUMNS))
    print(f"\nx frozen = step time / the frozen run's of the same round (no prefetch once "
          f"seeded), median of {args.repeats} round(s); stall = share of the step the "
          f"foreground waited for prefetch jobs; prompts prefilled once ({prefill_s:.0f} s "
          f"computed, the rest from the K/V cache) and handed to every configuration. "
          f"{elapsed:.0f} s.")
    write_json(args.json, {"bench": "pipeline", "model": args.model, "context": args.context,
                           "batch": args.batch, "top_k": args.top_k,
                           "predictor": args.predictor, "steps": args.steps,
                           "dtype": args.dtype, "summary_dtype": args.summary_dtype,
                           "repeats": args.repeats, "remote_store": args.remote_store,
                           "f_host": args.f_host,
                           "threads": torch.get_num_threads(), "prefill_s": prefill_s,
                           "time_s": elapsed, "rows": rows})
    if args.plot:
        plot(rows, args.plot, f"{args.model}: decode step, batch {args.batch} x "
                              f"{args.context} tok, K={args.top_k}" + (
                                  "" if args.remote_store == "none" else
                                  f"\nremote store {args.remote_store}, f_host={args.f_host:g}"))
    return rows


COMMANDS = {"pipeline": "prefetch: frozen vs sync vs async, per f_hbm"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`bench pipeline`'s flags."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=6144, help="prompt length in tokens")
    p.add_argument("--batch", type=int, default=8, help="requests decoding together")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--predictor", default="lookahead", choices=("lookahead", "previous"))
    p.add_argument("--drafter", default="resync", help="lookahead's drafter")
    p.add_argument("--f-hbm", default="0.02,0.05,0.1,1.0,auto",
                   help="admission caps to compare (fractions of K, or auto)")
    p.add_argument("--steps", type=int, default=16, help="measured decode steps")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before measuring")
    p.add_argument("--trace", help="Chrome trace of the async run at the first f_hbm")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the three modes per f_hbm (median shown, every round's "
                   "ratio to frozen listed)")
    p.add_argument("--kv-cache-dir", default=None,
                   help="keep the prompts' computed K/V here and reuse it in later runs "
                   "(default: a temporary directory)")
    p.add_argument("--dtype", default="float32")
    add_device_flag(p)
    p.add_argument("--summary-dtype", default="auto",
                   help="block summaries: auto (bfloat16 for float32 K/V, else the KV "
                   "dtype), float32, float16 or bfloat16 (half the bytes the predict stage "
                   "reads in a float32 run)")
    p.add_argument("--remote-store", default="none",
                   help="the tier under the host: none (the host holds every block), "
                   "inprocess, mooncake (a master and a storage node process started here, "
                   "reads cross Mooncake's TCP transport) or mooncake://HOST:PORT")
    p.add_argument("--f-host", type=float, default=1.0,
                   help="with a remote store: share of each prompt's blocks the host keeps; "
                   "the remote fetch stage reads the rest when predicted")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--plot", help="write a bar plot (PNG) of step time per f_hbm and mode")


def run(args: argparse.Namespace) -> int:
    run_pipeline_bench(args)
    return 0
