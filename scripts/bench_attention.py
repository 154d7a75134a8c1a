"""Decode attention per layer call (issue 45): the compiled kernel (`layers/decode_kernel.py`) and
the grouped, copy-free attention (`layers/gqa.py`) against the previous implementation
(`layers/attention_ref.py`) and three alternatives, on SmolLM2-135M's shapes (9 query heads over
3 KV heads, head dim 64).

  python scripts/bench_attention.py [--context 7168] [--batch 6] [--top-k 128] [--rounds 15]
      [--dtype bfloat16] [--threads N] [--impls ref,gqa,kernel,kernel@avx512] [--json PATH]

Cases: dense at batch 1 (one run of slots) and at --batch (each request in --runs runs spread
over the pool, as a full pool leaves them), and a sparse batch of --batch slabs of K+1 blocks
with one draft each, side by side (as the allocator places them) and every other slab apart.
Implementations, each through `Attention.forward` on the same pools and step context:
ref (previous), gqa (grouped matmuls), kernel (the compiled kernel, the default), sdpa-gqa
(`scaled_dot_product_attention(enable_gqa=True)` over the joined runs), sdpa-grouped (SDPA
with the KV heads as heads and the G query heads as G query rows: no expansion), split
(flash-decoding: the sequence in --chunk-token chunks, each its own softmax, merged by
log-sum-exp); kernel@ISA is the kernel on one instruction set's loops (avx512bf16, avx512, avx2,
base: `ext.isas()`), so that tiers are timed interleaved in one run. Each layer call reads its
own layer's pool (enough layers to overflow the caches, as a step does); rounds interleave the
implementations so that a shared machine's load hits them alike, and a dense context grows by a
token per round, as in decode (oneDNN builds a kernel per new shape). Prints the median and min
ms per layer call, the median over rounds of each round's ratio to ref, and the KV read rate of
the median. CPU times are noisy: compare ratios from one run."""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from oasiskv.context import SeqAttention, StepContext, set_context
from oasiskv.layers import decode_kernel, gqa, kernel_attention
from oasiskv.layers.attention import Attention, GqaAttention
from oasiskv.layers.attention_ref import ReferenceAttention
from oasiskv.report import markdown_table, write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


class SdpaGqa(GqaAttention):
    """Decode by SDPA with enable_gqa over the joined runs (dense only)."""

    def _attend(self, q, seq, k_new, v_new):
        if q.shape[0] != 1:
            return super()._attend(q, seq, k_new, v_new)
        k, v = self._kv(seq, k_new, v_new)  # [Hkv, T, d]
        return F.scaled_dot_product_attention(
            q[0, :, None][None], k[None], v[None], scale=self.scale, enable_gqa=True).reshape(1, -1)


class SdpaGrouped(GqaAttention):
    """Decode by SDPA with the G query heads of a KV head as G query rows (dense only)."""

    def _attend(self, q, seq, k_new, v_new):
        if q.shape[0] != 1:
            return super()._attend(q, seq, k_new, v_new)
        k, v = self._kv(seq, k_new, v_new)  # [Hkv, T, d]
        qg = q.view(self.num_kv_heads, self.group, self.head_dim)  # [Hkv, G, d]
        return F.scaled_dot_product_attention(qg[None], k[None], v[None],
                                              scale=self.scale).reshape(1, -1)


class Split(GqaAttention):
    """Flash-decoding: chunks of `chunk` tokens, each a softmax of its own, log-sum-exp merged."""

    chunk = 2048

    def _attend(self, q, seq, k_new, v_new):
        if q.shape[0] != 1 or seq.kv_valid is not None:
            return super()._attend(q, seq, k_new, v_new)
        keys, values = self._kv_parts(seq, k_new, v_new)
        qg = q.view(self.num_kv_heads, self.group, self.head_dim)
        outs, lses = [], []
        for k, v in zip(keys, values, strict=True):
            for s in range(0, k.shape[1], self.chunk):
                kc, vc = k[:, s:s + self.chunk], v[:, s:s + self.chunk]
                scores = gqa.grouped_scores(qg, [kc]).float().mul_(self.scale)  # [Hkv, G, c]
                lse = torch.logsumexp(scores, -1, keepdim=True)  # [Hkv, G, 1]
                probs = (scores - lse).exp_().to(q.dtype)
                outs.append(gqa.grouped_values(probs, [vc]).float())
                lses.append(lse)
        lse = torch.stack(lses)  # [chunks, Hkv, G, 1]
        w = torch.softmax(lse, 0)
        return (torch.stack(outs) * w).sum(0).to(q.dtype).reshape(1, -1)


