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
from collections import deque
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
        self.streams: StreamBackend | None = None  # CUDA: whose current stream waits for it

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.event is not None:  # the caller's stream waits; the host does not
            self.streams.current_stream().wait_event(self.event)
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


class StreamBackend:
    """What the stream executor asks of a CUDA device: streams, events, the current stream.
    A seam, so that the executor's ordering can be tested against a simulated device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self):
        return torch.cuda.Stream(self.device)

    def event(self):
        return torch.cuda.Event()

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)


class CudaStreamExecutor(Executor):
    """async on GPU (paper §3.3: predict, select and transfer streams beside the compute
    stream): each stage has its own stream. The host only enqueues: `submit` runs the
    stage's function at once on the caller's thread with its stream current, after making
    that stream wait for the caller's stream as it is now (the stage reads what the
    foreground computed: a layer's queries) and for each `after` handle's event; then records
    the stage's event, which a waiter's stream waits on (`Handle.wait`: the device waits, the
    host does not). Nothing here reads the device back: a stage must not either (copies from
    pinned host memory are non-blocking, `kv/transfers.py`).

    Tensors a job creates on its stream or reads from another live as long as the job (its
    function) does; the executor keeps each function until the device has run its stage
    (its event is done), since the host is long past it by then (as record_stream would)."""

    kind = "async"

    def __init__(self, device: torch.device | None = None,
                 backend: StreamBackend | None = None) -> None:
        self.backend = backend or StreamBackend(device)
        self.streams = {stage: self.backend.stream() for stage in STAGES}
        self._inflight: deque = deque()  # (event, function) not yet run by the device
        self._closed = False

    def submit(self, stage, fn, after=(), label=""):
        if self._closed:
            raise RuntimeError("the prefetch executor is closed")
        b, stream = self.backend, self.streams[stage]
        ready = b.event()  # the foreground's work so far, which the stage reads
        ready.record(b.current_stream())
        stream.wait_event(ready)
        handle = Handle()
        handle.streams = b
        with b.use(stream):  # after's waits make this stream wait on their events
            _run(stage, fn, after, handle, self.tracer, label)
        handle.event = b.event()
        handle.event.record(stream)
        self._inflight.append((handle.event, fn))
        while self._inflight and self._inflight[0][0].query():  # run: nothing to keep
            self._inflight.popleft()
        return handle

    def close(self) -> None:
        for event, _ in self._inflight:
            event.synchronize()
        self._inflight.clear()
        self._closed = True


def make_executor(mode: str, device: torch.device) -> Executor:
    if mode == "sync":
        return InlineExecutor()
    if mode != "async":
        raise ValueError(f"prefetch must be sync or async, got {mode!r}")
    return CudaStreamExecutor(device) if device.type == "cuda" else ThreadExecutor()
