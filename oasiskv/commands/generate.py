"""`oasiskv generate`: one prompt through `LLM(...)`, the text on stdout and a report of what
it cost (time, device KV; sparse: the per-step working-set figures) on stderr."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from oasiskv.cli_input import add_prompt_arguments, read_prompt
from oasiskv.engine_args import add_engine_flags, engine_kwargs
from oasiskv.report import markdown_table

COMMANDS = {"generate": "generate text for one prompt"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`generate`'s flags: the prompt, sampling, reports, and every engine flag."""
    add_prompt_arguments(p)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-top-k", type=int, default=-1,
                   help="sample from the k most likely tokens (-1: all); --top-k is the "
                   "sparse working-set size")
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", help="write the output, figures and per-step log to this file")
    p.add_argument("--trace", help="write a Chrome trace (chrome://tracing, Perfetto) of "
                   "the sparse prefetch pipeline and the model's layers to this file")
    p.add_argument("--step-stats", action="store_true",
                   help="print a table of every step (tokens, time; sparse: blocks, bytes)")
    add_engine_flags(p)


def run(args: argparse.Namespace) -> int:
    from oasiskv import LLM, SamplingParams

    prompt = read_prompt(args)
    llm = LLM(**engine_kwargs(args))
    tracer = llm.engine.trace() if args.trace else None
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.sampling_top_k, seed=args.sampling_seed,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat:
        out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    else:
        out = llm.generate(prompt, params)[0]
    stats = llm.stats()
    steps = list(llm.engine.step_log)
    llm.close()
    if tracer is not None:
        tracer.write(args.trace)
    print(out.text)
    if args.step_stats:
        print(step_table(steps), file=sys.stderr)
    print(summary(out, stats, steps), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
             "metrics": out.metrics.as_dict(), "stats": stats, "steps": steps}, indent=2))
    return 0 if out.finish_reason != "error" else 1


_MiB = 2**20
_STEP_COLUMNS = ("predicted", "hits", "wanted", "admitted", "h2d_bytes", "d2h_bytes")


def summary(out, stats: dict, steps: list[dict]) -> str:
    """The one-line report of `generate` (two lines for sparse runs)."""
    m = out.metrics
    tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
    held = f"{stats['kv_peak_blocks']} blocks"
    if "summary_ids_peak" in stats:  # sparse: slabs and the summaries of their histories
        copy = " and key copies" if "key_copy_bytes_per_block" in stats else ""
        held += f" + {stats['summary_ids_peak']} block summaries{copy}"
    # the device tensors' real size (KV pool, summaries, key copy), at most device_kv_budget
    line = (f"[oasiskv] prompt {m.num_prompt_tokens} tok | generated {m.num_generated_tokens} "
            f"tok ({out.finish_reason}) | TTFT {m.ttft:.2f} s | TPOT {tpot} | device KV "
            f"{stats['device_peak_bytes'] / _MiB:.1f} MiB peak ({held}) of "
            f"{stats['device_bytes_allocated'] / _MiB:.1f} MiB allocated")
    if "sparse_predicted" not in stats:
        return line
    decodes = [s for s in steps if s["decode_tokens"]]
    mean = {k: sum(s[k] for s in decodes) / max(len(decodes), 1)
            for k in (*_STEP_COLUMNS, "stall_s", "time_s")}
    line += (f"; a {stats['slab_bytes'] / _MiB:.1f} MiB working-set slab per request "
             f"| host KV {stats['host_peak_bytes'] / _MiB:.1f} MiB peak")
    return line + (
        f"\n[oasiskv] sparse, per decode step (mean of {len(decodes)}): predicted "
        f"{mean['predicted']:.0f} block-heads, hits {mean['hits']:.0f}, wanted "
        f"{mean['wanted']:.1f}, admitted {mean['admitted']:.1f} | host->device "
        f"{mean['h2d_bytes'] / 1024:.1f} KiB, device->host {mean['d2h_bytes'] / 1024:.1f} KiB "
        f"| prefetch stall {mean['stall_s'] * 1e3:.1f} of {mean['time_s'] * 1e3:.1f} ms")


def step_table(steps: list[dict]) -> str:
    cols = [("step", "step"), ("seqs", "seqs"), ("prefill_tokens", "prefill tok"),
            ("decode_tokens", "decode tok"), ("time_s", "time s")]
    if steps and "predicted" in steps[0]:
        cols += [(k, k.replace("_", " ")) for k in _STEP_COLUMNS]
    return markdown_table(steps, cols)
