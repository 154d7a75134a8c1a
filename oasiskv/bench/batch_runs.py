"""A batch of prompts whose K/V is cached on disk, all arriving at once, decoded by one engine
(`run_mode`): its speed and latency figures; the concurrency levels that size the batch
(`dense-max`: the most requests dense holds); and the median of repeated runs. `bench
throughput` and `bench pareto` measure with it."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load

from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.sampling_params import SamplingParams


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large streaming read (a sum over a tensor far larger than the caches)."""
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def dense_capacity(config: EngineConfig, kv_per_token: int, context: int,
                   output_len: int) -> int:
    """Requests of `context` + `output_len` tokens whose whole K/V fits the device budget at
    once (the engine's block pool: budget // block bytes): the most that dense decodes
    together without queueing or preemption."""
    block = config.cache.block_size
    blocks = config.cache.device_kv_budget // (kv_per_token * block)
    return blocks // -(-(context + output_len) // block)


def auto_host_budget(requests: int, context: int, output_len: int, block: int,
                     kv_per_token: int) -> int:
    """Sparse host tier bytes for `requests` whole histories, with a tenth to spare."""
    return int(1.1 * requests * (-(-(context + output_len) // block) + 1) * block
               * kv_per_token)


def run_mode(kwargs: dict, prompts: list[list[int]], kv_files: list[Path],
             output_len: int) -> dict:
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    # in memory before the clock starts, as the peers' prompt K/V are (a file's tensors are
    # mapped lazily: their disk reads would count as our engine's time to first token)
    prefixes = [load(f.read_bytes())["kv"] for f in kv_files]
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params, prefix_kv=kv)
           for p, kv in zip(prompts, prefixes, strict=True)]
    seqs = [engine.requests[i] for i in ids]
    start = len(engine.step_log)
    token_times: list[list[float]] = [[] for _ in seqs]  # when each output token came out
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        for times, s in zip(token_times, seqs, strict=True):
            times += [now] * (s.num_output_tokens - len(times))
    wall = time.perf_counter() - t0
    log = list(engine.step_log)[start:]
    decode_steps = [e for e in log if e["decode_tokens"]]
    stats = engine.stats()
    p50, p99 = token_gap_percentiles(token_times)
    out = {"tps": sum(s.num_output_tokens for s in seqs) / wall, "wall_s": wall,
           "tpot_ms": 1e3 * sum(s.metrics.tpot or 0 for s in seqs) / len(seqs),
           "tpot_p50_ms": p50, "tpot_p99_ms": p99,
           "running_max": max((e["decode_tokens"] for e in decode_steps), default=0),
           "ttft_s": sum(s.metrics.ttft or 0 for s in seqs) / len(seqs),
           "running": sum(e["decode_tokens"] for e in decode_steps) / max(len(decode_steps), 1),
           "step_ms": 1e3 * sum(e["time_s"] for e in decode_steps) / max(len(decode_steps), 1),
           "preemptions": stats["preemptions"], "failed": stats["requests_failed"],
           "kv_peak_bytes": stats["kv_peak_bytes"],
           # the device tensors (KV pool, sparse summaries): at most the budget
           "device_bytes_allocated": stats["device_bytes_allocated"],
           "device_peak_bytes": stats["device_peak_bytes"],
           "tokens": [s.output_token_ids for s in seqs]}
    if engine.sparse is not None:
        c = engine.sparse.counters
        out.update(bytes_per_step=(c.h2d_bytes + c.d2h_bytes) / max(len(decode_steps), 1),
                   hit_rate=c.hits / max(c.predicted, 1),
                   kept=(c.hits + c.admitted) / max(c.predicted, 1),
                   fetch_cap=engine.sparse.fetch_cap)
    engine.close()
    return out


def token_gap_percentiles(token_times: list[list[float]]) -> tuple[float | None, float | None]:
    """p50 and p99 (ms) of the times between consecutive output tokens of each request, all
    requests together: the per-token TPOT distribution (the first token's wait is TTFT's)."""
    gaps = [b - a for times in token_times for a, b in itertools.pairwise(times)]
    if not gaps:  # one token per request: no gaps
        return None, None
    p50, p99 = np.percentile(gaps, [50, 99])
    return 1e3 * float(p50), 1e3 * float(p99)


def median_run(tries: list[dict]) -> dict:
    """The run with the median TPS (the lower middle of an even count), with the spread of
    every run's TPS: on a noisy machine one run of each mode can land in a slow minute."""
    tps = [r["tps"] for r in tries]  # in round order
    median = sorted(tries, key=lambda r: r["tps"])[(len(tries) - 1) // 2]
    return median | {"repeats": len(tries), "tps_runs": tps,
                     "tps_range": f"{min(tps):.3g}-{max(tps):.3g}"}
