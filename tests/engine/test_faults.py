"""Engine failure paths: whatever fails, and wherever, every failed request comes out as an
output with finish_reason "error" and a message, the other requests go on with the tokens of a
clean run, nothing is written into blocks another request got, nothing a failed request put
stays in the store, and the engine's invariants (`engine/invariants.py`) hold after every step.

References: dense engines and clean runs of the same configuration (greedy, K covering every
block where a working set may be reset, so a reset cannot change a token)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import requests_in

from oasiskv import LLM, SamplingParams
from oasiskv.disagg.pd import DisaggregatedLLM
from oasiskv.spec.drafters import ResyncDrafter
from oasiskv.store.remote_store import RemoteStoreError

B = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# sparse, with K covering every block of these requests: equal to dense, whatever resets
EXACT = dict(kv_mode="sparse", top_k=16, max_num_seqs=4, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def model(tiny_llama) -> str:
    return str(tiny_llama)


@pytest.fixture(scope="module")
def dense(model) -> LLM:
    return LLM(model, device_kv_budget="2MiB")


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def clean(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    return [llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]


def drive(engine) -> dict:  # noqa: ANN001 - an LLMEngine
    """Steps until idle, checking the invariants after every step; each request's final
    output (each must come out exactly once)."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} came out twice"
                done[out.request_id] = out
        engine.check_invariants()
    return done


def fail_reads(store, suffix: str, message: str) -> None:  # noqa: ANN001 - a RemoteStore
    """The store's reads of any namespace ending in `suffix` fail with `message`."""
    real_get = store.get_blocks

    def get_blocks(keys, out=None):
        if any(k.namespace.endswith(suffix) for k in keys):
            raise RemoteStoreError(message, list(keys))
        return real_get(keys, out)

    store.get_blocks = get_blocks


def assert_failed(out, *words: str) -> None:  # noqa: ANN001
    assert out.finished and out.finish_reason == "error", (out.finish_reason, out.error)
    assert out.error and all(w in out.error for w in words), out.error


# ---------------------------------------------------------------- hang


@pytest.mark.parametrize("neighbours", [1, 2])
def test_a_failed_hand_over_comes_out_when_the_same_steps_forward_fails(model, dense,
                                                                        neighbours):
    """Decode worker: request 0's hand-over cannot be read, and the forward pass of the same
    step fails (request 1 alone: it fails; with request 2 beside it: both are retried alone).
    Request 0 must come out with its error; before, the step dropped it and generate spun."""
    prompts = prompts_of([70, 90, 60][:1 + neighbours], seed=1)
    want = clean(dense, prompts)
    pd = DisaggregatedLLM(model, **EXACT)
    store = pd.decode.sparse.remote.store

    def forward_fault(batch):
        ids = [s.request_id for s, _ in batch]
        if any(i.endswith("-1") for i in ids) and len(ids) == neighbours:  # first try only
            raise RuntimeError("injected forward fault")

    fail_reads(store, "-0", "injected: hand-over blocks lost")
    pd.decode.step_hooks.append(forward_fault)
    outs = pd.generate(prompts, GREEDY, use_tqdm=False, on_step=lambda e: pd.check_invariants())
    assert_failed(outs[0], "reading the hand-over", "injected: hand-over blocks lost")
    if neighbours == 1:
        assert_failed(outs[1], "injected forward fault")
    else:
        assert [o.token_ids for o in outs[1:]] == want[1:]
    pd.check_invariants()
    assert requests_in(store) == set()  # the failed requests left the store
    del store.get_blocks
    pd.decode.step_hooks.clear()
    assert pd.generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids == want[0]
    pd.close()


def test_no_generate_loop_waits_for_a_request_the_engine_lost(model):
    """Should an engine ever lose a request (its finished output never comes), the loops
    that wait for it end with an error instead of spinning."""
    llm = LLM(model, device_kv_budget="1MiB")
    real = llm.engine.step
    llm.engine.step = lambda: [o for o in real() if not o.finished]  # finished ones vanish
    with pytest.raises(RuntimeError, match="lost requests"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="lost request"):
        list(llm.stream([5, 6, 7], GREEDY))
    pd = DisaggregatedLLM(model, **EXACT)
    real_decode = pd.decode.step
    pd.decode.step = lambda: [o for o in real_decode() if not o.finished]
    outs = pd.generate(prompts_of([40, 20]), GREEDY, use_tqdm=False)
    assert [o.error for o in outs] == ["internal error: the engines lost the request"] * 2
    pd.close()


# ---------------------------------------------------------------- silent corruption, abort


