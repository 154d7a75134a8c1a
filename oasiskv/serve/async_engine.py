"""The engine behind an event loop: one stepping loop in its own thread, fed through a
thread-safe command queue, so new requests join the running batch between steps (continuous
batching over HTTP) and no client, slow or gone, ever holds the loop up.

Requests are validated on the caller's side (`LLMEngine.make_sequence`: a 400 before anything
is queued); the loop adds them between steps and hands each output to its request's asyncio
queue with `loop.call_soon_threadsafe`. An abort (client gone, timeout, shutdown) takes the
request out at the next step boundary, which frees its device and host blocks."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

import torch

from oasiskv.engine.engine import LLMEngine
from oasiskv.outputs import RequestOutput
from oasiskv.sequence import Sequence
from oasiskv.serve.errors import (
    APIError,
    BadRequest,
    EngineFailure,
    QueueFull,
    RequestTimeout,
    StoreFullError,
)
from oasiskv.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt), in step order."""

    def __init__(self, owner: AsyncEngine, seqs: list[Sequence], deadline: float | None) -> None:
        self.owner, self.seqs, self.deadline = owner, seqs, deadline
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | APIError] = asyncio.Queue()
        self.unfinished = {s.request_id for s in seqs}

    def put(self, item: RequestOutput | APIError) -> None:
        """Loop thread: hand an output (or the error that ends the request) to the client."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def abort(self) -> None:
        """Ends whatever of the request still runs (a no-op once all of it finished)."""
        if self.unfinished:
            self.owner.abort(list(self.unfinished))
            self.unfinished.clear()

    async def events(self, tick_s: float | None = None) -> AsyncIterator[RequestOutput | None]:
        """Each output as it comes; `None` after `tick_s` seconds without one (a client can
        send a keep-alive or check that its peer is still there). Raises the APIError that ends
        the request: the engine failed it, the deadline passed, or the server stopped."""
        while self.unfinished:
            timeout = tick_s
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.abort()
                    raise RequestTimeout(f"the request ran past the server's request timeout "
                                         f"({self.owner.request_timeout:g} s) and was aborted")
                timeout = left if timeout is None else min(timeout, left)
            try:
                item = await asyncio.wait_for(self.queue.get(), timeout)
            except TimeoutError:
                if self.deadline is None or time.monotonic() < self.deadline:
                    yield None
                continue
            if isinstance(item, APIError):
                self.abort()
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            if item.finish_reason == "error":
                self.abort()  # the other prompts of the request: its answer is lost anyway
                if item.retryable:  # a full store: 503, worth retrying
                    raise StoreFullError(f"the engine could not take the request now: "
                                         f"{item.error}")
                raise EngineFailure(f"the engine failed the request: {item.error}")
            yield item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int = 256,
                 request_timeout: float | None = None) -> None:
        self.engine, self.metrics = engine, metrics
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._lock = threading.Lock()
        self._pending = 0  # requests submitted that the loop has not added yet
        self._stopping = False
        self.num_waiting = 0  # the engine's, as of the last step (loop thread writes)
        self.num_running = 0
        self.queued_prompt_tokens = 0
        self._thread = threading.Thread(target=self._run, name="oasiskv-engine", daemon=True)

    # ---- event loop side ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, seqs: list[Sequence]) -> RequestStream:
        """Queues validated requests; 503 when the waiting queue is full."""
        if len(seqs) > self.max_waiting:
            raise BadRequest(f"{len(seqs)} prompts in one request exceed the server's waiting "
                             f"queue ({self.max_waiting}, --max-waiting)", param="prompt")
        with self._lock:
            if not self.healthy:
                raise QueueFull("the server is shutting down", headers={"Retry-After": "5"})
            waiting = self._pending + self.num_waiting
            if waiting + len(seqs) > self.max_waiting:
                raise QueueFull(f"the waiting queue is full ({waiting} requests wait, "
                                f"--max-waiting {self.max_waiting}); retry later",
                                headers={"Retry-After": "1"})
            self._pending += len(seqs)
        deadline = (time.monotonic() + self.request_timeout) if self.request_timeout else None
        stream = RequestStream(self, seqs, deadline)
        self._commands.put(("add", stream))
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids))

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts what is still running and ends the loop (the engine itself stays open)."""
        with self._lock:
            self._stopping = True
        self._commands.put(("stop",))
        self._thread.join(timeout)

    # ---- loop thread ----------------------------------------------------------------------

    def _run(self) -> None:
        if self.engine.config.num_threads:  # torch's thread count is per thread under OpenMP
            torch.set_num_threads(self.engine.config.num_threads)
        while True:
            try:
                if not self._handle(self._take_commands(block=not self.engine.has_unfinished())):
                    return
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
            except Exception as e:  # noqa: BLE001 - the loop outlives any one failure
                log.exception("engine loop failure; failing the requests in flight")
                self._fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))

    def _take_commands(self, block: bool) -> list[tuple]:
        cmds = [self._commands.get()] if block else []
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmds: list[tuple]) -> bool:
        for cmd in cmds:
            if cmd[0] == "add":
                self._add(cmd[1])
            elif cmd[0] == "abort":
                for rid in cmd[1]:
                    self._abort(rid)
            else:  # stop
                self._fail_all(EngineFailure("the server shut down before the request ended"))
                return False
        return True

    def _add(self, stream: RequestStream) -> None:
        with self._lock:
            self._pending -= len(stream.seqs)
        for seq in stream.seqs:
            if seq.request_id not in stream.unfinished:  # aborted before it was added
                if seq.handoff is not None:  # nobody else will drop its blocks
                    self.engine.remote.drop_handoff(seq.handoff)
                continue
            try:
                self.engine.add_sequence(seq)
            except Exception as e:  # noqa: BLE001 - this request fails, nothing else
                log.exception("adding request %s failed", seq.request_id)
                stream.put(EngineFailure(f"the engine refused the request: {e}"))
                return
            self._streams[seq.request_id] = stream

    def _abort(self, rid: str, error: APIError | None = None) -> None:
        seq = self.engine.requests.get(rid)
        if seq is not None and not seq.is_finished:
            self.engine.abort(rid)
            self.metrics.on_abort(seq)
        stream = self._streams.pop(rid, None)
        if stream is not None and error is not None:
            stream.put(error)

    def _fail_all(self, error: APIError) -> None:
        for rid in list(self.engine.requests) + list(self._streams):
            try:
                self._abort(rid, error)
            except Exception:  # noqa: BLE001 - keep failing the others
                log.exception("aborting request %s failed", rid)
                self._streams.pop(rid, None)

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.perf_counter()
        for out in outputs:
            self.metrics.on_output(out, now)
            stream = (self._streams.pop if out.finished else self._streams.get)(
                out.request_id, None)
            if stream is not None:
                stream.put(out)

    def _publish(self) -> None:
        sched = self.engine.scheduler
        self.num_running, self.num_waiting = len(sched.running), len(sched.waiting)
        # prompt tokens not yet computed: what a router weighs prefill workers by
        self.queued_prompt_tokens = sum(max(0, s.num_prompt_tokens - s.num_computed_tokens)
                                        for s in [*sched.running, *sched.waiting])
        self.metrics.set_queues(self.num_running, self.num_waiting + self._pending)
        self.metrics.update(self.engine)
