"""`oasiskv bench pareto`: accuracy against throughput for dense and each sparse
configuration, one context, one device KV budget, in one run on the same prompts.

Throughput (`bench/batch_runs.py`, as `bench throughput`): unique Austen prompts, prefilled once
(K/V on disk, reused with --kv-cache-dir), decoded by each configuration at dense's maximum
concurrency (`dense-max`) and at multiples of it (`2x`), all requests arriving at once, in
--repeats rounds; a cell is the median-TPS run: TPS, TPOT p50 / p99 over every gap between
consecutive tokens of its requests, ms per decode step, device bytes per running request
(the device tensors' peak over the most requests decoding at once), greedy agreement with
dense on the same prompts. Accuracy (`eval/fidelity.py`): passkey, needle and perplexity
at the same context, every configuration on the same samples, with the paired 95 %
intervals of the difference (ratio) to dense.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load
from tqdm.auto import tqdm

from oasiskv.bench.batch_runs import auto_host_budget, dense_capacity, median_run, run_mode
from oasiskv.bench.common import agreement, prefix_kv_files, unique_prompts
from oasiskv.bench.levels import DENSE_MAX, parse_concurrency, relative, resolve
from oasiskv.bench.pareto_plot import plot
from oasiskv.bench.sparse_options import DEFAULT, parse_settings
from oasiskv.config import EngineConfig, SpecConfig
from oasiskv.engine_args import add_device_flag
from oasiskv.eval.fidelity import make_samples, run_samples, summarize
from oasiskv.eval.metrics import paired_bootstrap_ci
from oasiskv.eval.settings import setting_engines
from oasiskv.report import machine, markdown_table, save_json


def command(args: argparse.Namespace) -> str:
    """The command that repeats this run, every setting spelled out."""
    argv = ["oasiskv", "bench", "pareto"]
    for flag in ("model", "context", "device_kv_budget", "dtype", "output_len", "repeats",
                 "concurrency", "samples", "ppl_samples", "ppl_tokens", "seed", "num_threads",
                 "kv_cache_dir", "json", "plot"):
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    for spec in args.sparse or [DEFAULT]:
        argv += ["--sparse", spec]
    return shlex.join(argv)


def accuracy_figures(setting: str, rows: list[dict], results: dict[str, dict]) -> dict:
    """One configuration's accuracy columns from the tasks' summary rows, and passkey and
    needle together: their mean accuracy and the paired interval of its difference to dense."""
    out: dict = {}
    for r in (r for r in rows if r["setting"] == setting):
        if setting == "dense":  # the baseline: its own figures, no difference to itself
            r = {k: v for k, v in r.items() if k in ("task", "accuracy", "ppl")}
        if r["task"] == "ppl":
            out.update({k: r[k] for k in ("ppl", "ppl_ratio", "ppl_ratio_lo", "ppl_ratio_hi",
                                          "ppl_ratio_ci", "agreement") if k in r})
            out["ppl_agreement"] = out.pop("agreement", None)
        else:
            out[r["task"]] = r["accuracy"]
            out.update({f"{r['task']}_{k}": r[k] for k in ("delta", "delta_lo", "delta_hi",
                                                          "delta_ci") if k in r})
    scored = [t for t in ("passkey", "needle") if t in results]
    if scored:
        mine = [x["score"] for t in scored for x in results[t][setting]]
        dense = [x["score"] for t in scored for x in results[t]["dense"]]
        out["accuracy"] = 100 * sum(mine) / len(mine)
        if setting != "dense":
            out["accuracy_delta"] = out["accuracy"] - 100 * sum(dense) / len(dense)
            out["accuracy_delta_lo"], out["accuracy_delta_hi"] = paired_bootstrap_ci(
                mine, dense, lambda x, y: 100 * (x.mean(-1) - y.mean(-1)))
    return out


def throughput_cells(args, settings, base, prompts, files, levels, host_budget, cells: list,
                     save) -> None:
    """Every configuration at every level, in --repeats rounds, into `cells`: a cell is its
    median-TPS run; save() once a level's cells are done."""
    runs = [(s.name, {**base, **s.engine_kwargs()}
             | ({} if s.kv_mode == "dense" or "host_kv_budget" in dict(s.options)
                else {"host_kv_budget": host_budget})) for s in settings]
    for _, kw in runs:  # bad settings fail now, not after the prefill
        EngineConfig.from_kwargs(**kw)
    bar = tqdm(total=len(levels) * len(runs) * args.repeats, desc="throughput", unit="run",
               dynamic_ncols=True)
    for c, label in levels.items():
        tries: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # every configuration once per round, in turn
            for name, kw in runs:
                bar.set_description(f"throughput x{c} {name}")
                tries.setdefault(name, []).append(
                    run_mode(kw, prompts[:c], files[:c], args.output_len))
                bar.update()
        dense = median_run(tries["dense"])
        for name, t in tries.items():
            r = median_run(t) | {"setting": name, "concurrency": c, "level": label}
            r["device_bytes_per_request"] = r["device_peak_bytes"] / max(r["running_max"], 1)
            r["device_mib_per_request"] = r["device_bytes_per_request"] / 2**20
            if name != "dense":
                r["tps_ratio"] = r["tps"] / dense["tps"]
                r["agreement"] = agreement(r["tokens"], dense["tokens"])
            if r["failed"]:  # their tokens are missing from TPS and agreement
                print(f"warning: x{c} {name}: {r['failed']} request(s) failed",
                      file=sys.stderr)
            cells.append({k: v for k, v in r.items() if k != "tokens"})
        save()  # a later crash keeps this level's cells
    bar.close()


