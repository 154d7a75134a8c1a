"""`check_invariants` passes on a healthy engine mid-run and names each kind of corruption
planted by hand (so a test that relies on it cannot pass by checking nothing)."""

from __future__ import annotations

import pytest
import torch
from conftest import requests_in

from oasiskv import LLM, SamplingParams
from oasiskv.engine.invariants import InvariantError
from oasiskv.store.remote_store import BlockKey

PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def dense(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), device_kv_budget="1MiB")


@pytest.fixture(scope="module")
def sparse(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), kv_mode="sparse", top_k=2, remote_store="inprocess",
               prefetch="async")


def mid_run(llm: LLM):  # noqa: ANN201 - (engine, two running requests)
    e = llm.engine
    g = torch.Generator().manual_seed(0)
    a, b = (e.add_request(torch.randint(3, 300, (n,), generator=g).tolist(), PARAMS)
            for n in (40, 23))
    for _ in range(3):
        e.step()
    e.check_invariants()  # healthy
    return e, e.requests[a], e.requests[b]


def _double_owned(e, a, b):  # noqa: ANN001, ANN202
    b.block_table.append(a.block_table[0])
    return lambda: b.block_table.pop(), "owned by requests"


def _leaked(e, a, b):  # noqa: ANN001, ANN202
    stray: list[int] = []
    e.kv.device.grow(stray, 1)
    return lambda: e.kv.device.free(stray), "leaked blocks"


def _marked_free(e, a, b):  # noqa: ANN001, ANN202
    block = a.block_table[-1]
    e.kv.device.is_free[block] = True
    e.kv.device.num_free += 1

    def undo() -> None:
        e.kv.device.is_free[block] = False
        e.kv.device.num_free -= 1
    return undo, f"device block {block} of request {a.request_id} is free"


def _half_advanced(e, a, b):  # noqa: ANN001, ANN202
    b.num_computed_tokens += 1
    return lambda: setattr(b, "num_computed_tokens", b.num_computed_tokens - 1), "K/V for"


def _lost(e, a, b):  # noqa: ANN001, ANN202
    e.scheduler.running.remove(b)
    return lambda: e.scheduler.running.append(b), "request table"


def _ended_twice(e, a, b):  # noqa: ANN001, ANN202
    e.counters["requests_finished"] += 1
    return (lambda: e.counters.__setitem__("requests_finished",
                                           e.counters["requests_finished"] - 1),
            "lost or ended twice")


@pytest.mark.parametrize("corrupt", [_double_owned, _leaked, _marked_free, _half_advanced,
                                     _lost, _ended_twice])
def test_each_corruption_is_named(dense, corrupt):
    e, a, b = mid_run(dense)
    undo, words = corrupt(e, a, b)
    with pytest.raises(InvariantError, match=words):
        e.check_invariants()
    undo()
    e.check_invariants()
    while e.has_unfinished():
        e.step()
    e.check_invariants()


def test_a_job_for_an_ended_request_and_a_stray_namespace_are_named(sparse):
    e, a, b = mid_run(sparse)
    ended = e.make_sequence([5, 6, 7], PARAMS)  # never admitted: no job may touch it
    held = []
    e.sparse.pipeline.submit(0, "test", [("predict", lambda: held.append(1))], [ended])
    with pytest.raises(InvariantError, match="prefetch jobs still pending"):
        e.check_invariants()
    e.sparse.flush()
    e.check_invariants()
    store = e.sparse.remote.store
    stray = BlockKey("stray-ns", 0, 0)
    store.put_blocks([stray], torch.zeros(1, *store.block_shape, dtype=store.dtype))
    with pytest.raises(InvariantError, match="stray-ns"):
        e.check_invariants()
    e.check_invariants({"stray-ns"})  # another engine's, on a shared store
    store.remove("stray-ns")
    while e.has_unfinished():
        e.step()
    e.check_invariants()
    assert requests_in(store) == set()
