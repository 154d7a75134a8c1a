"""Where prefetch stages run: inline (sync), worker threads (CPU), or CUDA streams (GPU).

A stage is a callable; `submit` returns a Handle the foreground (or a later stage) waits on.
A stage that raises stores the exception in its handle; waiting re-raises it (wrapped in a
PrefetchError that names the stage), and stages that depend on it are skipped with the same
error, so a failure reaches exactly the step that consumes it.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from oasiskv.prefetch.trace import Tracer

# A layer's selection for the next step goes predict -> select -> remote -> local; blocks a
# step completes enter the working sets as "fill" jobs (their own worker: a slow fetch of one
# layer must not hold back another layer's fill).
STAGES = ("predict", "select", "remote", "local", "fill")


class PrefetchError(RuntimeError):
    pass


class Handle:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.event = None  # CUDA: the event recorded after the stage's work

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.event is not None:  # the caller's stream waits; the host does not
            torch.cuda.current_stream().wait_event(self.event)
        if self.error is not None:
            raise self.error


def _run(stage: str, fn: Callable[[], None], after: Sequence[Handle], handle: Handle,
         tracer: Tracer | None, label: str) -> None:
    start = time.perf_counter()
    try:
        if after:
            for h in after:
                h.wait()
            start = time.perf_counter()  # the span shows the stage's work, not its wait
        fn()
    except PrefetchError as e:
        handle.finish(e)
    except Exception as e:  # noqa: BLE001 - handed to whoever waits on the handle
        handle.finish(PrefetchError(f"prefetch stage {stage!r} ({label}) failed: "
                                    f"{type(e).__name__}: {e}"))
    else:
        handle.finish()
    if tracer is not None:
        tracer.span(stage, label, start, time.perf_counter())


class Executor(ABC):
    kind: str
    tracer: Tracer | None = None

    @abstractmethod
    def submit(self, stage: str, fn: Callable[[], None], after: Sequence[Handle] = (),
               label: str = "") -> Handle:
        """Runs `fn` as `stage` once every handle of `after` is done."""

    def close(self) -> None:  # noqa: B027 - nothing to stop by default
        """Stops workers; the executor cannot be used afterwards."""


class InlineExecutor(Executor):
    """sync: every stage runs at once on the caller's thread (on the critical path)."""

    kind = "sync"

    def submit(self, stage, fn, after=(), label=""):
        handle = Handle()
        _run(stage, fn, after, handle, self.tracer, label)
        return handle


class ThreadExecutor(Executor):
    """async on CPU: one persistent worker thread per stage, jobs in submission order (torch
    ops release the GIL, so stages of different layers and the model overlap).

    A worker's torch ops run on one intra-op thread: the model's parallel regions already
    use every core, and a worker with a pool as large would oversubscribe them (OpenMP
    threads spin while they wait: on 2 cores, async steps took 2.9x as long as with no
    prefetch at all with 2 threads per worker, 1.8x with one)."""

    kind = "async"

    def __init__(self) -> None:
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._threads: list[threading.Thread] = []
        intra_op = torch.get_num_threads()
        started = threading.Barrier(len(STAGES) + 1)
        for stage in STAGES:
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._work, args=(q, started),
                                 name=f"oasiskv-{stage}", daemon=True)
            t.start()
            self._queues[stage] = q
            self._threads.append(t)
        started.wait()
        # set_num_threads also sets the count that threads started later begin with: restore it
        # (the OpenMP setting is per thread, so the workers keep theirs)
        torch.set_num_threads(intra_op)

    @staticmethod
    def _work(q: queue.SimpleQueue, started: threading.Barrier) -> None:
        torch.get_num_threads()  # torch's per-thread setup first: it would undo the next line
        torch.set_num_threads(1)
        started.wait()
        with torch.inference_mode():  # thread-local: the engine's tensors are inference ones
            while True:
                job = q.get()
                if job is None:
                    return
                _run(*job)

    def submit(self, stage, fn, after=(), label=""):
        if not self._threads:
            raise RuntimeError("the prefetch executor is closed")
        handle = Handle()
        self._queues[stage].put((stage, fn, after, handle, self.tracer, label))
        return handle

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


class CudaStreamExecutor(Executor):
    """async on GPU: the stage's kernels go to its own stream after the events it depends on;
    the host only enqueues (copies from pinned host memory are non-blocking), and a waiter's
    stream waits on the stage's event."""

    kind = "async"

    def __init__(self, device: torch.device) -> None:
        self.streams = {stage: torch.cuda.Stream(device) for stage in STAGES}

    def submit(self, stage, fn, after=(), label=""):
        handle = Handle()
        stream = self.streams[stage]
        with torch.cuda.stream(stream):  # after.wait() makes this stream wait on its event
            _run(stage, fn, after, handle, self.tracer, label)
            handle.event = torch.cuda.Event()
            handle.event.record(stream)
        return handle


def make_executor(mode: str, device: torch.device) -> Executor:
    if mode == "sync":
        return InlineExecutor()
    if mode != "async":
        raise ValueError(f"prefetch must be sync or async, got {mode!r}")
    return CudaStreamExecutor(device) if device.type == "cuda" else ThreadExecutor()
