"""`oasiskv bench decode`: our dense decode vs HF transformers `generate`, same prompts, one run.

Decode throughput is measured after prefill, for both engines, and counts only the tokens
decoded inside the clock: ours starts it once every request of the batch has its first token
(before that, requests that finished their prefill earlier were already decoding; those tokens
are not counted) and stops it when the last request is done; HF's runs from its first to its
last generated token (a StoppingCriteria records the time of every step; the batch decodes in
lockstep). Prefill is reported separately.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from tqdm.auto import tqdm

from oasiskv.bench.common import agreement, print_model_note, unique_prompts
from oasiskv.bench.peers import load_hf, timed_generate
from oasiskv.config import EngineConfig
from oasiskv.engine_args import add_engine_flags, engine_kwargs
from oasiskv.llm import LLM
from oasiskv.report import markdown_table, parse_list, platform_name, write_json
from oasiskv.sampling_params import SamplingParams


def ours_decode(llm: LLM, prompts: list[list[int]], output_len: int,
                bar: tqdm | None = None) -> dict:
    """Our engine on one batch. `decoded`: the tokens decoded while the clock ran (after every
    request had its first token), which is what tok/s divides."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    seqs = [engine.requests[i] for i in ids]
    done = 0  # the bar: prompt tokens computed and tokens generated so far

    def step() -> None:
        nonlocal done
        engine.step()
        now = sum(min(s.num_computed_tokens, s.num_prompt_tokens) + s.num_output_tokens
                  for s in seqs)
        if bar is not None:
            bar.update(now - done)
        done = now

    t0 = time.perf_counter()
    while any(s.num_output_tokens == 0 for s in seqs):
        step()
    t1 = time.perf_counter()
    # requests whose prefill ended earlier have decoded tokens before t1: not in the clock
    at_start = [s.num_output_tokens for s in seqs]
    steps = 0
    while engine.has_unfinished():
        step()
        steps += 1
    t2 = time.perf_counter()
    decoded = sum(s.num_output_tokens - n for s, n in zip(seqs, at_start, strict=True))
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": steps,
            "decoded": decoded, "decoded_before_clock": sum(at_start) - len(seqs),
            "tok_s": decoded / (t2 - t1), "tpot_ms": (t2 - t1) / max(steps, 1) * 1e3,
            "tokens": [s.output_token_ids for s in seqs]}


def hf_decode(model, prompts: list[list[int]], output_len: int,
              bar: tqdm | None = None) -> dict:
    """transformers `generate` on the batch: all rows get their first token in the same step,
    so the clock (first to last token) holds each row's output_len - 1 later tokens."""
    inputs = torch.tensor(prompts, device=model.device)
    R, T = inputs.shape

    def on_token(i: int) -> None:  # the first token comes with the whole prompt's prefill
        if bar is not None:
            bar.update(R * (T + 1) if i == 0 else R)

    t0 = time.perf_counter()
    out, times = timed_generate(model, inputs, output_len, on_token=on_token)
    first, last = times[0], times[-1]
    steps = len(times) - 1
    return {"prefill_s": first - t0, "decode_s": last - first, "decode_steps": steps,
            "decoded": R * steps, "tok_s": R * steps / (last - first),
            "tpot_ms": (last - first) / max(steps, 1) * 1e3,
            "tokens": out[:, T:].tolist()}


def run_decode_bench(args: argparse.Namespace) -> list[dict]:
    contexts, batches = parse_list(args.context), parse_list(args.batch)
    kwargs = engine_kwargs(args)
    print_model_note(kwargs.get("model", EngineConfig.model))
    kwargs.setdefault("max_num_seqs", max(batches))
    llm = LLM(**kwargs)
    hf = None if args.no_hf else load_hf(llm.engine.config.model, llm.engine.config.torch_dtype,
                                         llm.engine.device)  # the same device as ours
    # Warm both engines up (allocator, lazy init) so the first measured row is not penalised.
    warm = [list(range(100, 164))]
    ours_decode(llm, warm, 4)
    if hf is not None:
        hf_decode(hf, warm, 4)
    rows = []
    # progress in tokens (prompt tokens computed + tokens generated), ours and HF's; a bar
    # only on a terminal (tqdm's disable=None), as the other long commands do
    engines = 1 if hf is None else 2
    bar = tqdm(total=engines * len(contexts) * sum(batches) * args.output_len
               + engines * sum(contexts) * sum(batches), desc="decode bench", unit="tok",
               disable=None, dynamic_ncols=True)
    for context in contexts:
        prompts, source = unique_prompts(llm.tokenizer, sum(batches), context)
        offset = 0
        for batch in batches:
            group, offset = prompts[offset:offset + batch], offset + batch
            bar.set_description(f"ours {context} x{batch}")
            ours = ours_decode(llm, group, args.output_len, bar)
            row = {"context": context, "batch": batch, "text": source,
                   "ours_tok_s": ours["tok_s"], "ours_tpot_ms": ours["tpot_ms"],
                   "ours_prefill_s": ours["prefill_s"], "ours_decoded": ours["decoded"],
                   "ours_decoded_before_clock": ours["decoded_before_clock"]}
            if hf is not None:
                bar.set_description(f"HF {context} x{batch}")
                ref = hf_decode(hf, group, args.output_len, bar)
                row.update(hf_tok_s=ref["tok_s"], hf_tpot_ms=ref["tpot_ms"],
                           hf_prefill_s=ref["prefill_s"], ratio=ours["tok_s"] / ref["tok_s"],
                           greedy_agreement=agreement(ours["tokens"], ref["tokens"]))
            rows.append(row)
            bar.write(markdown_table([row], _COLUMNS))
            sys.stdout.flush()
    bar.close()
    print(f"\n## decode throughput, {llm.engine.config.model}, {llm.engine.config.dtype}, "
          f"{torch.get_num_threads()} threads, {args.output_len} greedy tokens per request\n")
    print(markdown_table(rows, _COLUMNS))
    print("\ntok/s = tokens decoded while the clock runs, per second (all requests of the "
          "batch; ours: from the step when the last request has its first token, tokens that "
          "earlier requests decoded before it not counted; HF: from its first token); ratio = "
          "ours / HF; agreement = fraction of equal greedy tokens.")
    write_json(args.json, {"bench": "decode", "machine": platform_name(),
                           "threads": torch.get_num_threads(), "output_len": args.output_len,
                           "rows": rows})
    return rows


_COLUMNS = [("context", "context"), ("batch", "batch"), ("ours_tok_s", "ours tok/s"),
            ("hf_tok_s", "HF tok/s"), ("ratio", "ratio"), ("ours_tpot_ms", "ours TPOT ms"),
            ("hf_tpot_ms", "HF TPOT ms"), ("ours_prefill_s", "ours prefill s"),
            ("hf_prefill_s", "HF prefill s"), ("greedy_agreement", "agreement")]


COMMANDS = {"decode": "our dense decode vs HF transformers generate"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`bench decode`'s flags: the prompts, batches and every engine flag."""
    p.add_argument("--context", default="4096", help="prompt lengths, comma-separated")
    p.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers rows")
    p.add_argument("--json", help="write the figures to this file")
    add_engine_flags(p)


def run(args: argparse.Namespace) -> int:
    run_decode_bench(args)
    return 0