@pytest.mark.parametrize("ending", ["error", "abort"])
def test_no_stale_job_writes_into_blocks_a_new_request_reuses(model, ending):
    """Async prefetch, one job per layer. Request A completes block 2 at position 47; its fill
    job fails in layer 0 while layer 1's is still running (held until someone waits for it).
    A then ends (its step fails; or, with C beside it, both are aborted) and B, whose prefix K/V
    is given, gets A's blocks. B's output must equal a clean run: layer 1's fill may not land
    in B's host block 2 after B's prefix was written there."""
    a, c, b = prompts_of([40, 36, 64], seed=2)
    config = dict(prefetch="async", prefetch_group=1, **EXACT)
    prefix_kv = LLM(model).engine.compute_prefix_kv(b[:50])  # blocks 0-2 and 2 tokens more
    ref = LLM(model, **config)
    want_b = ref.generate([b], GREEDY, use_tqdm=False)[0].token_ids  # (b: a fresh engine)
    ref.engine.add_request(b, GREEDY, request_id="B", prefix_kv=prefix_kv)
    assert drive(ref.engine)["B"].token_ids == want_b  # the prefix changes nothing
    ref.close()
    llm = LLM(model, **config)
    e = llm.engine
    held, armed, reached = threading.Event(), [], []

    def fill_fault(layer, seqs):
        if seqs[0].request_id != "A" or layer in reached:
            return
        reached.append(layer)
        if layer == 0:
            raise OSError("injected fill fault")
        held.wait()  # layer 1: in flight until the foreground waits for it

    real_wait = e.sparse.pipeline.wait

    def wait(layer):
        if layer == 1 and armed:
            held.set()
        real_wait(layer)

    e.sparse.stage_hooks["fill"] = fill_fault
    e.sparse.pipeline.wait = wait
    try:
        e.add_request(a, GREEDY, request_id="A")
        if ending == "abort":
            e.add_request(c, GREEDY, request_id="C")
        seq_a = e.requests["A"]
        while seq_a.num_computed_tokens < 48:  # through the step that completes block 2
            e.step()
            e.check_invariants()
        armed.append(True)
        host_block = seq_a.host_table[2]
        outs = {o.request_id: o for o in e.step()}  # layer 0's failure surfaces here
        if ending == "error":
            assert_failed(outs["A"], "injected fill fault")
        else:
            assert not outs and e.counters["step_failures"] == 1  # both to be retried alone
            e.abort("A")
            e.abort("C")
        e.check_invariants()  # no job left that touches an ended request
        e.add_request(b, GREEDY, request_id="B", prefix_kv=prefix_kv)
        seq_b = e.requests["B"]
        e.step()
        assert seq_b.host_table[2] == host_block  # B got A's block
        done = drive(e)
    finally:
        held.set()
    assert done["B"].token_ids == want_b
    assert reached == [0, 1]
    llm.close()


# ---------------------------------------------------------------- leak


def test_a_failed_slab_read_leaves_nothing_in_the_store(model, dense):
    prompts = prompts_of([70, 80], seed=3)
    want = clean(dense, prompts)
    pd = DisaggregatedLLM(model, transfer="slab", **EXACT)
    store = pd.decode.sparse.remote.store
    fail_reads(store, "-0.slab", "injected: slab lost")
    outs = pd.generate(prompts, GREEDY, use_tqdm=False, on_step=lambda e: pd.check_invariants())
    assert_failed(outs[0], "reading the hand-over", "injected: slab lost")
    assert outs[1].token_ids == want[1]
    assert requests_in(store) == set()
    pd.check_invariants()
    pd.close()


# ---------------------------------------------------------------- half-updated engine


class ObservingDrafter(ResyncDrafter):
    """A drafter that reads layer 0's features (observe is called after every step)."""

    feature_layers = (0,)


def _serve_after(llm_or_pd, prompts, want) -> None:  # noqa: ANN001
    """The engine serves a normal request after the fault."""
    assert llm_or_pd.generate(prompts[:1], GREEDY, use_tqdm=False)[0].token_ids == want[0]


