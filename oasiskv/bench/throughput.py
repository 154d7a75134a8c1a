"""`oasiskv bench throughput`: dense vs sparse under one device KV budget, in one run.

For each context, `max(concurrency)` unique Austen prompts (no shared prefixes) are prefilled
once (reported separately) and their K/V kept on disk; for each concurrency c, dense and
sparse run alternately on the same first c prompts, all arriving at once: each engine loads
the prompt K/V (`add_request(prefix_kv=)`), computes the last prompt token and decodes
--output-len greedy tokens. A dense request needs its whole context on the device, so under
the budget dense runs fewer requests at a time (the rest wait; none are dropped); a sparse
request needs one K+1-block slab. Reported per row: TPS (output tokens / wall time from
arrival to the last token), mean TPOT and TTFT, the mean running batch (requests decoding
per step), preemptions, and the sparse/dense ratios. The roofline column is the time a step
would take if it only read the bytes it must (weights + the resident KV of the running batch)
at this machine's measured read bandwidth.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from oasiskv.bench.common import (
    markdown_table,
    parse_list,
    pyplot,
    save_figure,
    unique_prompts,
    write_json,
)
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.sampling_params import SamplingParams


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large streaming read (a sum over a tensor far larger than the caches)."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def run_mode(kwargs: dict, prompts: list[list[int]], kv_files: list[Path],
             output_len: int) -> dict:
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params, prefix_kv=load_file(str(f))["kv"])
           for p, f in zip(prompts, kv_files, strict=True)]
    seqs = [engine.requests[i] for i in ids]
    start = len(engine.step_log)
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - t0
    log = list(engine.step_log)[start:]
    decode_steps = [e for e in log if e["decode_tokens"]]
    stats = engine.stats()
    out = {"tps": sum(s.num_output_tokens for s in seqs) / wall, "wall_s": wall,
           "tpot_ms": 1e3 * sum(s.metrics.tpot or 0 for s in seqs) / len(seqs),
           "ttft_s": sum(s.metrics.ttft or 0 for s in seqs) / len(seqs),
           "running": sum(e["decode_tokens"] for e in decode_steps) / max(len(decode_steps), 1),
           "step_ms": 1e3 * sum(e["time_s"] for e in decode_steps) / max(len(decode_steps), 1),
           "preemptions": stats["preemptions"], "failed": stats["requests_failed"],
           "kv_peak_bytes": stats["kv_peak_bytes"]}
    if engine.sparse is not None:
        c = engine.sparse.counters
        out.update(bytes_per_step=(c.h2d_bytes + c.d2h_bytes) / max(len(decode_steps), 1),
                   hit_rate=c.hits / max(c.predicted, 1), fetch_cap=engine.sparse.fetch_cap)
    engine.close()
    return out


def step_bytes(mode: str, running: float, context: int, kv_per_token: int, weights: int,
               slab_tokens: int) -> float:
    """What one decode step must read: the weights once + the running batch's resident KV."""
    per_request = context if mode == "dense" else slab_tokens
    return weights + running * per_request * kv_per_token


COLUMNS = [("context", "context"), ("concurrency", "conc"), ("mode", "mode"),
           ("tps", "TPS"), ("tps_ratio", "TPS sparse/dense"), ("tpot_ms", "TPOT ms"),
           ("ttft_s", "TTFT s"), ("running", "running"), ("preemptions", "preempt"),
           ("step_ms", "step ms"), ("roofline_ms", "roofline ms"),
           ("bytes_per_step", "fetch B/step"), ("hit_rate", "hit rate")]


