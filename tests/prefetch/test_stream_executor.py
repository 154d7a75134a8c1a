"""The CUDA stream executor's ordering, against a simulated device (`SimDevice`: streams run
their work in order, one stream's work waits only for the events it was told to wait on, and
the device interleaves the streams at random, as a GPU may).

A layer's chain (predict -> select -> remote -> local) reads what the foreground computed
before it was submitted (the layer's query) and writes the slab that the foreground's next
attention reads after `PrefetchPipeline.wait`: under every interleaving each reader must see
its writer's value, while the host never waits for the device. Only a GPU run confirms the
real streams (listed in the device check)."""

import os
import random
import weakref
from collections import deque
from contextlib import contextmanager

import pytest
import torch

from oasiskv.prefetch.executor import CudaStreamExecutor
from oasiskv.prefetch.pipeline import PrefetchPipeline


class SimEvent:
    def __init__(self, device):
        self.device, self.done = device, True  # never recorded: complete, as in CUDA

    def record(self, stream):
        self.done = False
        stream.work.append(("record", self))

    def query(self):
        return self.done

    def synchronize(self):
        self.device.syncs += 1
        self.device.run(until=lambda: self.done)


class SimStream:
    def __init__(self, device):
        self.device, self.work = device, deque()

    def wait_event(self, event):
        self.work.append(("wait", event))


class SimDevice:
    """A StreamBackend whose streams the test runs: `launch` enqueues a kernel (a function)
    on the current stream; `run` executes the streams' heads in a random order."""

    def __init__(self, seed):
        self.rng, self.syncs = random.Random(seed), 0
        self.foreground = SimStream(self)
        self.current = self.foreground

    def stream(self):
        return SimStream(self)

    def event(self):
        return SimEvent(self)

    def current_stream(self):
        return self.current

    @contextmanager
    def use(self, stream):
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def launch(self, kernel):
        self.current.work.append(("kernel", kernel))

    def run(self, until=lambda: False):
        streams = [self.foreground, *self.executor.streams.values()]
        while not until():
            ready = [s for s in streams if s.work and (s.work[0][0] != "wait"
                                                       or s.work[0][1].done)]
            if not ready:
                assert all(not s.work for s in streams), "the streams wait on each other"
                return
            kind, item = self.rng.choice(ready).work.popleft()
            if kind == "kernel":
                item()
            elif kind == "record":
                item.done = True


def run_two_steps(seed, executor_cls=CudaStreamExecutor):
    """Two decode steps of 3 layers: the foreground writes each layer's query, submits its
    chain, and reads its slab after waiting; returns what each read saw."""
    dev = SimDevice(seed)
    ex = dev.executor = executor_cls(backend=dev)
    pipe = PrefetchPipeline(ex)
    mem, seen = {}, []
    for step in range(2):
        for layer in range(3):
            pipe.wait(layer)
            dev.launch(lambda k=(step, layer): seen.append((k, mem.get(("slab",) + k[1:]))))
            dev.launch(lambda k=(step, layer): mem.__setitem__(("q", k[1]), k))

            def stage(src, dst, layer=layer):
                dev.launch(lambda: mem.__setitem__((dst, layer), mem.get((src, layer))))

            pipe.submit(layer, f"step {step}", [
                ("predict", lambda s=stage: s("q", "pred")), ("select", lambda s=stage: s(
                    "pred", "sel")), ("remote", lambda: None),
                ("local", lambda s=stage: s("sel", "slab"))], [])
    for layer in range(3):  # a third step's attention reads step 1's prediction
        pipe.wait(layer)
        dev.launch(lambda k=(2, layer): seen.append((k, mem.get(("slab", k[1])))))
    host_syncs = dev.syncs
    dev.run()
    return seen, host_syncs


@pytest.mark.parametrize("seed", range(40))
def test_each_reader_sees_its_writer_under_any_interleaving(seed):
    seen, host_syncs = run_two_steps(seed)
    # step s's attention of a layer reads the slab that step s-1's chain wrote from step
    # s-1's query (none before the first step)
    assert seen == [((s, layer), None if s == 0 else (s - 1, layer))
                    for s in range(3) for layer in range(3)]
    assert host_syncs == 0  # the host only enqueued


def test_a_job_lives_until_the_device_ran_it():
    """The host is past a stage long before the device runs it: the executor keeps the
    stage's function (and the tensors it holds) until its event is done."""
    dev = SimDevice(0)
    ex = dev.executor = CudaStreamExecutor(backend=dev)

    class Job:
        def run(self):
            dev.launch(lambda: None)

    job = Job()
    ref = weakref.ref(job)
    ex.submit("predict", job.run)
    del job
    assert ref() is not None  # queued on the device, not yet run
    dev.run()
    ex.submit("select", lambda: None)  # a later submit lets go of what has run
    assert ref() is None
    ex.close()


def test_a_failed_stage_fails_its_dependents_and_the_waiter():
    dev = SimDevice(0)
    ex = dev.executor = CudaStreamExecutor(backend=dev)
    pipe = PrefetchPipeline(ex)
    ran = []
    pipe.submit(0, "x", [("predict", lambda: 1 / 0), ("select", lambda: ran.append(1))], [])
    with pytest.raises(Exception, match="'predict'.*ZeroDivisionError"):
        pipe.wait(0)
    assert ran == []


@pytest.mark.skipif(os.environ.get("OASISKV_TEST_DEVICE", "cpu") == "cpu",
                    reason="a GPU run (OASISKV_TEST_DEVICE=cuda)")
def test_real_streams_run_a_chain_between_the_foreground_s_work():
    """On CUDA streams: each step's chain reads the foreground's value of that step and the
    foreground reads the chain's result after waiting (large products: a missing wait
    would read a result not yet written)."""
    dev = torch.device(os.environ["OASISKV_TEST_DEVICE"])
    pipe = PrefetchPipeline(CudaStreamExecutor(dev))
    a = torch.randn(2048, 2048, device=dev) / 45
    out = {}
    for step in range(3):
        q = a * (step + 1)  # the foreground's work, which the chain reads
        pipe.submit(0, f"step {step}", [
            ("predict", lambda q=q: out.__setitem__("p", q @ a)),
            ("select", lambda: out.__setitem__("s", out["p"] @ a)),
            ("local", lambda: out.__setitem__("slab", out["s"].sum(0)))], [])
        pipe.wait(0)
        got = out["slab"].clone()  # on the foreground stream, after the wait
        torch.testing.assert_close(got, ((a * (step + 1)) @ a @ a).sum(0))
    pipe.close()
