"""The rerank's scoring over the key copy's codes, one decode step's worth: the hand-written CPU
kernel (`kv/block_mass.py`) against the compiled PyTorch function it replaces
(`kv/rerank.candidate_mass_codes`, inductor), on SmolLM2-135M's shapes.

  python scripts/bench_rerank.py [--context 7168] [--batch 6] [--candidates 256] [--in-order]
      [--layers 30] [--bits 8] [--rounds 9] [--threads N] [--isas avx512,avx2] [--json PATH]

A step scores, for each of --layers layers, --batch requests and 3 KV heads, its --candidates
best blocks by summary (random distinct blocks of the request's context/16, scattered over a
pool of every request's blocks, as `rerank_layers` passes them) against the 3 query heads of
the group. Rounds interleave the implementations (a shared machine's load hits them alike);
prints the median and min ms per step, the code bytes a step reads over the median (GB/s),
the multiply-adds over it (GMAC/s), and the largest difference to the compiled function.
CPU times are noisy: compare ratios from one run."""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from oasiskv.kv import block_mass
from oasiskv.kv.rerank import candidate_mass_codes, flat_blocks
from oasiskv.report import markdown_table, write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def step_inputs(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """A step's (pool of codes, rows, block scales, q, real), as rerank_layers builds them."""
    g = torch.Generator().manual_seed(0)
    L, R, n, c = args.layers, args.batch, args.context // BLOCK, args.candidates
    # the key copy [L, ids, Hkv, d, B] (int8; 4-bit pairs: uint8 [..., B/2]), its scales
    shape, top = (L, R * n, KV_HEADS, HEAD_DIM), 127 if args.bits == 8 else 255
    codes = (torch.randint(-top, top + 1, (*shape, BLOCK), generator=g, dtype=torch.int8)
             if args.bits == 8 else
             torch.randint(0, top + 1, (*shape, BLOCK // 2), generator=g, dtype=torch.uint8))
    scales = torch.rand(L, R * n, KV_HEADS, generator=g) / 32
    pool, (ls, ids_s, hs) = flat_blocks(codes)
    if args.in_order:  # rerank=inf: every block, the requests side by side (take_run)
        if c > n:
            raise SystemExit(f"--in-order: --candidates {c} is more than the {n} blocks")
        ids = torch.arange(R * n).view(R, n)
        chosen = ids[:, :c]
    else:
        ids = torch.randperm(R * n, generator=g).view(R, n)  # a request's blocks, scattered
        chosen = torch.stack([ids[r, torch.randperm(n, generator=g)[:c]] for r in range(R)])
    chosen = chosen[None, :, None, :].expand(L, R, KV_HEADS, c)  # [L, R, Hkv, c] summary ids
    j = torch.arange(L)[:, None, None, None]
    h = torch.arange(KV_HEADS)[None, None, :, None]
    rows = j * ls + h * hs + chosen * ids_s
    block_scale = (scales[j, chosen, h] * HEAD_DIM ** -0.5).contiguous()
    q = torch.randn(L, R, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, generator=g)
    real = torch.ones(L, R, KV_HEADS, c, dtype=torch.bool)
    return pool, rows, block_scale, q, real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=7168)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--candidates", type=int, default=256, help="c per KV head (2K at K=128)")
    ap.add_argument("--in-order", action="store_true",
                    help="the first c blocks of each request in block order, requests side by "
                         "side (rerank=inf: --candidates 448 at 7K)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--bits", type=int, default=8, choices=(8, 4))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isas", default="",
                    help="comma-separated instruction sets for the kernel (default: the best)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ext = block_mass.extension()
    if ext is None:
        ap.error("the block-mass kernel is not available (see the warning above)")
    isas = [i for i in args.isas.split(",") if i] or ext.isas()[:1]
    unknown = [i for i in isas if i not in ext.isas()]
    if unknown:
        ap.error(f"--isas: not on this CPU: {', '.join(unknown)} (it runs {ext.isas()})")
    inputs = step_inputs(args)
    impls = {"compiled": lambda: candidate_mass_codes(*inputs)}
    for isa in isas:
        impls[f"kernel {isa}"] = (
            lambda isa=isa: ext.block_mass(inputs[0], inputs[1].flatten(0, 2),
                                           inputs[2].flatten(0, 2), inputs[3].flatten(0, 2),
                                           inputs[4].flatten(0, 2), isa).view(inputs[1].shape))
    times: dict[str, list[float]] = {name: [] for name in impls}
    outs = {}
    with torch.inference_mode():
        for rnd in range(args.rounds + 1):  # round 0 warms up (and compiles)
            for name, fn in impls.items():
                t0 = time.perf_counter()
                outs[name] = fn()
                if rnd:
                    times[name].append(time.perf_counter() - t0)
    rows, c = inputs[1], args.candidates
    read = rows.numel() * HEAD_DIM * BLOCK * args.bits // 8  # bytes of codes a step reads
    macs = rows.numel() * HEAD_DIM * BLOCK * (HEADS // KV_HEADS)
    table = []
    for name in impls:
        med = statistics.median(times[name])
        ratio = statistics.median(a / b for a, b in
                                  zip(times[name], times["compiled"], strict=True))
        table.append({"impl": name, "ms": 1e3 * med, "min_ms": 1e3 * min(times[name]),
                      "ratio": ratio, "GBps": read / med / 1e9, "GMACs": macs / med / 1e9,
                      "max_diff": (outs[name] - outs["compiled"]).abs().max().item()})
    print(f"\n## rerank scoring per step: {args.layers} layers x {args.batch} requests x "
          f"{KV_HEADS} KV heads x c={c} candidates of [{HEAD_DIM}, {BLOCK}] int{args.bits} codes "
          f"({read / 1e6:.0f} MB), G={HEADS // KV_HEADS}; {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; median of {args.rounds} interleaved "
          f"rounds; / compiled = median of each round's ratio\n")
    print(markdown_table(table, [("impl", "impl"), ("ms", "ms / step"), ("min_ms", "min ms"),
                                 ("ratio", "/ compiled"), ("GBps", "codes GB/s"),
                                 ("GMACs", "GMAC/s"), ("max_diff", "max |diff| to compiled")]))
    write_json(args.json, {"bench": "rerank", "args": vars(args),
                           "threads": torch.get_num_threads(), "rows": table})


if __name__ == "__main__":
    main()
