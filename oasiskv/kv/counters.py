"""The sparse KV's counters (selection, traffic, stalls) and the tally that prefetch jobs count
into from worker threads, taken into the step's and the total counters by the foreground."""

from __future__ import annotations

import threading
from dataclasses import dataclass


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
        self._lock = threading.Lock()

    def count(self, **amounts: float) -> None:
        """Adds to the named counters (a SparseCounters field each)."""
        with self._lock:
            for name, value in amounts.items():
                setattr(self._pending, name, getattr(self._pending, name) + value)

    def take(self) -> SparseCounters:
        """What was counted since the last take; the tally starts again from zero."""
        with self._lock:
            pending, self._pending = self._pending, SparseCounters()
        return pending
