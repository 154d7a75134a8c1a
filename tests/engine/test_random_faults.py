"""Randomized fault injection: one fault at a random point of a random step, for a random
request (or its batch), of a random kind, once or from then on. After every step the engine's
invariants hold; every request comes out once, with the tokens of a clean run or failed with
the fault's message (and the tokens it had); nothing stays in the store; then the engine
serves a normal request. Two engines: async prefetch with the lookahead, and sync prefetch
with speculative acceptance; sparse with K covering every block, so that a working set reset
cannot change a token (outputs equal dense)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from conftest import requests_in
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_faults import EXACT, GREEDY, ObservingDrafter, clean, drive, prompts_of

from oasiskv import LLM
from oasiskv.store.remote_store import RemoteStoreError

PREFETCH_STAGES = ("predict", "select", "remote", "local", "fill")
# where a fault can be injected: the batch's forward pass, a prefetch stage, or the work for
# one request around it (writing its given prefix, the drafter, its prompt's put, its token)
POINTS = ("forward", *PREFETCH_STAGES, "prefix", "observe", "propose", "store_prompt", "append")
ERRORS = (RuntimeError, torch.OutOfMemoryError, RemoteStoreError, OSError)
IDS = ("r0", "r1", "r2")  # r0 comes with its prefix K/V
PREFIX = 33


@dataclass
class Fault:
    point: str = ""
    step: int = 0  # the first step (of this run) at which it may fire
    target: str = ""
    error: type[Exception] = RuntimeError
    persistent: bool = False  # fails every time it is asked from `step` on (else once)
    now: int = 0  # the step being run
    fired: bool = False

    def __post_init__(self) -> None:
        self.lock = threading.Lock()  # prefetch stages ask from worker threads

    def arm(self, point: str, step: int, target: str, error: type[Exception],
            persistent: bool) -> None:
        self.point, self.step, self.target, self.error = point, step, target, error
        self.persistent, self.now, self.fired = persistent, 0, False

    def maybe(self, point: str, request_ids: list[str]) -> None:
        with self.lock:
            if (self.fired and not self.persistent or point != self.point or self.now < self.step
                    or self.target not in request_ids):
                return
            self.fired = True
        raise self.error(f"injected {point} fault")


def instrument(llm: LLM, fault: Fault) -> None:
    """Every injection point, each asking `fault` whether it is the one to fail now."""
    e = llm.engine
    e.drafter = drafter = ObservingDrafter()
    e.runner.aux_layers = drafter.feature_layers
    e.step_hooks.append(lambda batch: fault.maybe("forward", [s.request_id for s, _ in batch]))
    for stage in PREFETCH_STAGES:
        e.sparse.stage_hooks[stage] = lambda layer, seqs, stage=stage: fault.maybe(
            stage, [s.request_id for s in seqs])

    def around(obj, name: str, point: str, request_id) -> None:  # noqa: ANN001
        real = getattr(obj, name)

        def call(*args):
            fault.maybe(point, [request_id(*args)])
            return real(*args)
        setattr(obj, name, call)

    around(e.runner, "_kv_home", "prefix", lambda seq: seq.request_id)
    around(drafter, "observe", "observe", lambda rid, start, feats: rid)
    around(drafter, "propose_weighted", "propose", lambda *a: a[4])
    around(e.sparse, "store_prompt", "store_prompt", lambda seq: seq.request_id)
    around(e, "_check_stop", "append", lambda seq, token: seq.request_id)


@pytest.fixture(scope="module")
def setup(tiny_llama):  # noqa: ANN201 - (engines by name, fault, prompts, clean outputs)
    model = str(tiny_llama)
    dense = LLM(model, device_kv_budget="2MiB")
    prompts = prompts_of([45, 60, 30], seed=9)
    want = clean(dense, prompts)
    prefix_kv = dense.engine.compute_prefix_kv(prompts[0][:PREFIX])
    fault = Fault()
    engines = {
        "async-lookahead": LLM(model, remote_store="inprocess", prefetch="async",
                               prefetch_group=1, **EXACT),
        "sync-speculative": LLM(model, remote_store="inprocess", prefetch="sync",
                                speculative="accept", **EXACT),
    }
    for llm in engines.values():
        instrument(llm, fault)
    yield engines, fault, prompts, prefix_kv, want
    for llm in engines.values():
        llm.close()


@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(engine=st.sampled_from(["async-lookahead", "sync-speculative"]),
       point=st.sampled_from(POINTS), step=st.integers(1, 12), target=st.sampled_from(IDS),
       error=st.sampled_from(ERRORS), persistent=st.booleans())
def test_one_random_fault_leaves_the_engine_consistent(setup, engine, point, step, target,
                                                       error, persistent):
    engines, fault, prompts, prefix_kv, want = setup
    e = engines[engine].engine
    for rid in list(e.requests):  # left by an example that failed (while hypothesis shrinks)
        e.abort(rid)
    if point in ("prefix", "store_prompt"):  # done in a request's first step only
        step = 1
    if point == "prefix":  # only r0 comes with a prefix
        target = "r0"
    fault.arm(point, step, target, error, persistent)
    for rid, prompt in zip(IDS, prompts, strict=True):
        e.add_request(prompt, GREEDY, request_id=rid,
                      prefix_kv=prefix_kv if rid == "r0" else None)
    done: dict = {}
    while e.has_unfinished():
        fault.now += 1
        for out in e.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
        e.check_invariants()
    assert set(done) == set(IDS)
    for rid, ref in zip(IDS, want, strict=True):
        out = done[rid]
        if out.finish_reason == "error":
            assert fault.fired and f"injected {point} fault" in out.error
            assert out.token_ids == ref[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.error is None
            assert out.token_ids == ref, (rid, out.token_ids, ref)
    if point in ("observe", "store_prompt", "append") and fault.fired:
        assert done[target].finish_reason == "error"  # only ever its own request
    assert requests_in(e.sparse.remote.store) == set()
    fault.point = ""  # then a normal request, served as before
    e.add_request(prompts[1], GREEDY, request_id="after")
    assert drive(e)["after"].token_ids == want[1]
