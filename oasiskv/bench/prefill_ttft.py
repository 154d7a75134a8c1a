"""Time to first token of one long prompt computed from scratch (`bench throughput --ttft`):
our engine in each mode (dense prefills into the device pool; sparse into the host tier,
summarising its blocks), HF transformers (`generate`, one token) and llama.cpp (its own prefill
of the same tokens), one after another in the same run, on the same prompt: the prefill half of
the comparison whose decode half is the throughput table. No prompt K/V is reused here. With
repeats, every engine runs once per round and its median is kept (a shared machine's slow
minute then falls on all alike).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch

from oasiskv.bench.peers import ChildCrashed, RestartingPeer, timed_generate
from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.sampling_params import SamplingParams

COLUMNS = [("context", "context"), ("engine", "engine"), ("ttft_s", "TTFT s"),
           ("ttft_runs", "runs"), ("prefill_tps", "prompt tok/s"), ("vs_ours", "/ ours dense"),
           ("first_token", "first token = ours dense")]


def ours(kwargs: dict, prompt: list[int]) -> dict:
    """Our engine, a fresh one per run: add the request, step until its first token."""
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.requests[engine.add_request(prompt, params)]
    while seq.num_output_tokens == 0:
        engine.step()
    ttft = time.perf_counter() - t0
    token = seq.output_token_ids[0]
    engine.close()
    return {"ttft_s": ttft, "token": token}


def hf(model, prompt: list[int]) -> dict:
    """transformers `generate` of one greedy token (its prefill in one forward)."""
    t0 = time.perf_counter()
    out, times = timed_generate(model, torch.tensor([prompt], device=model.device), 1)
    return {"ttft_s": times[0] - t0, "token": int(out[0, len(prompt)])}


def ttft_rows(context: int, prompt: list[int], engines: dict[str, Callable[[], dict]],
              repeats: int) -> list[dict]:
    """Each engine `repeats` times in rounds -> a row per engine (its median run), compared
    with ours dense where it ran. An engine that crashes (llama.cpp) gets an error row."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    errors: dict[str, str] = {}
    for _ in range(repeats):
        for name, fn in engines.items():
            if name in errors:
                continue
            try:
                runs[name].append(fn())
            except ChildCrashed as e:
                errors[name] = str(e)
                print(f"{context} ttft {name}: failed: {e}", file=sys.stderr, flush=True)
    rows = []
    for name, tries in runs.items():
        if name in errors:
            rows.append({"context": context, "engine": name, "error": errors[name]})
            continue
        times = [t["ttft_s"] for t in tries]
        median = sorted(tries, key=lambda t: t["ttft_s"])[(len(tries) - 1) // 2]
        rows.append({"context": context, "engine": name, "ttft_s": median["ttft_s"],
                     "ttft_runs": ", ".join(f"{t:.2f}" for t in times),
                     "ttft_s_runs": times, "prefill_tps": len(prompt) / median["ttft_s"],
                     "token": median["token"], "spread_s": max(times) - min(times),
                     "median_s": statistics.median(times)})
    base = next((r for r in rows if r["engine"] == "ours dense" and "error" not in r), None)
    for r in rows:
        if base is not None and "error" not in r and r is not base:
            r["vs_ours"] = r["ttft_s"] / base["ttft_s"]
            r["first_token"] = "yes" if r["token"] == base["token"] else "no"
    return rows


def engines_for(context_prompt: list[int], modes: list[tuple[str, dict]], base: dict,
                hf_model, llamacpp: RestartingPeer | None) -> dict[str, Callable[[], dict]]:
    """What `bench throughput --ttft` times for one prompt: ours in each mode, then the peers
    (llama.cpp on its first prompt, which is this one)."""
    out: dict[str, Callable[[], dict]] = {
        f"ours {mode}": (lambda kw=kw: ours({**base, **kw}, context_prompt)) for mode, kw in modes}
    if hf_model is not None:
        out["hf"] = lambda: hf(hf_model, context_prompt)
    if llamacpp is not None:
        out["llamacpp"] = lambda: llamacpp.ttft(0)
    return out
