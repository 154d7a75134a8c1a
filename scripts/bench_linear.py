"""The decode step's linear layers in bf16 on the CPU: the hand-written kernel
(`layers/gemv.py`) against oneDNN's packed linear, on SmolLM2-135M's shapes (30 layers of
qkv 576->1728, o 576->576, gate_up 576->3072, down 1536->576, and lm_head 576->49152).

  python scripts/bench_linear.py [--rows 1,2,6,12] [--rounds 15] [--threads N] [--json PATH]

A round runs every layer's linears once (a step: the weights, ~295 MB, do not fit in cache)
for each implementation, the order alternating between rounds so that a shared machine's
load hits both alike. Prints the median and min ms per step, the weight read rate of the
median (GB/s), and the median over rounds of each round's kernel/oneDNN ratio."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

from oasiskv.layers import gemv
from oasiskv.layers.linear import Linear
from oasiskv.report import markdown_table, write_json

LAYERS, HIDDEN, INTER, QKV, VOCAB = 30, 576, 1536, 1728, 49152


def model_linears() -> list[Linear]:
    """The step's linears in order, bf16, packed for oneDNN and the kernel."""
    shapes = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)] * LAYERS
    out = []
    for k, n in [*shapes, (HIDDEN, VOCAB)]:
        lin = Linear(k, n, bias=False).to(torch.bfloat16)
        lin.pack()
        out.append(lin)
    return out


def step(lins: list[Linear], xs: dict[int, torch.Tensor], impl: str) -> float:
    """ms for one pass over all linears."""
    t0 = time.perf_counter()
    for lin in lins:
        x = xs[lin.in_features]
        lin._forward(x) if impl == "onednn" else gemv.linear(lin.gemv_packed, x)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,6,12")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ[gemv.ENV] = "kernel"
    if gemv.extension() is None:
        sys.exit("the bf16 linear kernel does not run here (no AVX-512 BF16 or no build)")
    torch.manual_seed(0)
    lins = model_linears()
    nbytes = sum(lin.weight.numel() * 2 for lin in lins)
    impls = ("onednn", "kernel")
    results = []
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (HIDDEN, INTER)}
            for impl in impls:  # warm-up (oneDNN builds its kernels per shape)
                step(lins, xs, impl)
            times = {impl: [] for impl in impls}
            for r in tqdm(range(args.rounds), desc=f"rows {m}", disable=not sys.stderr.isatty()):
                for impl in impls if r % 2 == 0 else impls[::-1]:
                    times[impl].append(step(lins, xs, impl))
            ratios = [k / o for k, o in zip(times["kernel"], times["onednn"], strict=True)]
            for impl in impls:
                med = statistics.median(times[impl])
                results.append({"rows": m, "impl": impl, "ms": med, "min_ms": min(times[impl]),
                                "gbps": nbytes / med / 1e6,
                                "ratio": statistics.median(ratios) if impl == "kernel" else 1.0})
    print(f"\n{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"{nbytes / 1e6:.0f} MB of bf16 weights a step; median of {args.rounds} interleaved "
          f"rounds\n")
    print(markdown_table(results, [("rows", "rows"), ("impl", "impl"), ("ms", "ms / step"),
                                   ("min_ms", "min ms"), ("gbps", "GB/s"),
                                   ("ratio", "vs oneDNN")]))
    write_json(args.json, {"bench": "linear", "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
