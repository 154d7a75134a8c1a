"""Selection cost of the scoring options (issue 41) per decode step, side by side in one run,
at SmolLM2-135M's shapes: 30 layers, 9 query heads over 3 KV heads, d=64, 448 complete blocks
(7K tokens) per request, batch 6, bf16 summaries side by side (the batched path of
`kv/scorers.QuestBound`). Random data: this times the scoring, not its accuracy.

  python scripts/bench_scoring.py [--repeats 30] [--threads 1]

Prints each variant's median over interleaved repeats and its ratio to the first of its
group: the summary scoring (sum, softmax-sum, softmax-max; and with summary_splits=2, two
8-token sub-block summaries per block, sum and softmax-sum) and the rerank's second stage
(rerank=2 at top_k=128: 256 candidate blocks per KV head, keys from the host tier or from the
int8 or int4 copy; the engine's batched `rerank_layers` beside the per-layer reference it replaced).
Absolute CPU times are noisy; compare ratios from one run."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from oasiskv.kv.rerank import rerank_layers
from oasiskv.kv.scorers import requests_view
from oasiskv.kv.select import aggregated_scores, rerank_by_mass, summary_weights, weighted_scores
from oasiskv.kv.summaries import dequantize_keys, quantize_keys

L, H, HKV, D, N, R, B, K = 30, 9, 3, 64, 448, 6, 16, 128


def timed(fns: dict, repeats: int) -> dict[str, float]:
    with torch.inference_mode():
        for f in fns.values():  # compile, warm caches
            for _ in range(3):
                f()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}


def report(title: str, medians: dict[str, float]) -> None:
    base = next(iter(medians.values()))
    print(title)
    for k, m in medians.items():
        print(f"  {k:16s} {m * 1e3:8.2f} ms/step  x{m / base:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stride = N + 5
    kmin = torch.randn(L, R * stride, HKV, D).to(torch.bfloat16)
    kmax = kmin + torch.rand_like(kmin)
    q = torch.randn(L, R, H, D)
    lengths = torch.full((R,), N)
    past = torch.arange(N)[None] >= lengths[:, None]
    scales = torch.full((L, 1), D ** -0.5)
    lo, hi = (requests_view(x, R, N, stride, 0) for x in (kmin, kmax))

    def summed() -> torch.Tensor:
        s = weighted_scores(lo, hi, *summary_weights(q, HKV))
        return s.masked_fill_(past[:, None], float("-inf"))

    scoring = {"sum": summed}
    for mode in ("softmax-sum", "softmax-max"):
        scoring[mode] = lambda mode=mode: aggregated_scores(q, lo, hi, past, scales, mode)
    # summary_splits=2: two summary rows per block, side by side as the engine keeps them
    S = 2
    kmin2 = torch.randn(L, R * stride * S, HKV, D).to(torch.bfloat16)
    kmax2 = kmin2 + torch.rand_like(kmin2)
    lo2, hi2 = (requests_view(x, R, N * S, stride * S, 0) for x in (kmin2, kmax2))

    def summed2() -> torch.Tensor:
        s = weighted_scores(lo2, hi2, *summary_weights(q, HKV), S)
        return s.masked_fill_(past[:, None], float("-inf"))

    scoring["sum S=2"] = summed2
    scoring["softmax-sum S=2"] = lambda: aggregated_scores(q, lo2, hi2, past, scales,
                                                           "softmax-sum", 1.0, S)
    report(f"summary scoring, {L} layers x {R} requests x {N} blocks:",
           timed(scoring, args.repeats))

    # the rerank's second stage: the engine's (kv/rerank.rerank_layers, what kv/scorers.Rerank
    # calls, all layers at once) beside the reference it replaced (select.rerank_by_mass
    # layer by layer over keys gathered per head, the int8 copy dequantized).
    # One layer's data seen by every layer (expanded views: 33 MB, not 2 GB)
    host_kv = torch.randn(1, 1, HKV, R * stride * B, D)
    codes, kscales = quantize_keys(host_kv[:, 0].unflatten(2, (-1, B)))  # [1, ids, Hkv, ...]
    codes4, kscales4 = quantize_keys(host_kv[:, 0].unflatten(2, (-1, B)), 4)
    codes, kscales, codes4, kscales4 = (x.expand(L, *x.shape[1:])
                                        for x in (codes, kscales, codes4, kscales4))
    host_keys = host_kv[:, 0].unflatten(2, (-1, B)).transpose(1, 2).expand(L, -1, -1, -1, -1)
    ids = torch.arange(R)[:, None] * stride + torch.arange(N)  # [R, N] summary ids
    first = summed()  # [L, R, Hkv, N]
    layer_scales = torch.full((L,), D ** -0.5)

    def reference(int8: bool) -> None:
        blocks = host_kv[0, 0].unflatten(1, (-1, B)).flatten(2)  # [Hkv, ids, B*d]
        for layer in range(L):
            def keys_of(cand: torch.Tensor) -> torch.Tensor:  # [R, Hkv, c] -> [R, Hkv, c*B, d]
                out = []
                for h in range(HKV):
                    rows = ids.gather(1, cand[:, h]).flatten()
                    if int8:
                        out.append(dequantize_keys(
                            codes[0, :, h].index_select(0, rows).view(R, -1, D, B),
                            kscales[0, :, h].index_select(0, rows).view(R, -1)).flatten(1, 2))
                    else:
                        out.append(blocks[h].index_select(0, rows).view(R, -1, D))
                return torch.stack(out, 1)
            rerank_by_mass(first[layer], q[layer], keys_of, D ** -0.5, B, 2 * K)

    report(f"rerank=2 second stage ({2 * K} candidates per KV head), keys from:", timed({
        "int8 reference": lambda: reference(True),
        "int8": lambda: rerank_layers(first, q, layer_scales, 2 * K, ids, codes, kscales),
        "int4": lambda: rerank_layers(first, q, layer_scales, 2 * K, ids, codes4, kscales4),
        "host reference": lambda: reference(False),
        "host": lambda: rerank_layers(first, q, layer_scales, 2 * K, ids, host_keys),
    }, max(3, args.repeats // 5)))

if __name__ == "__main__":
    main()
