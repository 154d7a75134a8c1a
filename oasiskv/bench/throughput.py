"""`oasiskv bench throughput`: dense vs sparse under one device KV budget, in one run.

For each context, `max(concurrency)` unique Austen prompts (no shared prefixes) are prefilled
once (reported separately) and their K/V kept on disk; for each concurrency c, dense and
sparse run alternately on the same first c prompts, all arriving at once: each engine loads
the prompt K/V (`add_request(prefix_kv=)`), computes the last prompt token and decodes
--output-len greedy tokens. A dense request needs its whole context on the device, so under
the budget dense runs fewer requests at a time (the rest wait; none are dropped); a sparse
request needs one K+2-block slab. Reported per row: TPS (output tokens / wall time from
arrival to the last token), mean TPOT and TTFT, the mean running batch (requests decoding
per step), preemptions, and the sparse/dense ratios. The level `dense-max` is, per context,
the most requests whose whole K/V (prompt + output) fits the budget at once: the largest
concurrency dense can hold, where the paper compares; `2x` is twice it (a row's level labels
it). With --repeats R every mode (and peer)
runs R times, one after another in rounds, and the row is its median-TPS run: the machine's
slow minutes then fall on every mode alike. The roofline column is the time a step
would take if it only read the bytes it must (weights + the resident KV of the running batch)
at this machine's measured read bandwidth. With --breakdown N, an untimed extra run of each
mode and level profiles N decode steps (`bench/breakdown.py`): a second table shows the time
per step in attention, linear layers, sparse selection and the rest beside the roofline.
With --ttft, one prompt per context is also computed from scratch by each mode and peer, in
turn (`bench/prefill_ttft.py`): a third table shows each engine's time to first token.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from oasiskv.bench.batch_runs import (
    auto_host_budget,
    dense_capacity,
    median_run,
    read_bandwidth,
    run_mode,
)
from oasiskv.bench.breakdown import breakdown_columns, breakdown_run, check_steps
from oasiskv.bench.common import agreement, prefix_kv_files, print_model_note, unique_prompts
from oasiskv.bench.levels import DENSE_MAX, parse_concurrency, relative, resolve
from oasiskv.bench.peers import ChildCrashed, RestartingPeer, hf_from_prefix, load_hf, parse_peers
from oasiskv.bench.prefill_ttft import COLUMNS as TTFT_COLUMNS
from oasiskv.bench.prefill_ttft import engines_for, ttft_rows
from oasiskv.config import CacheConfig, EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine_args import add_device_flag
from oasiskv.models.registry import resolve_model
from oasiskv.report import (
    markdown_table,
    parse_list,
    platform_name,
    pyplot,
    save_figure,
    write_json,
)


def step_bytes(mode: str, running: float, context: int, kv_per_token: int, weights: int,
               slab_tokens: int) -> float:
    """What one decode step must read: the weights once + the running batch's resident KV."""
    per_request = slab_tokens if mode == "sparse" else context
    return weights + running * per_request * kv_per_token


COLUMNS = [("context", "context"), ("concurrency", "conc"), ("level", "level"), ("mode", "mode"),
           ("f_hbm", "f_hbm"), ("tps", "TPS"), ("tps_range", "TPS runs"),
           ("tps_ratio", "TPS / dense"), ("ratio_rounds", "each round"), ("vs_hf", "sparse/HF"),
           ("vs_llamacpp", "sparse/llama.cpp"), ("agreement", "agree"),
           ("tpot_ms", "TPOT ms"), ("ttft_s", "TTFT s"), ("running", "running"),
           ("preemptions", "preempt"), ("step_ms", "step ms"), ("roofline_ms", "roofline ms"),
           ("bytes_per_step", "fetch B/step"), ("hit_rate", "hit rate")]
BREAKDOWN = [("context", "context"), ("concurrency", "conc"), ("mode", "mode"), ("f_hbm", "f_hbm"),
             ("running", "running"), ("step_ms", "step ms"), ("roofline_ms", "roofline ms"),
             *breakdown_columns()]
ABLATION = [("context", "context"), ("concurrency", "conc"), ("f_hbm", "f_hbm"),
            ("fetch_cap", "cap/head"), ("bytes_per_step", "fetch B/step"), ("tps", "TPS"),
            ("hit_rate", "hit rate"), ("kept", "predicted kept"), ("agreement", "agree")]