def run_pareto_bench(args: argparse.Namespace) -> list[dict]:
    t0 = time.perf_counter()
    settings = parse_settings(args.sparse)  # bad input fails before anything loads
    levels = parse_concurrency(args.concurrency)
    for flag in ("repeats", "samples", "ppl_samples", "ppl_tokens", "output_len", "context"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, "
                             f"got {getattr(args, flag)}")
    budget = {"device_kv_budget": args.device_kv_budget}
    eval_args = SimpleNamespace(model=args.model, dtype=args.dtype, drafter=SpecConfig.drafter,
                                num_threads=args.num_threads, device=args.device)
    names, engine_for = setting_engines(eval_args, settings, budget)
    first = engine_for("dense")
    kv_per_token = first.model_config.kv_bytes_per_token(first.config.torch_dtype)
    params = sum(p.numel() for p in first.model.parameters())
    size = (f"{params / 1e6:.3g}M model with "
            f"{first.model_config.max_position_embeddings / 1024:g}K context")
    base = {"model": args.model, "dtype": args.dtype, "prefault_kv": True,
            "device": args.device, **budget}
    if args.num_threads:
        base["num_threads"] = args.num_threads
    capacity = dense_capacity(EngineConfig.from_kwargs(**base), kv_per_token, args.context,
                              args.output_len)
    if capacity == 0 and relative(levels):
        raise ValueError(f"--device-kv-budget {args.device_kv_budget} holds no dense request "
                         f"of {args.context} + {args.output_len} tokens, so {DENSE_MAX} is 0")
    level_of = resolve(levels, capacity)
    base["max_num_seqs"] = max(level_of)
    host_budget = auto_host_budget(max(level_of), args.context, args.output_len,
                                   first.config.cache.block_size, kv_per_token)
    result = {"bench": "pareto", "model": args.model, "context": args.context,
              "device_kv_budget": args.device_kv_budget, "dtype": args.dtype,
              "output_len": args.output_len, "repeats": args.repeats, "dense_capacity": capacity,
              "levels": level_of, "settings": names, "samples": args.samples,
              "ppl_samples": args.ppl_samples, "ppl_tokens": args.ppl_tokens, "seed": args.seed,
              "model_size": size, "machine": machine(), "command": command(args), "complete": False,
              "throughput": [], "accuracy": [], "per_sample": {}, "rows": []}

    def save() -> None:
        save_json(args.json, result)

    with tempfile.TemporaryDirectory(prefix="oasiskv-pareto-") as tmp:
        cache_dir = Path(args.kv_cache_dir or tmp)
        prompts, result["text"] = unique_prompts(first.tokenizer, max(level_of), args.context,
                                                 args.seed)
        files, result["prefill_s"] = prefix_kv_files(first, prompts, cache_dir,
                                                     f"prefill {args.context}")
        throughput_cells(args, settings, base, prompts, files, level_of, host_budget,
                         result["throughput"], save)
    results: dict[str, dict] = {}
    counts = {"passkey": args.samples, "needle": args.samples, "ppl": args.ppl_samples}
    bar = tqdm(total=sum(counts.values()), desc="accuracy", unit="prompt", dynamic_ncols=True)
    for task, n in counts.items():
        bar.set_description(f"accuracy {task}")
        samples = make_samples(task, first.tokenizer, args.context, n, args.seed,
                               ppl_tokens=args.ppl_tokens)
        results[task] = run_samples(engine_for, names, samples, 2, args.output_len, bar,
                                    prefix_fn=cached_prefix(args.kv_cache_dir))
        result["accuracy"] += [{"task": task, **r} for r in summarize(task, samples,
                                                                      results[task])]
        result["per_sample"][task] = results[task]
        save()  # a later crash keeps this task
    bar.close()
    rows = [cell | accuracy_figures(cell["setting"], result["accuracy"], results)
            for cell in result["throughput"]]
    result.update(rows=rows, complete=True, time_s=time.perf_counter() - t0)
    report(args, result)
    save()
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, f"{args.model} {args.dtype}, {args.context} tokens, device KV "
             f"budget {args.device_kv_budget}")
    return rows


