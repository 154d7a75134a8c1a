"""`oasiskv bench pipeline`: what the prefetch pipeline costs and hides, in one run.

The prompts (unique Austen passages) are prefilled once; every configuration gets the same
prefix K/V (`add_request(prefix_kv=)`), computes the last prompt token, seeds its working sets
(first decode step, uncapped, on the critical path) and warms up, then the next --steps
decode steps of the whole batch are measured. Per f_hbm:
- frozen: no prefetch at all once seeded (working sets frozen): the compute floor;
- sync: the same stages inline, on the critical path;
- async: stages in background workers, waited for per layer.
Printed per row: mean decode step time, its ratio to frozen, the stall fraction (foreground
time waiting for prefetch / step time), bytes moved per step (host->device + device->host),
blocks admitted / wanted per step, and the cap in force.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from oasiskv.bench.common import (
    markdown_table,
    parse_f_hbms,
    pyplot,
    save_figure,
    unique_prompts,
    write_json,
)
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.sampling_params import SamplingParams

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
            "admitted_per_step": delta["admitted"] / steps,
            "wanted_per_step": delta["wanted"] / steps,
            "hit_rate": delta["hits"] / max(delta["predicted"], 1),
            "fetch_cap": sparse.fetch_cap, "steps": steps}


COLUMNS = [("f_hbm", "f_hbm"), ("mode", "mode"), ("step_ms", "step ms"),
           ("vs_frozen", "x frozen"), ("stall_frac", "stall"),
           ("bytes_per_step", "bytes/step"), ("admitted_per_step", "admitted/step"),
           ("wanted_per_step", "wanted/step"), ("hit_rate", "hit rate"), ("fetch_cap", "cap")]


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(str(r["f_hbm"]) for r in rows))
    for i, mode in enumerate(MODES):
        ys = [next((r["step_ms"] for r in rows if r["mode"] == mode
                    and str(r["f_hbm"]) == f), None) for f in labels]
        xs = [j + (i - 1) * 0.27 for j in range(len(labels))]
        ax.bar(xs, [y or 0 for y in ys], width=0.27, label=mode)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("f_hbm (admission cap = ceil(f_hbm * K) per head, layer, step)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)


def run_pipeline_bench(args: argparse.Namespace) -> list[dict]:
    t_start = time.perf_counter()
    fractions = parse_f_hbms(args.f_hbm)
    base = {"model": args.model, "kv_mode": "sparse", "top_k": args.top_k,
            "predictor": args.predictor, "drafter": args.drafter, "dtype": args.dtype,
            "max_num_seqs": args.batch}
    if args.num_threads:
        base["num_threads"] = args.num_threads
    prefill_engine = LLMEngine(EngineConfig.from_kwargs(**base))
    prompts, source = unique_prompts(prefill_engine.tokenizer, args.batch, args.context)
    t0 = time.perf_counter()
    kvs = [prefill_engine.compute_prefix_kv(p[:-1]) for p in prompts]
    prefill_s = time.perf_counter() - t0
    prefill_engine.close()
    del prefill_engine
    rows = []
    for f in fractions:
        floor = None
        for mode in MODES:
            engine = LLMEngine(EngineConfig.from_kwargs(
                **base, f_hbm=f, prefetch="sync" if mode != "async" else "async"))
            trace = args.trace if (args.trace and mode == "async" and f == fractions[0]) else None
            row = {"f_hbm": f, "mode": mode, **measure(engine, prompts, kvs, args.warmup,
                                                       args.steps, mode == "frozen", trace)}
            engine.close()
            floor = floor or row["step_ms"]
            row["vs_frozen"] = row["step_ms"] / floor
            rows.append(row)
            print(f"f_hbm {f} {mode}: {row['step_ms']:.1f} ms/step", flush=True)
    elapsed = time.perf_counter() - t_start
    print(f"\n## prefetch pipeline, {args.model}: batch {args.batch} x {args.context} tokens "
          f"({source}), K={args.top_k}, predictor {args.predictor}, {args.steps} measured "
          f"decode steps after {args.warmup} warm-up; {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}\n")
    print(markdown_table(rows, COLUMNS))
    print(f"\nx frozen = step time / the frozen row's (no prefetch once seeded); stall = share "
          f"of the step the foreground waited for prefetch jobs; prompts prefilled once "
          f"({prefill_s:.0f} s) and handed to every configuration. {elapsed:.0f} s.")
    write_json(args.json, {"bench": "pipeline", "model": args.model, "context": args.context,
                           "batch": args.batch, "top_k": args.top_k,
                           "predictor": args.predictor, "steps": args.steps,
                           "threads": torch.get_num_threads(), "prefill_s": prefill_s,
                           "time_s": elapsed, "rows": rows})
    if args.plot:
        plot(rows, args.plot, f"{args.model}: decode step, batch {args.batch} x "
                              f"{args.context} tok, K={args.top_k}")
    return rows