def dense_max_summary(rows: list[dict], context: int, capacity: int, output_len: int,
                      budget: str) -> str:
    """One line per context: how many requests dense holds, and the modes at that level."""
    line = (f"{context}: dense holds {capacity} requests of {context + output_len} tokens under "
            f"{budget}")
    level = [r for r in rows if r["context"] == context and r["concurrency"] == capacity]
    dense = next((r for r in level if r["mode"] == "dense"), None)
    sparse = next((r for r in level if r["mode"] == "sparse"), None)  # the first f_hbm
    if dense is not None and sparse is not None:
        line += (f"; at {capacity} requests sparse/dense TPS {sparse['tps_ratio']:.2f} (each "
                 f"round {sparse['ratio_rounds']}; greedy agreement with dense "
                 f"{sparse['agreement']:.2f}), TPOT dense / sparse {dense['tpot_ms']:.0f} / "
                 f"{sparse['tpot_ms']:.0f} ms, running {dense['running']:.1f} / "
                 f"{sparse['running']:.1f}")
    return line


def plot(rows: list[dict], path: str, capacity: dict[int, int], title: str) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = sorted({(r["context"], r["mode"], r.get("f_hbm") or "") for r in rows})
    for (context, mode, f_hbm), style in zip(series, ["-o", "--o", ":o", "-s", "--s", ":s",
                                                      "-^", "--^", ":^"] * 3, strict=False):
        pts = sorted((r["concurrency"], r) for r in rows if r["context"] == context
                     and r["mode"] == mode and (r.get("f_hbm") or "") == f_hbm)
        xs = [c for c, _ in pts]
        label = f"{mode}{f' f_hbm={f_hbm}' if f_hbm else ''} {context}"
        spread = [[r["tps"] - min(r["tps_runs"]) for _, r in pts],
                  [max(r["tps_runs"]) - r["tps"] for _, r in pts]]
        a.errorbar(xs, [r["tps"] for _, r in pts], yerr=spread, fmt=style, capsize=3,
                   label=label)
        b.plot(xs, [r["running"] for _, r in pts], style, label=label)
    for ax, label in ((a, "output tokens / s (bars: min-max of the runs)"),
                      (b, "mean running batch")):
        for context, n in capacity.items():  # where the paper compares
            ax.axvline(n, color="gray", linestyle=":", linewidth=1)
            ax.annotate(f"dense holds {n} ({context})", (n, 0.02),
                        xycoords=("data", "axes fraction"), rotation=90, va="bottom", ha="right",
                        fontsize=7, color="gray")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests arriving at once)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def run_throughput_bench(args: argparse.Namespace) -> list[dict]:
    t_start = time.perf_counter()
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    print_model_note(args.model)
    contexts, levels = parse_list(args.context), parse_concurrency(args.concurrency)
    profiled = check_steps(args.breakdown)
    modes, f_hbms = parse_list(args.kv_mode, str), parse_list(args.f_hbm, str)
    peers = parse_peers(args.peer, args.model)
    if "sparse" in modes and peers and "dense" not in modes:
        raise ValueError("sparse rows show their speed-up over a --peer beside their greedy "
                         "agreement with dense: add dense to --kv-mode")
    prefill = LLMEngine(EngineConfig.from_kwargs(model=args.model, dtype=args.dtype,
                                                 num_threads=args.num_threads,
                                                 device=args.device))
    mc = prefill.model_config
    kv_per_token = mc.kv_bytes_per_token(prefill.config.torch_dtype)
    host_budget = args.host_kv_budget
    # the pools' pages mapped before the clock starts, as llama.cpp's and HF's caches are
    base = {"model": args.model, "dtype": args.dtype, "device_kv_budget": args.device_kv_budget,
            "prefault_kv": True, "device": args.device}
    dense_config = EngineConfig.from_kwargs(**base, kv_mode="dense")
    capacity = {c: dense_capacity(dense_config, kv_per_token, c, args.output_len)
                for c in contexts}
    if relative(levels) and min(capacity.values()) == 0:
        context = min(capacity, key=capacity.get)
        raise ValueError(f"--device-kv-budget {args.device_kv_budget} holds no dense request of "
                         f"{context} + {args.output_len} tokens, so {DENSE_MAX} is 0")
    context_levels = {c: resolve(levels, capacity[c]) for c in contexts}  # count -> label
    base["max_num_seqs"] = max(max(v) for v in context_levels.values())
    if host_budget == "auto":
        host_budget = max(auto_host_budget(max(context_levels[c]), c, args.output_len,
                                           prefill.config.cache.block_size, kv_per_token)
                          for c in contexts)
    if args.num_threads:
        base["num_threads"] = args.num_threads
    runs = [("dense", {"kv_mode": "dense"})] if "dense" in modes else []
    runs += [("sparse", {"kv_mode": "sparse", "top_k": args.top_k, "f_hbm": f,
                         "predictor": args.predictor, "host_kv_budget": host_budget,
                         "rerank": args.rerank, "rerank_source": args.rerank_source})
             for f in (f_hbms if "sparse" in modes else [])]
    for _, kw in runs:  # bad settings fail now, not after the prefill
        EngineConfig.from_kwargs(**base, **kw)
    weights = sum(p.numel() * p.element_size() for p in prefill.model.parameters())
    slab_tokens = (args.top_k + 1) * prefill.config.cache.block_size
    hf = load_hf(args.model, prefill.config.torch_dtype, prefill.device) if "hf" in peers \
        else None
    # what a step reads per mode: (weights, KV per token); llama.cpp its own, the GGUF's
    # quantized weights and f16 KV
    gguf = resolve_model(args.model) if "llamacpp" in peers else None
    reads = {"llamacpp": (gguf.stat().st_size, kv_per_token * 2 //
                          prefill.config.torch_dtype.itemsize)} if "llamacpp" in peers else {}
    bandwidth = read_bandwidth()
    rows, prefill_s, peer_prefill_s, peer_system_info, ttft = [], {}, {}, None, []
    with tempfile.TemporaryDirectory(prefix="oasiskv-bench-") as tmp:
        cache_dir = Path(args.kv_cache_dir or tmp)
        for context in contexts:
            prompts, source = unique_prompts(prefill.tokenizer, max(context_levels[context]),
                                             context)
            files, prefill_s[context] = prefix_kv_files(
                prefill, prompts, cache_dir, f"prefill {context}")
            # llama.cpp in a child process: a crash fails its row of that level, nothing else
            llamacpp = RestartingPeer(gguf, prompts, args.output_len, torch.get_num_threads(),
                                      cache_dir) if "llamacpp" in peers else None
            for c, label in context_levels[context].items():
                tries: dict[tuple[str, str | None], list[dict]] = {}
                failed: dict[str, str] = {}  # mode -> its error at this level
                for _ in range(args.repeats):  # every mode once per round, in turn
                    for mode, kw in runs:
                        r = run_mode({**base, **kw}, prompts[:c], files[:c], args.output_len)
                        tries.setdefault((mode, kw.get("f_hbm")), []).append(
                            r | {"mode": mode, "f_hbm": kw.get("f_hbm")})
                    if hf is not None:
                        tries.setdefault(("hf", None), []).append(
                            hf_from_prefix(hf, prompts[:c], files[:c], args.output_len)
                            | {"mode": "hf"})
                    if llamacpp is not None and "llamacpp" not in failed:
                        try:
                            tries.setdefault(("llamacpp", None), []).append(
                                llamacpp.generate(c, args.output_len) | {"mode": "llamacpp"})
                        except ChildCrashed as e:
                            failed["llamacpp"] = str(e)
                            print(f"{context} x{c} llamacpp: failed: {e}", file=sys.stderr,
                                  flush=True)
                level = [median_run(t) for (mode, _), t in tries.items() if mode not in failed]
                by_mode = {r["mode"]: r for r in level}  # dense and peers (sparse: its last f_hbm)
                for r in level:
                    r.update(context=context, concurrency=c, level=label, text=source,
                             dense_capacity=capacity[context])
                    mode_weights, mode_kv = reads.get(r["mode"], (weights, kv_per_token))
                    r["roofline_ms"] = 1e3 * step_bytes(r["mode"], r["running"], context,
                                                        mode_kv, mode_weights,
                                                        slab_tokens) / bandwidth
                    if "dense" in by_mode and r["mode"] != "dense":
                        r["tps_ratio"] = r["tps"] / by_mode["dense"]["tps"]
                        r["agreement"] = agreement(r["tokens"], by_mode["dense"]["tokens"])
                        r["tps_ratio_rounds"] = [a / b for a, b in zip(
                            r["tps_runs"], by_mode["dense"]["tps_runs"], strict=True)]
                        r["ratio_rounds"] = ", ".join(f"{x:.2f}" for x in r["tps_ratio_rounds"])
                    if r["mode"] == "sparse":
                        for peer in (p for p in peers if p in by_mode):
                            r[f"vs_{peer}"] = r["tps"] / by_mode[peer]["tps"]
                            r[f"vs_{peer}_rounds"] = [a / b for a, b in zip(
                                r["tps_runs"], by_mode[peer]["tps_runs"], strict=True)]
                    print(f"{context} x{c} {r['mode']}: {r['tps']:.1f} tok/s, running "
                          f"{r['running']:.1f}", flush=True)
                for mode, kw in runs if profiled else []:  # untimed, after the timed runs
                    row = next(r for r in level if r["mode"] == mode
                               and r.get("f_hbm") == kw.get("f_hbm"))
                    row.update(breakdown_run({**base, **kw}, prompts[:c], files[:c],
                                             args.output_len, profiled))
                rows += [{k: v for k, v in r.items() if k != "tokens"} for r in level]
                rows += [{"context": context, "concurrency": c, "level": label, "mode": mode,
                          "error": error, "text": source, "dense_capacity": capacity[context]}
                         for mode, error in failed.items()]
            if args.ttft:  # the prefill half: each engine's TTFT of the first prompt, from scratch
                first: dict[str, dict] = {}
                for mode, kw in runs:  # a mode's first f_hbm (prefill does not depend on it)
                    first.setdefault(mode, kw)
                ttft += ttft_rows(context, prompts[0], engines_for(
                    prompts[0], list(first.items()), base, hf, llamacpp), args.repeats)
            if llamacpp is not None:
                llamacpp.close()
                if llamacpp.prefill_s is not None:
                    peer_prefill_s[context] = llamacpp.prefill_s
                    peer_system_info = llamacpp.system_info
    elapsed = time.perf_counter() - t_start
    print(f"\n## throughput, {args.model} {args.dtype}: device KV budget "
          f"{args.device_kv_budget}, sparse K={args.top_k} f_hbm={args.f_hbm} {args.predictor}, "
          f"{args.output_len} greedy tokens per request, all requests arriving at once; "
          f"{args.repeats} run(s) of each mode per level, in rounds, the median-TPS run shown; "
          f"{torch.get_num_threads()} threads, {platform_name()}, "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s\n")
    errors = [r for r in rows if "error" in r]
    print(markdown_table(rows, COLUMNS + [("error", "error")] * bool(errors)))
    print()
    for context in contexts:
        print(dense_max_summary(rows, context, capacity[context], args.output_len,
                                args.device_kv_budget))
    if profiled:
        print(f"\n### step breakdown: {profiled} decode steps per mode and level under "
              f"torch.profiler, in an untimed extra run (ms per step on the stepping thread; "
              f"bg selection: prefetch stages on worker threads, overlapping the step)\n")
        print(markdown_table([r for r in rows if "profiled_step_ms" in r], BREAKDOWN))
    if ttft:
        print(f"\n### time to first token: the first prompt of each context computed from "
              f"scratch by each engine (no cached K/V), one after another; the median of "
              f"{args.repeats} run(s)\n")
        print(markdown_table(ttft, TTFT_COLUMNS + [("error", "error")] * any(
            "error" in r for r in ttft)))
    if len(f_hbms) > 1:
        print("\n### f_hbm ablation (sparse rows)\n")
        print(markdown_table([r for r in rows if r["mode"] == "sparse"], ABLATION))
    print(f"\nprefill (once per prompt, shared by every mode; 0 s when cached): "
          f"{', '.join(f'{k}: {v:.0f} s' for k, v in prefill_s.items())}. roofline = (weights "
          f"{weights / 2**20:.0f} MiB + resident KV of the running batch) / read bandwidth. "
          f"predicted kept = share of the predicted top-K blocks resident after selection "
          f"(what the fetch cap leaves out). hf = transformers generate from the same prompt "
          f"K/V, all requests in one batch (no device budget). llamacpp = llama.cpp on the "
          f"same GGUF (its quantized weights, f16 KV), all requests in one batch, after its "
          f"own prefill of the same prompts"
          f"{''.join(f', {k}: {v:.0f} s' for k, v in peer_prefill_s.items())}. "
          f"agree = share of greedy tokens equal to dense's. {elapsed:.0f} s.")
    for r in errors:  # the run went on without them, but they did not run
        print(f"error: {r['context']} x{r['concurrency']} {r['mode']}: {r['error']}",
              file=sys.stderr)
    write_json(args.json, {"bench": "throughput", "model": args.model,
                           "device_kv_budget": args.device_kv_budget, "top_k": args.top_k,
                           "f_hbm": f_hbms, "output_len": args.output_len, "peers": peers,
                           "dense_capacity": capacity,
                           "repeats": args.repeats, "breakdown_steps": profiled,
                           "bandwidth": bandwidth, "prefill_s": prefill_s,
                           "llamacpp_prefill_s": peer_prefill_s,
                           "llamacpp_system_info": peer_system_info,
                           "threads": torch.get_num_threads(), "time_s": elapsed, "rows": rows,
                           "ttft": ttft})
    if args.plot:
        plot([r for r in rows if "error" not in r], args.plot, capacity,
             f"{args.model} {args.dtype}: dense vs sparse, budget {args.device_kv_budget}")
    return rows


COMMANDS = {"throughput": ("dense vs sparse under one device KV budget, "
                           "concurrency sweep")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`bench throughput`'s flags."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", default="4096,7168", help="prompt lengths in tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,2,4,8,16,32,dense-max",
                   help="requests arriving at once (the same first prompts at every level); "
                   "dense-max: per context, the most requests whose whole K/V fits the "
                   "device budget (the largest concurrency dense can hold); multiples of it "
                   "(2x, 0.5x: at least 1)")
    p.add_argument("--device-kv-budget", default="1GiB")
    p.add_argument("--host-kv-budget", default="auto",
                   help="sparse: host tier bytes; auto: what the largest level's requests hold")
    p.add_argument("--kv-mode", default="dense,sparse")
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--f-hbm", default="0.05",
                   help="sparse fetch cap; several (0.02,0.05,0.1,1.0) add an ablation table")
    p.add_argument("--kv-cache-dir", default=None,
                   help="keep the prompts' computed K/V here and reuse it in later runs "
                   "(default: a temporary directory)")
    p.add_argument("--peer", default="",
                   help="other engines on the same prompts: hf (transformers generate), llamacpp "
                   "(llama.cpp on the same GGUF; scripts/setup_llamacpp.sh builds it)")
    p.add_argument("--predictor", default="lookahead")
    p.add_argument("--rerank", type=float, default=CacheConfig.rerank,
                   help="sparse: re-rank the best c*K blocks by attention over their keys "
                   "(0 = off: the Quest bound alone)")
    p.add_argument("--rerank-source", default=CacheConfig.rerank_source,
                   help="sparse, with --rerank: int8 or int4 (the device's key copy, "
                   "charged to the budget) or host")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every mode per level, in turn; the row is the median-TPS run")
    p.add_argument("--dtype", default="float32")
    add_device_flag(p)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--plot", help="write TPS and running batch vs concurrency (PNG)")
    p.add_argument("--ttft", action="store_true", help="also time to first token of one "
                   "prompt per context computed from scratch by each --kv-mode and --peer, in "
                   "the same run (a TTFT table beside decode)")
    p.add_argument("--breakdown", type=int, default=0, metavar="STEPS", help="profile STEPS "
                   "decode steps per mode and level (an untimed extra run): attention, linear, "
                   "selection and other ms per step beside the roofline")


def run(args: argparse.Namespace) -> int:
    rows = run_throughput_bench(args)
    return 1 if any("error" in r for r in rows) else 0  # a peer crashed: its rows did not run
