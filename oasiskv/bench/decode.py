"""`oasiskv bench decode`: our dense decode vs HF transformers `generate`, same prompts, one run.

Decode throughput is measured after prefill, for both engines: ours times the engine steps
that contain no prefill token; HF's is timed between its first and last generated token (a
StoppingCriteria records the time of every step). Prefill is reported separately.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from oasiskv.bench.common import (
    agreement,
    markdown_table,
    parse_list,
    unique_prompts,
    write_json,
)
from oasiskv.bench.peers import load_hf, timed_generate
from oasiskv.cli import engine_kwargs
from oasiskv.llm import LLM
from oasiskv.sampling_params import SamplingParams


def ours_decode(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[i] for i in ids]
    t0 = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    decoded = sum(s.num_output_tokens - 1 for s in seqs)
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
            "tok_s": decoded / (t2 - t1), "tpot_ms": (t2 - t1) / steps * 1e3,
            "tokens": [s.output_token_ids for s in seqs]}


def hf_decode(model, prompts: list[list[int]], output_len: int) -> dict:
    inputs = torch.tensor(prompts)
    t0 = time.perf_counter()
    out, times = timed_generate(model, inputs, output_len)
    first, last = times[0], times[-1]
    steps = len(times) - 1
    return {"prefill_s": first - t0, "decode_s": last - first, "decode_steps": steps,
            "tok_s": len(prompts) * steps / (last - first), "tpot_ms": (last - first) / steps * 1e3,
            "tokens": out[:, inputs.shape[1]:].tolist()}


def run_decode_bench(args: argparse.Namespace) -> list[dict]:
    contexts, batches = parse_list(args.context), parse_list(args.batch)
    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", max(batches))
    llm = LLM(**kwargs)
    hf = None if args.no_hf else load_hf(llm.engine.config.model, llm.engine.config.torch_dtype)
    # Warm both engines up (allocator, lazy init) so the first measured row is not penalised.
    warm = [list(range(100, 164))]
    ours_decode(llm, warm, 4)
    if hf is not None:
        hf_decode(hf, warm, 4)
    rows = []
    for context in contexts:
        prompts, source = unique_prompts(llm.tokenizer, sum(batches), context)
        offset = 0
        for batch in batches:
            group, offset = prompts[offset:offset + batch], offset + batch
            ours = ours_decode(llm, group, args.output_len)
            row = {"context": context, "batch": batch, "text": source,
                   "ours_tok_s": ours["tok_s"], "ours_tpot_ms": ours["tpot_ms"],
                   "ours_prefill_s": ours["prefill_s"]}
            if hf is not None:
                ref = hf_decode(hf, group, args.output_len)
                row.update(hf_tok_s=ref["tok_s"], hf_tpot_ms=ref["tpot_ms"],
                           hf_prefill_s=ref["prefill_s"], ratio=ours["tok_s"] / ref["tok_s"],
                           greedy_agreement=agreement(ours["tokens"], ref["tokens"]))
            rows.append(row)
            print(markdown_table([row], _COLUMNS), flush=True)
    print(f"\n## decode throughput, {llm.engine.config.model}, {llm.engine.config.dtype}, "
          f"{torch.get_num_threads()} threads, {args.output_len} greedy tokens per request\n")
    print(markdown_table(rows, _COLUMNS))
    print("\ntok/s = output tokens per second after prefill (all requests of the batch); "
          "ratio = ours / HF; agreement = fraction of equal greedy tokens.")
    write_json(args.json, {"bench": "decode", "machine": platform.processor() or platform.machine(),
                           "threads": torch.get_num_threads(), "output_len": args.output_len,
                           "rows": rows})
    return rows


_COLUMNS = [("context", "context"), ("batch", "batch"), ("ours_tok_s", "ours tok/s"),
            ("hf_tok_s", "HF tok/s"), ("ratio", "ratio"), ("ours_tpot_ms", "ours TPOT ms"),
            ("hf_tpot_ms", "HF TPOT ms"), ("ours_prefill_s", "ours prefill s"),
            ("hf_prefill_s", "HF prefill s"), ("greedy_agreement", "agreement")]