IMPLS = {"ref": ReferenceAttention, "gqa": GqaAttention, "kernel": Attention, "sdpa-gqa": SdpaGqa,
         "sdpa-grouped": SdpaGrouped, "split": Split}

SPARSE_IMPLS = ("ref", "gqa", "kernel")  # the others decode dense contexts only


def split_impl(impl: str) -> tuple[str, str]:
    """kernel@avx2 -> (kernel, avx2); others (impl, "": the kernel's best instruction set)."""
    name, _, isa = impl.partition("@")
    return name, isa


def spread_runs(batch: int, tokens: int, runs: int, g: torch.Generator) -> list[list]:
    """Each request's tokens in `runs` runs of whole blocks, the runs of all requests shuffled
    over the pool: [(first slot, tokens)] per request."""
    blocks = -(-tokens // BLOCK)
    cuts = [round(i * blocks / runs) for i in range(runs + 1)]
    pieces = [(r, i, cuts[i + 1] - cuts[i]) for r in range(batch) for i in range(runs)]
    order = torch.randperm(len(pieces), generator=g).tolist()
    first, place = 0, {}
    for j in order:  # pieces laid out in shuffled order, one after another
        r, i, n = pieces[j]
        place[r, i] = first * BLOCK
        first += n
    out = []
    for r in range(batch):
        left, req = tokens, []
        for i in range(runs):
            n = min((cuts[i + 1] - cuts[i]) * BLOCK, left)
            req.append((place[r, i], n))
            left -= n
        out.append(req)
    return out


def dense_case(batch: int, tokens: int, runs: int, g: torch.Generator):
    """Slots per layer pool and the step's SeqAttention, one query row per request."""
    if runs == 1:
        seqs = [SeqAttention(r, r + 1, tokens, r * tokens, None) for r in range(batch)]
    else:
        seqs = [SeqAttention(r, r + 1, tokens, None, None, kv_runs=req)
                for r, req in enumerate(spread_runs(batch, tokens, runs, g))]
    return batch * -(-tokens // BLOCK) * BLOCK, seqs, batch


def sparse_case(batch: int, top_k: int, apart: bool, g: torch.Generator):
    """A batch of slabs of K+1 blocks and a block of draft slots, one draft each; apart: every
    other window one block further on (no two side by side)."""
    t, window, rows = (top_k + 1) * BLOCK, (top_k + 2) * BLOCK, 2
    seqs, start = [], 0
    for r in range(batch):
        valid = torch.rand(KV_HEADS, t, generator=g) > 0.05  # a few empty slots
        seqs.append(SeqAttention(r * rows, r * rows + 1, t, start, None, kv_valid=valid,
                                 draft_rows=[r * rows + 1], draft_slots=BLOCK))
        start += window + (BLOCK if apart and r % 2 == 0 else 0)
    return start + BLOCK, seqs, batch * rows


def grown(seq: SeqAttention, n: int) -> SeqAttention:
    """A dense request n tokens later (its last run longer by n)."""
    if seq.kv_valid is not None or not n:
        return seq
    runs = seq.kv_runs and [*seq.kv_runs[:-1], (seq.kv_runs[-1][0], seq.kv_runs[-1][1] + n)]
    return replace(seq, kv_len=seq.kv_len + n, kv_runs=runs)


def time_case(name: str, slots: int, seqs: list[SeqAttention], rows: int, impls: list[str],
              args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    slots += args.rounds + 1  # room for the contexts to grow
    pool_bytes = 2 * KV_HEADS * slots * HEAD_DIM * dtype.itemsize
    layers = max(2, min(30, math.ceil(args.cache_overflow * 2**20 / pool_bytes)))
    pools = [(torch.randn(KV_HEADS, slots, HEAD_DIM, generator=g, dtype=dtype),
              torch.randn(KV_HEADS, slots, HEAD_DIM, generator=g, dtype=dtype))
             for _ in range(layers)]
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g, dtype=dtype)
    k, v = (torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g, dtype=dtype) for _ in range(2))
    mods = {}
    for impl in impls:
        mods[impl] = []
        for i, pool in enumerate(pools):
            m = IMPLS[split_impl(impl)[0]](HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
            m.layer_idx, m.pools = i, {"device": pool}
            mods[impl].append(m)
    # bytes of K/V one layer call reads: every request's attended slots
    read = sum(2 * KV_HEADS * (s.kv_len + s.draft_slots) * HEAD_DIM * dtype.itemsize
               for s in seqs)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    outs = {}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        step_seqs = [grown(s, rnd) for s in seqs]
        for impl in impls:
            ctx = StepContext(seqs=step_seqs)  # slab groups built by the first layer, as in a step
            set_context(ctx)
            kernel_attention.ISA = split_impl(impl)[1]
            t0 = time.perf_counter()
            for m in mods[impl]:
                outs[impl] = m(q, k, v)
            dt = (time.perf_counter() - t0) / layers
            set_context(None)
            if rnd:
                times[impl].append(dt)
    rows_out = []
    for impl in impls:
        med = statistics.median(times[impl])
        err = (outs[impl].float() - outs["ref"].float()).abs().max().item()
        ratio = statistics.median(a / b for a, b in zip(times[impl], times["ref"], strict=True))
        rows_out.append({"case": name, "impl": impl, "ms": 1e3 * med,
                         "min_ms": 1e3 * min(times[impl]), "ratio": ratio,
                         "GBps": read / med / 1e9, "max_diff": err, "layers": layers})
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=7168)
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--runs", type=int, default=2, help="runs of slots per dense request")
    ap.add_argument("--top-k", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--chunk", type=int, default=2048, help="split: tokens per chunk")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cache-overflow", type=int, default=256,
                    help="MiB of pools cycled through (each layer call reads its own)")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help="comma-separated, of " + ", ".join(IMPLS) + " (ref always runs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    Split.chunk = args.chunk
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(1)
    chosen = ["ref", *(i for i in args.impls.split(",") if i != "ref")]
    unknown = [i for i in chosen if split_impl(i)[0] not in IMPLS
               or (split_impl(i)[1] and split_impl(i)[0] != "kernel")]
    if unknown:
        ap.error(f"--impls: unknown {', '.join(unknown)}")
    isas = {split_impl(i)[1] for i in chosen} - {""}
    if isas:
        ext = decode_kernel.extension()
        missing = sorted(isas - set(ext.isas() if ext else []))
        if missing:
            ap.error(f"--impls: this CPU or build does not run {', '.join(missing)}")
    dense_impls = chosen
    sparse_impls = [i for i in chosen if split_impl(i)[0] in SPARSE_IMPLS]
    cases = [(f"dense {args.context} x1", *dense_case(1, args.context, 1, g), dense_impls),
             (f"dense {args.context} x{args.batch}, {args.runs} runs each",
              *dense_case(args.batch, args.context, args.runs, g), dense_impls),
             (f"sparse K={args.top_k} x{args.batch}, side by side",
              *sparse_case(args.batch, args.top_k, False, g), sparse_impls),
             (f"sparse K={args.top_k} x{args.batch}, apart",
              *sparse_case(args.batch, args.top_k, True, g), sparse_impls)]
    rows = []
    for name, slots, seqs, n, impls in cases:
        rows += time_case(name, slots, seqs, n, impls, args, dtype)
        print(f"{name}: done", flush=True)
    print(f"\n## decode attention per layer call, SmolLM2-135M shapes ({HEADS} heads over "
          f"{KV_HEADS} KV heads, d={HEAD_DIM}), {args.dtype}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}; median of {args.rounds} interleaved "
          f"rounds; / ref = median of each round's ratio to ref\n")
    print(markdown_table(rows, [("case", "case"), ("impl", "impl"), ("ms", "ms / call"),
                                ("min_ms", "min ms"), ("ratio", "/ ref"),
                                ("GBps", "KV GB/s"), ("max_diff", "max |diff| to ref"),
                                ("layers", "pools")]))
    write_json(args.json, {"bench": "attention", "args": vars(args),
                           "threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
