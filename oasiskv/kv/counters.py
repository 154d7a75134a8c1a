"""The sparse KV's counters (selection, traffic, stalls) and the tally that prefetch jobs count
into from worker threads, taken into the step's and the total counters by the foreground.

A job counts device tensors as they are (reading one back would stop the host until the
device caught up, and with the CUDA executor serialise the prefetch streams); the tally reads
them back when it is taken, once per step, all at once, and only those whose job's work is
done (a CUDA count carries the event recorded after it: a count not yet done waits for a
later take, or for `take(wait=True)`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class SparseCounters:
    predicted: int = 0  # blocks predicted (summed over requests, layers, heads)
    hits: int = 0  # ... already resident
    wanted: int = 0  # ... not resident
    admitted: int = 0  # ... copied in (wanted - admitted were held back by the cap)
    h2d_bytes: int = 0  # host -> device: local fetches and active-block loads
    d2h_bytes: int = 0  # device -> host: filled blocks
    host_write_bytes: int = 0  # prefill K/V written straight to the host tier
    remote_bytes: int = 0  # remote store -> host cache: misses fetched during decode
    remote_blocks: int = 0  # ... in blocks (one layer's block each)
    remote_put_bytes: int = 0  # host -> remote store: complete prompt blocks after prefill
    prefix_put_bytes: int = 0  # ... and copies of them into prefix-cache entries
    handoff_bytes: int = 0  # decode worker: hand-overs' admission bytes (kept blocks + rest)
    host_evictions: int = 0  # prompt blocks the host caches dropped (still in the store)
    stall_s: float = 0.0  # foreground time waiting for prefetch jobs

    def add(self, other: SparseCounters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class CounterTally:
    """Counts not yet taken: added from any thread (`count`), taken as a whole (`take`)."""

    def __init__(self) -> None:
        self._pending = SparseCounters()
        self._tensors: list[tuple[str, torch.Tensor, object]] = []  # (name, count, event)
        self._lock = threading.Lock()

    def count(self, **amounts: float | torch.Tensor) -> None:
        """Adds to the named counters (a SparseCounters field each); a tensor amount (a 0-d
        count on the job's device) is read back by `take`."""
        event = None
        for name, value in amounts.items():
            if not hasattr(self._pending, name):
                raise AttributeError(f"no counter named {name!r}")
            if isinstance(value, torch.Tensor) and value.is_cuda and event is None:
                event = torch.cuda.Event()  # after the work that computes the count
                event.record()
        with self._lock:
            for name, value in amounts.items():
                if isinstance(value, torch.Tensor):
                    self._tensors.append((name, value, event))
                else:
                    setattr(self._pending, name, getattr(self._pending, name) + value)

    def take(self, wait: bool = False) -> SparseCounters:
        """What was counted since the last take (tensor counts whose work is done, or all of
        them with `wait`: one read-back for all); the tally starts again from zero."""
        with self._lock:
            pending, self._pending = self._pending, SparseCounters()
            ready = [t for t in self._tensors if wait or t[2] is None or t[2].query()]
            self._tensors = [t for t in self._tensors if not any(t is r for r in ready)]
        for _, _, event in ready:
            if event is not None:
                event.synchronize()  # done already unless `wait`
        if ready:  # the step's one read-back of device counts
            values = torch.stack([t.reshape(()).to(torch.int64) for _, t, _ in ready]).tolist()
            for (name, _, _), value in zip(ready, values, strict=True):
                setattr(pending, name, getattr(pending, name) + value)
        return pending
