"""Where a decode step's time goes: attention, linear layers, sparse selection, other.

`profile_steps(engine, steps)` runs engine steps under `torch.profiler` with the engine's parts
marked as ranges for the duration (hooks on the Attention and Linear modules; the sparse KV's
per-step and per-layer methods and the prefetch stages wrapped), all undone afterwards. Per
step, on the thread that steps the engine, each category gets the time inside its ranges less
the ranges nested in them (the selection a layer's attention calls is selection's, not
attention's), and `other` the rest of the step: norms, rotary, embedding, sampling, drafts,
Python between them. The categories add up to the profiled step's time, which the profiler
inflates a little (each op is recorded). Prefetch stages on worker threads (async) overlap
the step: their time is reported apart. `breakdown_run` is `bench throughput --breakdown`'s
untimed extra run of one mode and level.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load
from torch.profiler import ProfilerActivity, profile, record_function

from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.layers.attention import Attention
from oasiskv.layers.linear import Linear
from oasiskv.prefetch import executor
from oasiskv.sampling_params import SamplingParams

CATEGORIES = ("attention", "linear", "selection", "other")
PREFIX = "oasiskv:"
STEP = PREFIX + "step"
# the sparse KV's work in a step: selection (scoring, top-k, rerank), fetches, fills, masks
SPARSE_METHODS = ("begin_step", "end_step", "wait_layer", "prepare_layer", "after_attention",
                  "commit_token", "summarize_prefill")


@dataclass
class StepBreakdown:
    steps: int
    step_ms: float  # mean profiled step (ms)
    ms: dict[str, float]  # category -> ms per step, adding up to step_ms
    ops: dict[str, float]  # category -> torch ops per step (outermost ones)
    background_ms: float  # prefetch stages on worker threads, per step (overlapping the step)

    def row(self) -> dict:
        out = {"profiled_step_ms": self.step_ms, "background_ms": self.background_ms,
               "ops_per_step": sum(self.ops.values())}
        for c in CATEGORIES:
            out[f"{c}_ms"] = self.ms[c]
            out[f"{c}_ops"] = self.ops[c]
        return out


def _ranged(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapper


@contextmanager
def marked(engine: LLMEngine):
    """The engine's parts as profiler ranges named PREFIX + category, while inside."""
    handles, undo = [], []
    for module in engine.model.modules():
        kind = ("attention" if isinstance(module, Attention) else
                "linear" if isinstance(module, Linear) else None)
        if kind is None:
            continue
        opened: list = []

        def enter(_m, _args, name=PREFIX + kind, opened=opened):
            rf = record_function(name)
            rf.__enter__()
            opened.append(rf)

        def leave(_m, _args, _out, opened=opened):
            opened.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    sparse = engine.sparse
    if sparse is not None:
        for name in SPARSE_METHODS:
            setattr(sparse, name, _ranged(PREFIX + "selection", getattr(sparse, name)))
            undo.append(functools.partial(delattr, sparse, name))  # back to the class's
    run = executor._run  # every prefetch stage, inline or on a worker thread
    executor._run = _ranged(PREFIX + "selection", run)
    undo.append(functools.partial(setattr, executor, "_run", run))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for fn in undo:
            fn()


def attribute(events, steps: int) -> StepBreakdown:
    """Profiler events -> per-step exclusive time and op counts per category."""
    def span(e):
        return e.time_range.start, e.time_range.end

    step_events = [e for e in events if e.name == STEP]
    main = step_events[0].thread
    ms = dict.fromkeys(CATEGORIES, 0.0)
    ops = dict.fromkeys(CATEGORIES, 0)
    background = 0.0
    # ranges and outermost ops of the stepping thread, in start order (enclosing first)
    items = sorted((e for e in events if e.thread == main and (
        e.name.startswith(PREFIX) or e.cpu_parent is None or
        not e.cpu_parent.name.startswith("aten::"))), key=lambda e: (span(e)[0], -span(e)[1]))
    stack: list[tuple[str, float]] = []  # (category or "step", end)
    for e in items:
        start, end = span(e)
        while stack and stack[-1][1] <= start:
            stack.pop()
        parent = stack[-1][0] if stack else None
        if e.name.startswith(PREFIX):
            kind = e.name[len(PREFIX):]
            if kind != "step":
                ms[kind] += (end - start) / 1e3
                if parent not in (None, "step"):
                    ms[parent] -= (end - start) / 1e3  # nested: its own category's
            stack.append((kind, end))
        elif parent is not None:  # an op (outside any step: not ours)
            ops["other" if parent == "step" else parent] += 1
    total = sum(span(e)[1] - span(e)[0] for e in step_events) / 1e3
    ms["other"] = total - sum(ms[c] for c in CATEGORIES if c != "other")
    for e in events:  # prefetch stages on worker threads, outermost only
        if e.thread != main and e.name == PREFIX + "selection" and (
                e.cpu_parent is None or e.cpu_parent.name != e.name):
            background += (span(e)[1] - span(e)[0]) / 1e3
    n = len(step_events)
    return StepBreakdown(n, total / n, {c: v / n for c, v in ms.items()},
                         {c: v / n for c, v in ops.items()}, background / n)


def profile_steps(engine: LLMEngine, steps: int) -> StepBreakdown:
    """`steps` engine steps (fewer if the requests finish first) under the profiler."""
    if steps < 1:
        raise ValueError(f"steps to profile must be at least 1, got {steps}")
    with marked(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            if not engine.has_unfinished():
                break
            with record_function(STEP):
                engine.step()
    events = prof.events()
    if not any(e.name == STEP for e in events):
        raise ValueError("no step to profile: the engine has no unfinished request")
    return attribute(events, steps)


def breakdown_run(kwargs: dict, prompts: list[list[int]], kv_files: list[Path],
                  output_len: int, steps: int, warmup: int = 2) -> dict:
    """One mode at one level, untimed: the requests arrive at once from their prompt K/V, the
    engine steps until every request has decoded `warmup` tokens (or the batch that fits the
    budget has), then `steps` steps are profiled. -> StepBreakdown.row() and the mean running
    batch of the profiled steps."""
    engine = LLMEngine(EngineConfig.from_kwargs(**kwargs))
    try:
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        for p, f in zip(prompts, kv_files, strict=True):
            engine.add_request(p, params, prefix_kv=load(f.read_bytes())["kv"])
        deadline = time.perf_counter() + 600
        while engine.has_unfinished() and time.perf_counter() < deadline:
            running = engine.scheduler.running
            if running and all(s.num_output_tokens >= warmup for s in running):
                break
            engine.step()
        start = len(engine.step_log)
        out = profile_steps(engine, steps).row()
        log = [e for e in list(engine.step_log)[start:] if e["decode_tokens"]]
        out["profiled_running"] = sum(e["decode_tokens"] for e in log) / max(len(log), 1)
        return out
    finally:
        engine.close()


def breakdown_columns() -> list[tuple[str, str]]:
    return ([("profiled_step_ms", "profiled step ms")] +
            [(f"{c}_ms", f"{c} ms") for c in CATEGORIES] +
            [("ops_per_step", "ops/step"), ("background_ms", "bg selection ms")])


def check_steps(steps: int) -> int:
    if steps < 0:
        raise ValueError(f"--breakdown takes a number of steps to profile (0: off), got {steps}")
    return steps

