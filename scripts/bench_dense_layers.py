"""Decode-step cost of dense_layers (issue 41) on SmolLM2-135M: sparse engines with
dense_layers 0, 1, 2 (top_k 128, lookahead, sync prefetch) decode the same ~4K-token prompt,
stepping in turn (one step of each, round after round, so that load on a shared machine hits
them alike); the prompt's K/V is computed once and handed to each (`prefix_kv`).

  python scripts/bench_dense_layers.py [--context 4096] [--steps 40] [--batch 1] [--json PATH]

Prints a markdown table: each engine's median decode step (ms) and its ratio to dense_layers=0,
and its device bytes per request (dense-layer copy included). CPU times are noisy: compare
ratios from one run."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from oasiskv import SamplingParams
from oasiskv.bench.common import markdown_table
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine


def prompt_ids(engine: LLMEngine, n: int) -> list[int]:
    """n tokens of Emma (janeaustenr), else seeded random ids."""
    try:
        from oasiskv.data.austen import austen_text
        ids = engine.tokenizer.encode(austen_text("emma"))[1000:1000 + n]
        if len(ids) == n:
            return ids
    except Exception:  # noqa: BLE001 - the data is optional here; timing needs any tokens
        pass
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, engine.model_config.vocab_size, (n,), generator=g).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", default="0,1,2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    common = dict(model="smollm2-135m", dtype=args.dtype, num_threads=args.threads,
                  max_num_batched_tokens=1024, max_model_len=args.context + args.steps + 8)
    dense = LLMEngine(EngineConfig.from_kwargs(**common))
    ids = prompt_ids(dense, args.context)
    prefix = dense.compute_prefix_kv(ids[:-1])
    engines = {n: LLMEngine(EngineConfig.from_kwargs(
        **common, kv_mode="sparse", top_k=128, dense_layers=n, device_kv_budget="2GiB",
        host_kv_budget="2GiB"), share_weights=dense) for n in map(int, args.layers.split(","))}
    params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True)
    for e in engines.values():
        for _ in range(args.batch):
            e.add_request(ids, params, prefix_kv=prefix)
        while any(s.in_prefill or not s.num_output_tokens for s in e.scheduler.running) or \
                e.scheduler.waiting:
            e.step()  # the last prompt token and the first decode
    times: dict[int, list[float]] = {n: [] for n in engines}
    for _ in range(args.steps):
        for n, e in engines.items():
            e.step()
            times[n].append(e.step_log[-1]["time_s"])
    base = statistics.median(times[next(iter(engines))])
    rows = []
    for n, e in engines.items():
        s = e.stats()
        med = statistics.median(times[n])
        rows.append({"dense_layers": n, "step_ms": round(med * 1e3, 2),
                     "ratio": round(med / base, 3),  # to the first listed
                     "device_MiB_per_request": round(s["device_bytes_used"] / args.batch
                                                     / 2**20, 2),
                     "dense_copy_MiB_per_request": round(s.get("dense_layer_bytes_used", 0)
                                                         / args.batch / 2**20, 2)})
        e.close()
    print(f"SmolLM2-135M {args.dtype}, {args.context} tokens, batch {args.batch}, top_k 128, "
          f"lookahead, sync; median of {args.steps} interleaved decode steps")
    print(markdown_table(rows, [(k, k) for k in rows[0]]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
