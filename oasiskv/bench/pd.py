"""`oasiskv bench pd`: prefill-decode disaggregation, partial, slab and full transfer, per
f_host.

For each context, the same unique prompts run through a prefill worker and a decode worker
(`disagg.pd.DisaggregatedLLM`) once per (transfer, f_host). Per request it reports the bytes
that reach the decode host before its first step there (admission), the prompt blocks it reads
from the store while decoding, the KV it keeps on the decode host (mean and peak over its
steps), TPOT and TTFT; per setting, TPS and the store-read bandwidth of every decode step
(mean and p99, plotted as a timeline).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from oasiskv.bench.common import (
    agreement,
    prefix_kv_files,
    print_model_note,
    summary_label,
    unique_prompts,
)
from oasiskv.bench.sparse_options import parse_sparse
from oasiskv.config import EngineConfig
from oasiskv.disagg.pd import DisaggregatedLLM
from oasiskv.engine.engine import LLMEngine
from oasiskv.engine_args import add_device_flag
from oasiskv.kv.handoff import TRANSFERS
from oasiskv.report import (
    markdown_table,
    parse_list,
    platform_name,
    pyplot,
    save_figure,
    write_json,
)
from oasiskv.sampling_params import SamplingParams

REQUESTS = [("context", "context"), ("transfer", "transfer"), ("f_host", "f_host"),
            ("request", "request"), ("admission_mb", "admission MB"),
            ("kept_blocks", "blocks sent"), ("remote_mb", "decode remote MB"),
            ("host_mean_mb", "host KV mean MB"), ("host_peak_mb", "host KV peak MB"),
            ("tpot_ms", "TPOT ms"), ("ttft_s", "TTFT s"), ("finish", "finish")]
SUMMARY = [("context", "context"), ("transfer", "transfer"), ("f_host", "f_host"),
           ("admission_mb", "admission MB / req"), ("admission_x", "full / this"),
           ("remote_mb", "decode remote MB / req"), ("host_peak_mb", "host KV peak MB / req"),
           ("host_x", "host KV: full f_host=1 / this"), ("tps", "TPS"),
           ("bw_mean", "store read GB/s mean"), ("bw_p99", "p99"),
           ("agreement", "agreement")]


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0


def run_setting(kwargs: dict, transfer: str, f_host: float, prompts: list[list[int]],
                kv_files: list[Path], output_len: int, remote_store: str | None) -> dict:
    """One DisaggregatedLLM over the prompts; per-request rows and the step timeline."""
    pd = DisaggregatedLLM(transfer=transfer, remote_store=remote_store,
                          decode={"f_host": f_host}, **kwargs)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    host = {}  # request id -> host KV blocks (layer blocks) at each of its decode steps
    fetched = {}  # request id -> blocks read from the store while decoding, so far

    def sample(engine: LLMEngine) -> None:
        for seq in engine.scheduler.running:
            if seq.host_cache is not None:
                host.setdefault(seq.request_id, []).append(seq.host_cache.layer_blocks())
                fetched[seq.request_id] = seq.host_cache.fetched

    t0 = time.perf_counter()
    start = len(pd.decode.step_log)
    outs = pd.generate(prompts, params, use_tqdm=False,
                       prefix_kv=[load_file(str(f))["kv"] for f in kv_files], on_step=sample)
    wall = time.perf_counter() - t0
    block_bytes = pd.decode.remote.store.block_bytes
    steps = [e for e in list(pd.decode.step_log)[start:] if e["decode_tokens"]]
    timeline = [(e["time_s"], e.get("remote_bytes", 0) / e["time_s"] / 1e9) for e in steps]
    rows = []
    for i, o in enumerate(outs):
        h = pd.handoffs.get(o.request_id)
        blocks = host.get(o.request_id, [0])
        rows.append({
            "transfer": transfer, "f_host": f_host, "request": i, "finish": o.finish_reason,
            "admission_mb": h.admission_bytes / 2**20 if h else None,
            "kept_blocks": h.kept_blocks if h else None,
            "remote_mb": fetched.get(o.request_id, 0) * block_bytes / 2**20,
            "host_mean_mb": sum(blocks) / len(blocks) * block_bytes / 2**20,
            "host_peak_mb": max(blocks) * block_bytes / 2**20,
            "tpot_ms": 1e3 * (o.metrics.tpot or 0), "ttft_s": o.metrics.ttft,
            "tokens": o.token_ids})
    pd.close()
    return {"rows": rows, "timeline": timeline, "wall_s": wall,
            "tps": sum(len(o.token_ids) for o in outs) / wall}


def plot(settings: list[dict], path: str, title: str) -> None:
    plt = pyplot()
    contexts = sorted({s["context"] for s in settings})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        for s in (s for s in settings if s["context"] == context):
            t = torch.tensor([dt for dt, _ in s["timeline"]]).cumsum(0).tolist()
            bw = [b for _, b in s["timeline"]]
            (line,) = ax.plot(t, bw, lw=1, label=f"{s['transfer']} f_host={s['f_host']}")
            ax.axhline(s["bw_mean"], color=line.get_color(), ls="--", lw=0.8)
            ax.axhline(s["bw_p99"], color=line.get_color(), ls=":", lw=0.8)
        ax.set(title=f"{context} tokens", xlabel="decode time (s)",
               ylabel="store reads per step (GB/s); -- mean, : p99")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def run_pd_bench(args: argparse.Namespace) -> list[dict]:
    t_start = time.perf_counter()
    print_model_note(args.model)
    contexts, transfers = parse_list(args.context), parse_list(args.transfer, str)
    f_hosts = parse_list(args.f_host, float)
    bad = [t for t in transfers if t not in TRANSFERS]
    if bad:
        raise ValueError(f"--transfer takes {', '.join(TRANSFERS)}; got {', '.join(bad)}")
    kwargs = {"model": args.model, "dtype": args.dtype, "kv_mode": "sparse",
              "top_k": args.top_k, "f_hbm": args.f_hbm, "max_num_seqs": args.requests,
              "summary_dtype": args.summary_dtype,
              "device_kv_budget": args.device_kv_budget, "host_kv_budget": args.host_kv_budget,
              "device": args.device}
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    if args.sparse:
        opts = parse_sparse(args.sparse)
        if "f_host" in opts:
            raise ValueError("--sparse: f_host is set per setting by --f-host")
        kwargs |= opts
    for f in f_hosts:  # bad settings fail now, not after the prefill
        EngineConfig.from_kwargs(**kwargs, remote_store="inprocess", f_host=f)
    prefill = LLMEngine(EngineConfig.from_kwargs(model=args.model, dtype=args.dtype,
                                                 num_threads=args.num_threads,
                                                 device=args.device))
    settings, rows, prefill_s = [], [], {}
    with tempfile.TemporaryDirectory(prefix="oasiskv-bench-") as tmp:
        for context in contexts:
            prompts, source = unique_prompts(prefill.tokenizer, args.requests, context)
            files, prefill_s[context] = prefix_kv_files(
                prefill, prompts, Path(args.kv_cache_dir or tmp), f"prefill {context}")
            runs = []
            for transfer in transfers:
                for f_host in f_hosts:
                    run = run_setting(kwargs, transfer, f_host, prompts, files,
                                      args.output_len, args.remote_store)
                    run.update(context=context, transfer=transfer, f_host=f_host, text=source)
                    runs.append(run)
                    print(f"{context} {transfer} f_host={f_host}: {run['tps']:.1f} tok/s",
                          flush=True)
            for run in runs:
                for r in run["rows"]:
                    r["context"] = context
                done = [r for r in run["rows"] if r["admission_mb"] is not None]
                run.update({k: sum(r[k] for r in done) / max(len(done), 1)
                            for k in ("admission_mb", "remote_mb", "host_peak_mb")})
                bws = [b for _, b in run["timeline"]]
                run.update(bw_mean=sum(bws) / max(len(bws), 1), bw_p99=p99(bws))
            full = next((r for r in runs if r["transfer"] == "full" and r["f_host"] == 1.0),
                        None)
            for run in runs:
                if full is not None:
                    run["admission_x"] = full["admission_mb"] / run["admission_mb"]
                    run["host_x"] = full["host_peak_mb"] / run["host_peak_mb"]
                    run["agreement"] = agreement([r["tokens"] for r in run["rows"]],
                                                 [r["tokens"] for r in full["rows"]])
                rows += [{k: v for k, v in r.items() if k != "tokens"} for r in run["rows"]]
                settings.append({k: v for k, v in run.items() if k != "rows"})
    elapsed = time.perf_counter() - t_start
    store = args.remote_store or "inprocess (one node)"
    print(f"\n## prefill-decode disaggregation, {args.model}: K={kwargs['top_k']}, f_hbm "
          f"{kwargs['f_hbm']}, summaries {summary_label(args.summary_dtype, args.dtype)}, "
          f"{f'--sparse {args.sparse}, ' if args.sparse else ''}"
          f"{args.requests} requests at once, "
          f"{args.output_len} greedy tokens each; store {store}; "
          f"{torch.get_num_threads()} threads, {platform_name()}\n")
    print(markdown_table(rows, REQUESTS))
    print("\n### per setting\n")
    print(markdown_table(settings, SUMMARY))
    print(f"\nadmission = K/V the decode worker reads before its first step (partial: the "
          f"per-layer union of the blocks of the working sets the prefill worker's extra "
          f"decode step chose; slab: those working sets' per-head slices; full: every prompt "
          f"block) + summaries, active block and working sets. host KV = the "
          f"request's blocks on the decode host (all layers), sampled after every decode step. "
          f"Prompt K/V comes precomputed from the prefill cache (computed once: "
          f"{', '.join(f'{k}: {v:.0f} s' for k, v in prefill_s.items())}), so TTFT is the "
          f"prefill worker's last token, its extra step and the queue. agreement = greedy "
          f"tokens equal to full f_host=1. {elapsed:.0f} s.")
    write_json(args.json, {"bench": "pd", "model": args.model, "top_k": kwargs["top_k"],
                           "sparse": args.sparse,
                           "summary_dtype": args.summary_dtype, "requests": args.requests,
                           "output_len": args.output_len,
                           "store": store, "prefill_s": prefill_s, "rows": rows,
                           "settings": settings, "elapsed_s": elapsed})
    if args.plot:
        plot(settings, args.plot,
             f"{args.model}: store reads per decode step, K={kwargs['top_k']}")
    return settings


COMMANDS = {"pd": ("prefill-decode disaggregation: partial, slab and full "
                   "transfer, per decode-host residency f_host")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`bench pd`'s flags."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", default="4096,7168", help="prompt lengths in tokens")
    p.add_argument("--requests", type=int, default=4, help="requests arriving at once")
    p.add_argument("--transfer", default=",".join(TRANSFERS))
    p.add_argument("--f-host", default="0.2,1.0", help="decode-host residency ratios")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--top-k", type=int, default=32)
    p.add_argument("--f-hbm", default="0.05")
    p.add_argument("--device-kv-budget", default="1GiB")
    p.add_argument("--host-kv-budget", default="8GiB", help="per worker")
    p.add_argument("--remote-store", default=None,
                   help="mooncake://HOST:PORT: the prefill worker in its own process over a "
                   "Mooncake master there (default: both workers here, an in-process store)")
    p.add_argument("--kv-cache-dir", default=None,
                   help="keep the prompts' computed K/V here and reuse it in later runs")
    p.add_argument("--dtype", default="float32")
    add_device_flag(p)
    p.add_argument("--summary-dtype", default="auto",
                   help="block summaries: auto (bfloat16 for float32 K/V, else the KV dtype), "
                   "float32, float16 or bfloat16 (half the bytes a hand-over sends for them)")
    p.add_argument("--sparse", default=None, metavar="KEY=VAL,...",
                   help="more CacheConfig fields for both workers (rerank=0,"
                   "handoff_summaries=int8); top_k and f_hbm as their flags unless given here")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--plot", help="write the store-read bandwidth timeline (PNG)")


def run(args: argparse.Namespace) -> int:
    run_pd_bench(args)
    return 0
