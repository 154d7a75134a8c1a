"""How a step's failures end requests, so that one bad request never stops the engine.

The rules (`LLMEngine.step` and `remote_steps` follow them):
- a request that fails is finished at once with finish_reason "error" and a message, and comes
  out of the step that failed it as an output, whatever else that step does;
- an exception fails only the requests it concerns: raised by the forward pass of a batch, the
  batch's requests are retried one by one (only the culprit fails alone); raised by the work
  for one request after the forward pass, that request fails and the others go on;
- a torch out-of-memory error is one such exception: it fails requests, not the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.sequence import Sequence

log = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's out-of-memory errors (CUDA's is a subclass), and a CPU allocator's, which
    torch raises as a plain RuntimeError."""
    text = str(exc).lower()
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text
                                           or "can't allocate memory" in text))


@dataclass
class StepFailures:
    """The requests one step failed. `finish(seq, message)` ends a request with an error
    (the engine's bookkeeping: frees its blocks, counts it)."""

    finish: Callable[[Sequence, str], None]
    failed: list[Sequence] = field(default_factory=list)

    def fail(self, seq: Sequence, message: str, retryable: bool = False) -> None:
        """`retryable`: the request failed for want of room (a full store), not for itself."""
        if seq.is_finished:  # it already ended this step (one outcome per request)
            return
        log.error("request %s failed: %s", seq.request_id, message)
        seq.retryable = retryable
        self.finish(seq, message)
        self.failed.append(seq)

    @contextmanager
    def guard(self, seq: Sequence, what: str) -> Iterator[None]:
        """Runs the block for `seq` alone: an exception there fails `seq` (the message says
        `what` failed) and goes no further."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - one request's failure, reported on it
            self.fail(seq, f"{what} failed: {describe(e)}")

    def forward_failed(self, batch: ScheduledBatch, exc: Exception) -> None:
        """The step's forward pass raised: nothing of it is kept (its KV writes are redone on
        retry). A request that ran alone fails with the error; a batch's requests are retried
        one by one, so that only the culprit fails."""
        if is_out_of_memory(exc) and torch.cuda.is_available():
            torch.cuda.empty_cache()  # the retries alone need less; give them the cached blocks
        if len(batch) > 1:
            log.warning("step failed (%s); retrying its %d requests one by one",
                        describe(exc), len(batch))
            for seq, _ in batch:
                seq.suspect = True
            return
        self.fail(batch[0][0], describe(exc))