def cached_prefix(cache_dir: str | None):
    """run_samples' prefix_fn: with --kv-cache-dir, prompt K/V kept there and reused by later
    runs; else None (computed in memory: the accuracy prompts' K/V is gigabytes at 7K)."""
    if not cache_dir:
        return None

    def prefix_fn(engine, chunk) -> list[torch.Tensor]:
        files, _ = prefix_kv_files(engine, [s.ids for s in chunk], Path(cache_dir),
                                   progress=False)
        return [load(f.read_bytes())["kv"] for f in files]

    return prefix_fn


COLUMNS = [("setting", "configuration"), ("concurrency", "conc"), ("level", "level"),
           ("running", "running"), ("tps", "TPS"), ("tps_range", "TPS runs"),
           ("tps_ratio", "TPS / dense"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("tpot_p99_ms", "TPOT p99 ms"), ("step_ms", "ms / step"),
           ("device_mib_per_request", "device MiB / request"), ("passkey", "passkey"),
           ("passkey_delta_ci", "Δ passkey [95% CI]"), ("needle", "needle"),
           ("needle_delta_ci", "Δ needle [95% CI]"), ("ppl", "ppl"),
           ("ppl_ratio_ci", "ppl ratio [95% CI]"),
           ("agreement", "greedy agree")]


def report(args: argparse.Namespace, result: dict) -> None:
    levels = ", ".join(f"{c} ({label})" if label else str(c)
                       for c, label in result["levels"].items())
    print(f"\n## accuracy against throughput, {args.model} {args.dtype}, {args.context} tokens, "
          f"device KV budget {args.device_kv_budget} (dense holds {result['dense_capacity']} "
          f"requests); concurrency {levels}\n")
    print(markdown_table(result["rows"], COLUMNS))
    print(f"\nTPS = output tokens / wall time, all requests arriving at once ({args.output_len} "
          f"greedy tokens each; the median-TPS of {args.repeats} round(s), TPS runs = every "
          f"round); TPOT p50 / p99 = over every gap between consecutive tokens of that run's "
          f"requests; ms / step = mean decode step; device MiB / request = the device "
          f"tensors' peak / the most requests decoding at once; greedy agree = share of "
          f"those tokens equal to dense's. passkey, needle: accuracy x100 on {args.samples} "
          f"prompts each; ppl ratio over the last {args.ppl_tokens} tokens of "
          f"{args.ppl_samples} passages; [95% CI] = paired bootstrap over the prompts (Δ: "
          f"points vs dense; holds 0 / 1: no measured difference). Prefill once per prompt "
          f"({result['prefill_s']:.0f} s; 0 when cached). {result['time_s']:.0f} s.")
    print(f"{args.model}: one {result['model_size']} (the paper measured 8B-235B models "
          f"on LongBench v2); {result['machine']}; {result['command']}")


COMMANDS = {"pareto": ("accuracy against throughput: dense and each sparse "
                       "configuration at one context and device budget, in one run")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`bench pareto`'s flags."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=7168, help="prompt length in tokens")
    p.add_argument("--device-kv-budget", default="1GiB")
    p.add_argument("--dtype", default="bfloat16")
    add_device_flag(p)
    p.add_argument("--sparse", action="append", default=None, metavar="KEY=VAL[,KEY=VAL...]",
                   help="a sparse configuration as CacheConfig fields (top_k=64,"
                   "score_aggregation=softmax-sum); repeatable; default: the engine's default "
                   "sparse configuration (default). Dense always runs as the baseline")
    p.add_argument("--concurrency", default=f"{DENSE_MAX},2x",
                   help=f"requests arriving at once: {DENSE_MAX} (the most whose whole K/V "
                   "fits the budget: dense's maximum), multiples of it (2x) or numbers")
    p.add_argument("--output-len", type=int, default=64,
                   help="greedy tokens per request (and per ppl passage for agreement)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of every configuration per level; a cell is its median-TPS run")
    p.add_argument("--samples", type=int, default=40, help="passkey and needle prompts each")
    p.add_argument("--ppl-samples", type=int, default=16, help="perplexity passages")
    p.add_argument("--ppl-tokens", type=int, default=128,
                   help="teacher-forced tokens scored at the end of each passage")
    p.add_argument("--seed", type=int, default=0, help="fixes the prompts and samples")
    p.add_argument("--kv-cache-dir", default=None,
                   help="keep the prompts' computed K/V here and reuse it in later runs "
                   "(default: the throughput prompts' in a temporary directory)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write the figures here, as each cell completes")
    p.add_argument("--plot", help="write accuracy and perplexity ratio against TPS (PNG)")


def run(args: argparse.Namespace) -> int:
    run_pareto_bench(args)
    return 0