def plot(rows: list[dict], path: str, title: str) -> None:
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (context, mode), style in zip(sorted({(r["context"], r["mode"]) for r in rows}),
                                      ["-o", "--o", "-s", "--s", "-^", "--^"], strict=False):
        pts = sorted((r["concurrency"], r) for r in rows
                     if r["context"] == context and r["mode"] == mode)
        xs = [c for c, _ in pts]
        a.plot(xs, [r["tps"] for _, r in pts], style, label=f"{mode} {context}")
        b.plot(xs, [r["running"] for _, r in pts], style, label=f"{mode} {context}")
    for ax, label in ((a, "output tokens / s"), (b, "mean running batch")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests arriving at once)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def run_throughput_bench(args: argparse.Namespace) -> list[dict]:
    t_start = time.perf_counter()
    contexts, levels = parse_list(args.context), parse_list(args.concurrency)
    modes = parse_list(args.kv_mode, str)
    base = {"model": args.model, "dtype": args.dtype, "device_kv_budget": args.device_kv_budget,
            "max_num_seqs": max(levels)}
    if args.num_threads:
        base["num_threads"] = args.num_threads
    sparse_kw = {"kv_mode": "sparse", "top_k": args.top_k, "f_hbm": args.f_hbm,
                 "predictor": args.predictor, "host_kv_budget": args.host_kv_budget}
    prefill = LLMEngine(EngineConfig.from_kwargs(model=args.model, dtype=args.dtype,
                                                 num_threads=args.num_threads))
    mc = prefill.model_config
    kv_per_token = mc.kv_bytes_per_token(prefill.config.torch_dtype)
    weights = sum(p.numel() * p.element_size() for p in prefill.model.parameters())
    bandwidth = read_bandwidth()
    rows, prefill_s = [], {}
    with tempfile.TemporaryDirectory(prefix="oasiskv-bench-") as tmp:
        for context in contexts:
            prompts, source = unique_prompts(prefill.tokenizer, max(levels), context)
            files = []
            t0 = time.perf_counter()
            for i, p in enumerate(tqdm(prompts, desc=f"prefill {context}", unit="prompt")):
                files.append(Path(tmp) / f"{context}_{i}.safetensors")
                save_file({"kv": prefill.compute_prefix_kv(p[:-1])}, str(files[-1]))
            prefill_s[context] = time.perf_counter() - t0
            for c in levels:
                by_mode = {}
                for mode in modes:  # alternate on the same prompts
                    kw = {**base, **(sparse_kw if mode == "sparse" else {"kv_mode": "dense"})}
                    r = run_mode(kw, prompts[:c], files[:c], args.output_len)
                    r.update(context=context, concurrency=c, mode=mode, text=source)
                    r["roofline_ms"] = 1e3 * step_bytes(
                        mode, r["running"], context, kv_per_token, weights,
                        (args.top_k + 1) * prefill.config.cache.block_size) / bandwidth
                    by_mode[mode] = r
                    rows.append(r)
                    print(f"{context} x{c} {mode}: {r['tps']:.1f} tok/s, running "
                          f"{r['running']:.1f}", flush=True)
                if {"dense", "sparse"} <= set(by_mode):
                    sparse, dense = by_mode["sparse"], by_mode["dense"]
                    sparse["tps_ratio"] = sparse["tps"] / dense["tps"]
    elapsed = time.perf_counter() - t_start
    print(f"\n## throughput, {args.model}: device KV budget {args.device_kv_budget}, sparse "
          f"K={args.top_k} f_hbm={args.f_hbm} {args.predictor}, {args.output_len} greedy tokens "
          f"per request, all requests arriving at once; {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s\n")
    print(markdown_table(rows, COLUMNS))
    print(f"\nprefill (once per prompt, shared by both modes): "
          f"{', '.join(f'{k}: {v:.0f} s' for k, v in prefill_s.items())}. roofline = (weights "
          f"{weights / 2**20:.0f} MiB + resident KV of the running batch) / read bandwidth. "
          f"{elapsed:.0f} s.")
    write_json(args.json, {"bench": "throughput", "model": args.model,
                           "device_kv_budget": args.device_kv_budget, "top_k": args.top_k,
                           "f_hbm": args.f_hbm, "output_len": args.output_len,
                           "bandwidth": bandwidth, "prefill_s": prefill_s,
                           "threads": torch.get_num_threads(), "time_s": elapsed, "rows": rows})
    if args.plot:
        plot(rows, args.plot, f"{args.model}: dense vs sparse, budget {args.device_kv_budget}")
    return rows