@pytest.mark.parametrize("error", [RuntimeError, torch.OutOfMemoryError])
@pytest.mark.parametrize("point", ["observe", "store_prompt", "append"])
def test_a_fault_after_the_forward_pass_fails_only_its_request(model, dense, point, error):
    """An exception raised for request "bad" after the batch's forward pass (the drafter's
    observe, putting its prompt to the store, taking its token) fails "bad" alone: the others
    keep the tokens of a clean run, every request's K/V count moved with the step, and the
    engine serves on. Before, the exception left the step half done and escaped step()."""
    prompts = prompts_of([40, 55, 30], seed=4)
    want = clean(dense, prompts)
    llm = LLM(model, remote_store="inprocess", **EXACT)
    e = llm.engine
    bad = []

    def fault(seq):
        if seq.request_id == "bad" and seq.num_output_tokens >= (2 if point != "store_prompt"
                                                                  else 0):
            bad.append(seq.num_computed_tokens)
            raise error("injected fault")

    if point == "observe":
        e.drafter = ObservingDrafter()
        e.runner.aux_layers = e.drafter.feature_layers
        real_observe = e.drafter.observe

        def observe(request_id, start, features):
            fault(e.requests[request_id])
            real_observe(request_id, start, features)

        e.drafter.observe = observe
    elif point == "store_prompt":
        real_store = e.sparse.store_prompt

        def store_prompt(seq):
            real_store(seq)
            fault(seq)  # after the put: what got there must leave the store again

        e.sparse.store_prompt = store_prompt
    else:
        real_check = e._check_stop

        def check_stop(seq, token):
            fault(seq)
            real_check(seq, token)

        e._check_stop = check_stop
    for rid, p in zip(["a", "bad", "b"], prompts, strict=True):
        e.add_request(p, GREEDY, request_id=rid)
    done = drive(e)
    assert bad, "the fault was never reached"
    assert_failed(done["bad"], "injected fault", error.__name__)
    assert [done["a"].token_ids, done["b"].token_ids] == [want[0], want[2]]
    assert e.counters["step_failures"] == 0  # the step itself went through
    assert requests_in(e.sparse.remote.store) == set()
    del bad[:]
    if point == "observe":
        e.drafter.observe = real_observe
    elif point == "store_prompt":
        e.sparse.store_prompt = real_store
    else:
        e._check_stop = real_check
    _serve_after(llm, prompts[1:], want[1:])
    e.check_invariants()
    llm.close()


@pytest.mark.parametrize("where", ["receive", "hand_off"])
def test_a_non_store_error_in_a_hand_over_fails_only_that_request(model, dense, where):
    """A failure that is not the store's (here out of memory) while a request is handed over
    (prefill side) or installed (decode side) fails that request alone."""
    prompts = prompts_of([70, 60], seed=5)
    want = clean(dense, prompts)
    pd = DisaggregatedLLM(model, transfer="slab", **EXACT)
    side = pd.decode if where == "receive" else pd.prefill.engine
    remote = side.sparse.remote
    name = "take_slab" if where == "receive" else "put_slab"
    real = getattr(remote, name)

    def faulty(namespace, *args):
        if namespace.rsplit("-", 1)[-1].startswith("0"):
            raise torch.OutOfMemoryError("injected out of memory")
        return real(namespace, *args)

    setattr(remote, name, faulty)
    outs = pd.generate(prompts, GREEDY, use_tqdm=False, on_step=lambda e: pd.check_invariants())
    assert_failed(outs[0], "hand-over", "OutOfMemoryError", "injected out of memory")
    assert outs[1].token_ids == want[1]
    pd.check_invariants()
    assert requests_in(remote.store) == set()
    delattr(remote, name)
    _serve_after(pd, prompts, want)
    pd.close()


def test_out_of_memory_in_a_forward_pass_fails_requests_not_the_engine(model, dense):
    prompts = prompts_of([20, 33, 41], seed=6)
    want = clean(dense, prompts)
    llm = LLM(model, device_kv_budget="2MiB")
    e = llm.engine

    def oom(batch):
        if any(s.request_id == "bad" and s.num_output_tokens >= 3 for s, _ in batch):
            raise torch.OutOfMemoryError("injected CUDA out of memory")

    e.step_hooks.append(oom)
    for rid, p in zip(["a", "bad", "b"], prompts, strict=True):
        e.add_request(p, GREEDY, request_id=rid)
    done = drive(e)
    assert_failed(done["bad"], "OutOfMemoryError")
    assert done["bad"].token_ids == want[1][:3]
    assert [done["a"].token_ids, done["b"].token_ids] == [want[0], want[2]]
    e.step_hooks.clear()
    _serve_after(llm, prompts, want)


def test_a_step_that_fails_while_writing_a_given_prefix_writes_it_again(model, dense):
    """Request p's prefix K/V is given; the step that first writes it fails before the write
    is done (with q beside it: both are retried alone). The retry must write it again, not
    take the prefix as written."""
    p, q = prompts_of([45, 30], seed=7)
    want = clean(dense, [p, q])
    prefix_kv = dense.engine.compute_prefix_kv(p[:33])
    llm = LLM(model, device_kv_budget="2MiB")
    e = llm.engine
    real_home, failed = e.runner._kv_home, []

    def kv_home(seq):
        if seq.request_id == "p" and not failed:
            failed.append(seq.num_computed_tokens)
            raise torch.OutOfMemoryError("injected out of memory")
        return real_home(seq)

    e.runner._kv_home = kv_home
    e.add_request(p, GREEDY, request_id="p", prefix_kv=prefix_kv)
    e.add_request(q, GREEDY, request_id="q")
    done = drive(e)
    assert failed == [33] and e.counters["step_failures"] == 1
    assert [done["p"].token_ids, done["q"].token_ids] == want
