"""`oasiskv generate | serve | bench decode | eval recall | train-drafter`: the command line
over the same config as `LLM(...)`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from oasiskv.bench.pareto import add_parser as add_pareto_parser
from oasiskv.bench.serve import add_parser as add_serve_bench_parser
from oasiskv.cli_input import Parser, read_prompt
from oasiskv.config import CacheConfig, EngineConfig
from oasiskv.disagg.handoff import TRANSFERS
from oasiskv.engine_args import add_engine_flags, engine_kwargs
from oasiskv.spec.train import TrainSpec


def _cmd_generate(args: argparse.Namespace) -> int:
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


def _cmd_pd(args: argparse.Namespace) -> int:
    """Prefill and decode workers started here for a demo; prints the answer and what the
    hand-over moved."""
    import contextlib

    from oasiskv import SamplingParams
    from oasiskv.disagg.mooncake import local_master
    from oasiskv.disagg.pd import DisaggregatedLLM

    kwargs = {"kv_mode": "sparse", **engine_kwargs(args)}
    decode = {"f_host": kwargs.pop("f_host", 1.0)}
    if args.serve:
        from oasiskv.config import parse_bytes
        from oasiskv.disagg.launch import serve_local

        return serve_local(kwargs, args.prefill_workers, args.decode_workers,
                           parse_bytes(args.store_bytes), args.host, args.port, args.transfer,
                           decode)
    prompt = read_prompt(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.sampling_seed, ignore_eos=args.ignore_eos)
    with contextlib.ExitStack() as stack:
        if args.mooncake:  # a master of our own, its ports hidden in a private namespace
            kwargs["remote_store"] = f"mooncake://{stack.enter_context(local_master()).address}"
        pd = DisaggregatedLLM(transfer=args.transfer, decode=decode, **kwargs)
        stack.callback(pd.close)
        if args.chat:
            tok = pd.decode.tokenizer
            prompt = list(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        out = pd.generate([prompt], params)[0]
        stats = pd.decode.stats()
        h = pd.handoffs.get(out.request_id)
    print(out.text)
    m = out.metrics
    line = (f"[oasiskv pd] prompt {m.num_prompt_tokens} tok | generated "
            f"{m.num_generated_tokens} tok ({out.finish_reason}) | TTFT {m.ttft or 0:.2f} s")
    if h is not None:
        full = h.num_prompt_blocks * len(h.kept) * h.block_bytes
        what = "slot blocks (the slab)" if h.slab_namespace else "prompt blocks"
        line += (f"\n[oasiskv pd] {args.transfer} transfer: {h.kept_blocks} {what} of "
                 f"{h.num_prompt_blocks * len(h.kept)} prompt blocks (all layers), "
                 f"{h.admission_bytes / _MiB:.1f} MiB at admission (the whole prompt: "
                 f"{full / _MiB:.1f} MiB) | decode-time store reads "
                 f"{stats['remote_bytes'] / _MiB:.1f} MiB | decode-host KV peak "
                 f"{stats['host_cache_peak_blocks']} blocks per layer")
    print(line, file=sys.stderr)
    if out.error:
        print(f"oasiskv: error: {out.error}", file=sys.stderr)
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
    from oasiskv.report import markdown_table

    cols = [("step", "step"), ("seqs", "seqs"), ("prefill_tokens", "prefill tok"),
            ("decode_tokens", "decode tok"), ("time_s", "time s")]
    if steps and "predicted" in steps[0]:
        cols += [(k, k.replace("_", " ")) for k in _STEP_COLUMNS]
    return markdown_table(steps, cols)


def _cmd_bench_decode(args: argparse.Namespace) -> int:
    from oasiskv.bench.decode import run_decode_bench

    run_decode_bench(args)
    return 0


def _cmd_eval_recall(args: argparse.Namespace) -> int:
    from oasiskv.eval.recall import run_recall_eval

    run_recall_eval(args)
    return 0


def _cmd_bench_throughput(args: argparse.Namespace) -> int:
    from oasiskv.bench.throughput import run_throughput_bench

    rows = run_throughput_bench(args)
    return 1 if any("error" in r for r in rows) else 0  # a peer crashed: its rows did not run


def _cmd_bench_pd(args: argparse.Namespace) -> int:
    from oasiskv.bench.pd import run_pd_bench

    run_pd_bench(args)
    return 0


def _cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from oasiskv.bench.pipeline import run_pipeline_bench

    run_pipeline_bench(args)
    return 0


def _cmd_eval_fidelity(args: argparse.Namespace) -> int:
    from oasiskv.eval.fidelity import run_fidelity_eval

    run_fidelity_eval(args)
    return 0


def _cmd_eval_ruler(args: argparse.Namespace) -> int:
    from oasiskv.eval.ruler import run_ruler_eval

    run_ruler_eval(args)
    return 0


def _cmd_train_drafter(args: argparse.Namespace) -> int:
    from oasiskv.engine.engine import LLMEngine
    from oasiskv.report import markdown_table
    from oasiskv.spec.train import TrainSpec, run

    spec = TrainSpec(model=args.model, out=args.out, data=args.data, heldout=args.heldout,
                     tokens=args.tokens, heldout_tokens=args.heldout_tokens, chunk=args.chunk,
                     epochs=args.epochs, batch=args.batch, lr=args.lr,
                     draft_vocab=args.draft_vocab, self_tokens=args.self_tokens,
                     self_prompt=args.self_prompt, train_dtype=args.train_dtype,
                     soft_weight=args.soft_weight, feature_weight=args.feature_weight,
                     weight_decay=args.weight_decay, feature_noise=args.feature_noise,
                     seed=args.seed)
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    # room for GENERATE_BATCH whole chunks: the own continuations are generated together
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=args.model, num_threads=args.num_threads, device_kv_budget="2GiB"))
    result = run(engine, spec, aux)
    held = result["heldout"]
    print(f"trained {args.out}: {result['steps']} steps on {result['train_tokens']} tokens "
          f"(features {result['features_s']:.0f} s, training {result['train_s']:.0f} s), "
          f"loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}")
    print(f"held-out {spec.heldout} text ({held['rows']} rows): draft accuracy greedy "
          f"{held['greedy_accuracy']:.3f}, sampled T=0.7 {held['sampled_accuracy']:.3f} "
          f"(unigram baseline {held['unigram_accuracy']:.3f}); "
          f"last training chunks: {result['train_last']['greedy_accuracy']:.3f}")
    print(markdown_table(held["by_confidence"], [
        ("target_p", "target's T=0.7 p of its greedy token"), ("share", "share of rows"),
        ("greedy_accuracy", "draft right")]))
    own_greedy, own_sampled = result["heldout_own_greedy"], result["heldout_own_sampled"]
    print(f"the target's own continuations of {spec.heldout} passages (what it drafts for at "
          f"run time): greedy decoding {own_greedy['greedy_accuracy']:.3f} "
          f"({own_greedy['rows']} rows; outside loops {own_greedy['outside_loops_accuracy']:.3f}"
          f", {own_greedy['in_loops_fraction']:.0%} of rows in loops); T=0.7 decoding: "
          f"acceptance {own_sampled['sampled_accuracy']:.3f}, argmax match "
          f"{own_sampled['greedy_accuracy']:.3f} ({own_sampled['in_loops_fraction']:.0%} of "
          f"rows in loops)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _add_setting_flags(p: argparse.ArgumentParser) -> None:
    """`eval passkey|needle|ppl|all|ruler`: the dense and sparse settings to compare on the
    same prompts, and how they run."""
    p.add_argument("--kv-mode", default="dense,sparse", help="dense and/or sparse")
    p.add_argument("--predictor", default="lookahead,previous,exact",
                   help="sparse predictors to compare")
    p.add_argument("--top-k", default="32,128", help="sparse K values")
    p.add_argument("--block-size", default=str(CacheConfig.block_size),
                   help="sparse: tokens per KV block (values to compare)")
    p.add_argument("--token-budget", default=None,
                   help="sparse: resident tokens per KV head instead of --top-k: K = "
                   "budget / B for each --block-size (e.g. 512,2048 with --block-size "
                   "16,8 compares finer blocks at K=32's and K=128's budgets)")
    p.add_argument("--rerank", default=f"{CacheConfig.rerank:g}",
                   help="sparse: re-rank the best c*K blocks by attention over their keys "
                   "(values of c to compare, e.g. 0,2; 0 = off)")
    p.add_argument("--summary-dtype", default="auto",
                   help="sparse: block summaries' dtype, values to compare (auto = "
                   "bfloat16 for float32 K/V, else the KV dtype; float32, float16, "
                   "bfloat16)")
    p.add_argument("--score-aggregation", default=CacheConfig.score_aggregation,
                   help="sparse: how a KV head's query heads combine block scores (values to "
                   "compare: sum, softmax-sum, softmax-max)")
    p.add_argument("--rerank-source", default=CacheConfig.rerank_source,
                   help="sparse, with --rerank: where the re-ranking reads keys (values to "
                   "compare: host, int8, int4)")
    p.add_argument("--dense-layers", default="0",
                   help="sparse: first layers kept dense (values to compare, e.g. 0,1,2)")
    p.add_argument("--summary-splits", default="1",
                   help="sparse: min/max summaries per block (values to compare, e.g. 1,2)")
    p.add_argument("--sink-blocks", default="0",
                   help="sparse: first blocks always kept (values to compare, e.g. 0,4)")
    p.add_argument("--recent-blocks", default="0",
                   help="sparse: last complete blocks always kept (values to compare)")
    p.add_argument("--drafter", default="resync",
                   help="lookahead's drafter: self, ngram, resync, eagle:DIR, "
                   "resync-eagle:DIR")
    p.add_argument("--f-hbm", default=str(CacheConfig.f_hbm),
                   help="sparse: admission caps to compare (e.g. 0.05,1.0,auto)")
    p.add_argument("--group", type=int, default=2,
                   help="prompts prefilled together and decoded as one batch (every "
                   "setting's engine holds the group's K/V: memory grows with it)")
    p.add_argument("--no-chat", action="store_true",
                   help="plain prompts even when the model has a chat template")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="oasiskv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("--prompt", help="prompt text")
    gen.add_argument("--prompt-file", help="file whose contents are the prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-top-k", type=int, default=-1,
                     help="sample from the k most likely tokens (-1: all); --top-k is the "
                     "sparse working-set size")
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", help="write the output, figures and per-step log to this file")
    gen.add_argument("--trace", help="write a Chrome trace (chrome://tracing, Perfetto) of "
                     "the sparse prefetch pipeline and the model's layers to this file")
    gen.add_argument("--step-stats", action="store_true",
                     help="print a table of every step (tokens, time; sparse: blocks, bytes)")
    add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    pdp = sub.add_parser("pd", help="prefill and decode workers (partial KV transfer over a "
                         "remote store) for one prompt")
    pdp.add_argument("--prompt", help="prompt text")
    pdp.add_argument("--prompt-file", help="file whose contents are the prompt")
    pdp.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    pdp.add_argument("--max-tokens", type=int, default=128)
    pdp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    pdp.add_argument("--sampling-seed", type=int, default=None)
    pdp.add_argument("--ignore-eos", action="store_true")
    pdp.add_argument("--transfer", default="partial", choices=TRANSFERS,
                     help="partial: the union of the first step's blocks; slab: its per-head "
                     "slices (the slab); full: the whole prompt")
    pdp.add_argument("--mooncake", action="store_true",
                     help="start a Mooncake master here (private network namespace) and run "
                     "the prefill worker in its own process over it")
    pdp.add_argument("--serve", action="store_true",
                     help="serve instead of one prompt: a Mooncake master, a storage node, "
                     "prefill and decode workers and a router on this machine")
    pdp.add_argument("--prefill-workers", type=int, default=1, help="with --serve")
    pdp.add_argument("--decode-workers", type=int, default=1, help="with --serve")
    pdp.add_argument("--host", default="127.0.0.1", help="with --serve: the router's address")
    pdp.add_argument("--port", type=int, default=8000, help="with --serve: the router's port")
    pdp.add_argument("--store-bytes", default="1GiB",
                     help="with --serve: memory the storage node lends the store")
    add_engine_flags(pdp)
    pdp.set_defaults(func=_cmd_pd)

    from oasiskv.serve.server import add_parser as add_serve_parser  # light: no server imports

    add_serve_parser(sub)
    from oasiskv.serve.router_cli import add_parser as add_router_parser

    add_router_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                      required=True)
    dec = bench.add_parser("decode", help="our dense decode vs HF transformers generate")
    dec.add_argument("--context", default="4096", help="prompt lengths, comma-separated")
    dec.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    dec.add_argument("--output-len", type=int, default=32)
    dec.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    dec.add_argument("--json", help="write the figures to this file")
    add_engine_flags(dec)
    dec.set_defaults(func=_cmd_bench_decode)

    pipe = bench.add_parser("pipeline", help="prefetch: frozen vs sync vs async, per f_hbm")
    pipe.add_argument("--model", default="smollm2-135m")
    pipe.add_argument("--context", type=int, default=6144, help="prompt length in tokens")
    pipe.add_argument("--batch", type=int, default=8, help="requests decoding together")
    pipe.add_argument("--top-k", type=int, default=32)
    pipe.add_argument("--predictor", default="lookahead", choices=("lookahead", "previous"))
    pipe.add_argument("--drafter", default="resync", help="lookahead's drafter")
    pipe.add_argument("--f-hbm", default="0.02,0.05,0.1,1.0,auto",
                      help="admission caps to compare (fractions of K, or auto)")
    pipe.add_argument("--steps", type=int, default=16, help="measured decode steps")
    pipe.add_argument("--warmup", type=int, default=3, help="decode steps before measuring")
    pipe.add_argument("--trace", help="Chrome trace of the async run at the first f_hbm")
    pipe.add_argument("--repeats", type=int, default=1,
                      help="rounds of the three modes per f_hbm (median shown, every round's "
                      "ratio to frozen listed)")
    pipe.add_argument("--kv-cache-dir", default=None,
                      help="keep the prompts' computed K/V here and reuse it in later runs "
                      "(default: a temporary directory)")
    pipe.add_argument("--dtype", default="float32")
    pipe.add_argument("--summary-dtype", default="auto",
                      help="block summaries: auto (bfloat16 for float32 K/V, else the KV "
                      "dtype), float32, float16 or bfloat16 (half the bytes the predict stage "
                      "reads in a float32 run)")
    pipe.add_argument("--remote-store", default="none",
                      help="the tier under the host: none (the host holds every block), "
                      "inprocess, mooncake (a master and a storage node process started here, "
                      "reads cross Mooncake's TCP transport) or mooncake://HOST:PORT")
    pipe.add_argument("--f-host", type=float, default=1.0,
                      help="with a remote store: share of each prompt's blocks the host keeps; "
                      "the remote fetch stage reads the rest when predicted")
    pipe.add_argument("--num-threads", type=int, default=None)
    pipe.add_argument("--json", help="write the figures to this file")
    pipe.add_argument("--plot", help="write a bar plot (PNG) of step time per f_hbm and mode")
    pipe.set_defaults(func=_cmd_bench_pipeline)

    thr = bench.add_parser("throughput", help="dense vs sparse under one device KV budget, "
                           "concurrency sweep")
    thr.add_argument("--model", default="smollm2-135m")
    thr.add_argument("--context", default="4096,7168", help="prompt lengths in tokens")
    thr.add_argument("--output-len", type=int, default=64)
    thr.add_argument("--concurrency", default="1,2,4,8,16,32,dense-max",
                     help="requests arriving at once (the same first prompts at every level); "
                     "dense-max: per context, the most requests whose whole K/V fits the "
                     "device budget (the largest concurrency dense can hold)")
    thr.add_argument("--device-kv-budget", default="1GiB")
    thr.add_argument("--host-kv-budget", default="auto",
                     help="sparse: host tier bytes; auto: what the largest level's requests hold")
    thr.add_argument("--kv-mode", default="dense,sparse")
    thr.add_argument("--top-k", type=int, default=32)
    thr.add_argument("--f-hbm", default="0.05",
                     help="sparse fetch cap; several (0.02,0.05,0.1,1.0) add an ablation table")
    thr.add_argument("--kv-cache-dir", default=None,
                     help="keep the prompts' computed K/V here and reuse it in later runs "
                     "(default: a temporary directory)")
    thr.add_argument("--peer", default="",
                     help="other engines on the same prompts: hf (transformers generate), llamacpp "
                     "(llama.cpp on the same GGUF; scripts/setup_llamacpp.sh builds it)")
    thr.add_argument("--predictor", default="lookahead")
    thr.add_argument("--rerank", type=float, default=CacheConfig.rerank,
                     help="sparse: re-rank the best c*K blocks by attention over their keys "
                     "(0 = off: the Quest bound alone)")
    thr.add_argument("--rerank-source", default=CacheConfig.rerank_source,
                     help="sparse, with --rerank: int8 or int4 (the device's key copy, "
                     "charged to the budget) or host")
    thr.add_argument("--repeats", type=int, default=1,
                     help="runs of every mode per level, in turn; the row is the median-TPS run")
    thr.add_argument("--dtype", default="float32")
    thr.add_argument("--num-threads", type=int, default=None)
    thr.add_argument("--json", help="write the figures to this file")
    thr.add_argument("--plot", help="write TPS and running batch vs concurrency (PNG)")
    thr.add_argument("--breakdown", type=int, default=0, metavar="STEPS", help="profile STEPS "
                     "decode steps per mode and level (an untimed extra run): attention, linear, "
                     "selection and other ms per step beside the roofline")
    thr.set_defaults(func=_cmd_bench_throughput)
    add_pareto_parser(bench)
    add_serve_bench_parser(bench)

    pd = bench.add_parser("pd", help="prefill-decode disaggregation: partial, slab and full "
                          "transfer, per decode-host residency f_host")
    pd.add_argument("--model", default="smollm2-135m")
    pd.add_argument("--context", default="4096,7168", help="prompt lengths in tokens")
    pd.add_argument("--requests", type=int, default=4, help="requests arriving at once")
    pd.add_argument("--transfer", default=",".join(TRANSFERS))
    pd.add_argument("--f-host", default="0.2,1.0", help="decode-host residency ratios")
    pd.add_argument("--output-len", type=int, default=32)
    pd.add_argument("--top-k", type=int, default=32)
    pd.add_argument("--f-hbm", default="0.05")
    pd.add_argument("--device-kv-budget", default="1GiB")
    pd.add_argument("--host-kv-budget", default="8GiB", help="per worker")
    pd.add_argument("--remote-store", default=None,
                    help="mooncake://HOST:PORT: the prefill worker in its own process over a "
                    "Mooncake master there (default: both workers here, an in-process store)")
    pd.add_argument("--kv-cache-dir", default=None,
                    help="keep the prompts' computed K/V here and reuse it in later runs")
    pd.add_argument("--dtype", default="float32")
    pd.add_argument("--summary-dtype", default="auto",
                    help="block summaries: auto (bfloat16 for float32 K/V, else the KV dtype), "
                    "float32, float16 or bfloat16 (half the bytes a hand-over sends for them)")
    pd.add_argument("--num-threads", type=int, default=None)
    pd.add_argument("--json", help="write the figures to this file")
    pd.add_argument("--plot", help="write the store-read bandwidth timeline (PNG)")
    pd.set_defaults(func=_cmd_bench_pd)

    evals = sub.add_parser("eval", help="measuring tools").add_subparsers(dest="eval",
                                                                         required=True)
    rec = evals.add_parser("recall", help="per-layer recall of next-step top-K block "
                           "predictors (previous query, lookahead drafts) on dense decode")
    rec.add_argument("--model", default="smollm2-135m",
                     help="model alias, HF directory or .gguf file")
    rec.add_argument("--context", type=int, default=7000, help="prompt length in tokens")
    rec.add_argument("--prompts", type=int, default=3,
                     help="how many of the 12 fixed Austen prompts to run (the study protocol: 3)")
    rec.add_argument("--steps", type=int, default=48, help="scored step transitions")
    rec.add_argument("--top-k", default="32,128", help="K values (blocks per KV head)")
    rec.add_argument("--predictor", default="lookahead,previous",
                     help="comma-separated: lookahead, previous")
    rec.add_argument("--drafter", default="self,ngram,resync,oracle",
                     help="lookahead drafters: self, ngram, resync, oracle (true next token), "
                     "eagle:DIR (a head from train-drafter), resync-eagle:DIR (the self chain "
                     "while right, the head after a miss)")
    rec.add_argument("--draft-context", choices=("sparse", "dense"), default="sparse",
                     help="what a draft attends to: the step's exact top-K + active block "
                     "(sparse, the engine's working set) or everything (dense: upper bound)")
    rec.add_argument("--sync-start", action="store_true",
                     help="step 0's drafts are the true next token (draft chains start in "
                     "sync); default: each drafter's own cold-start guess")
    rec.add_argument("--temperature", type=float, default=0.0,
                     help="> 0: follow a trajectory sampled at this temperature (seeded)")
    rec.add_argument("--seed", type=int, default=0, help="sampling seed of the trajectory")
    rec.add_argument("--rerank", type=float, default=0.0,
                     help="c >= 1: also lookahead rows whose best c*K blocks by summary score "
                     "are re-ranked by the draft query's attention over their keys")
    rec.add_argument("--num-drafts", type=int, default=1,
                     help="draft rows per K and drafter (its best guesses), mixed as the engine "
                     "mixes them (greedy: the first predicts; sampled: the mean weighted by "
                     "each one's chance of being sampled); the next step's draft chain goes on "
                     "from the row that was right (the engine's num_drafts)")
    rec.add_argument("--block-size", type=int, default=16, help="tokens per block (B)")
    rec.add_argument("--dtype", default="float32")
    rec.add_argument("--num-threads", type=int, default=None)
    rec.add_argument("--json", help="write the figures to this file")
    rec.add_argument("--plot", help="write a per-layer recall plot (PNG) to this file")
    rec.set_defaults(func=_cmd_eval_recall)

    for task in ("passkey", "needle", "ppl", "all"):
        fid = evals.add_parser(task, help=f"fidelity, dense vs sparse on the same prompts: "
                               f"{'passkey, needle and ppl' if task == 'all' else task}")
        fid.add_argument("--model", default="smollm2-135m",
                         help="model alias, HF directory or .gguf file")
        fid.add_argument("--context", default="4096,7168", help="prompt lengths in tokens")
        fid.add_argument("--samples", type=int, default=20, help="prompts per task and context")
        fid.add_argument("--seed", type=int, default=0)
        fid.add_argument("--forced-drafts", default="known",
                         help="ppl with lookahead: the teacher-forced next token is the draft "
                         "(known) and/or the drafter guesses it (guessed; values to compare)")
        fid.add_argument("--ppl-samples", type=int, default=None,
                         help="passages for ppl (default: --samples)")
        fid.add_argument("--ppl-tokens", type=int, default=64,
                         help="ppl: teacher-forced tokens scored at the end of each passage")
        fid.add_argument("--agree-tokens", type=int, default=64,
                         help="ppl passages: greedy tokens compared with dense")
        fid.add_argument("--out", "--json", dest="out", help="write the figures to this file")
        _add_setting_flags(fid)
        fid.set_defaults(func=_cmd_eval_fidelity, task=task)

    ruler = evals.add_parser("ruler", help="NVIDIA's RULER tasks (nvidia-long-context-eval), "
                             "dense vs sparse on the same prompts, scored as RULER scores")
    ruler.add_argument("--model", default="smollm2-135m",
                       help="model alias, HF directory or .gguf file")
    ruler.add_argument("--context", default="4096,8192",
                       help="RULER's max_seq_length: prompt + tokens to generate")
    ruler.add_argument("--tasks", default="all",
                       help="comma-separated RULER tasks (niah_single_1, ..., vt, cwe, fwe, "
                       "qa_1, qa_2) or all")
    ruler.add_argument("--samples", type=int, default=20, help="prompts per task and context")
    ruler.add_argument("--seed", type=int, default=42, help="RULER's random_seed (its default)")
    ruler.add_argument("--out", "--json", dest="out", help="write the figures to this file")
    _add_setting_flags(ruler)
    ruler.set_defaults(func=_cmd_eval_ruler)

    tr = sub.add_parser("train-drafter", help="train an EAGLE-style draft head for a model "
                        "(use it with --drafter eagle:OUT)")
    tr.add_argument("--model", default="smollm2-135m",
                    help="model alias, HF directory or .gguf file")
    tr.add_argument("--data", default="austen", help="training text: austen (the six novels)")
    tr.add_argument("--heldout", default="persuasion", help="novel kept out for evaluation")
    tr.add_argument("--out", required=True, help="directory for the head and feature cache")
    tr.add_argument("--tokens", type=int, default=TrainSpec.tokens, help="training tokens")
    tr.add_argument("--heldout-tokens", type=int, default=TrainSpec.heldout_tokens)
    tr.add_argument("--epochs", type=int, default=TrainSpec.epochs)
    tr.add_argument("--chunk", type=int, default=TrainSpec.chunk,
                    help="tokens per training sequence = the head's attention window")
    tr.add_argument("--batch", type=int, default=TrainSpec.batch, help="chunks per step")
    tr.add_argument("--lr", type=float, default=TrainSpec.lr)
    tr.add_argument("--draft-vocab", type=int, default=TrainSpec.draft_vocab,
                    help="the head predicts over the target's most frequent greedy tokens")
    tr.add_argument("--self-tokens", type=int, default=TrainSpec.self_tokens,
                    help="training tokens of the target's own continuations of training "
                    "passages (greedy and T=0.7 in turn), beside the novels' text")
    tr.add_argument("--self-prompt", type=int, default=TrainSpec.self_prompt,
                    help="tokens of a passage the target continues to a whole chunk")
    tr.add_argument("--train-dtype", default=TrainSpec.train_dtype,
                    choices=["auto", "float32", "bfloat16"],
                    help="autocast dtype of training (auto: bfloat16 where the CPU has native "
                    "bf16 matmuls, 1.7x faster here)")
    tr.add_argument("--soft-weight", type=float, default=TrainSpec.soft_weight,
                    help="weight of the KL divergence to the target's whole next-token "
                    "distribution (from its last-layer features), beside the greedy token")
    tr.add_argument("--feature-weight", type=float, default=TrainSpec.feature_weight,
                    help="weight of the smooth L1 loss to the target's final hidden state "
                    "(EAGLE-1's feature regression)")
    tr.add_argument("--weight-decay", type=float, default=TrainSpec.weight_decay,
                    help="AdamW weight decay of the head's weights")
    tr.add_argument("--feature-noise", type=float, default=TrainSpec.feature_noise,
                    help="uniform noise added to the input features in training, as a "
                    "fraction of their RMS (a regulariser, EAGLE-1's augmentation)")
    tr.add_argument("--aux-layers", default=None,
                    help="target layers fused as features (default: 2, L/2, L-1)")
    tr.add_argument("--seed", type=int, default=TrainSpec.seed)
    tr.add_argument("--num-threads", type=int, default=None)
    tr.add_argument("--json", help="write the figures to this file")
    tr.set_defaults(func=_cmd_train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"oasiskv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

