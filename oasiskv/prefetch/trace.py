"""Spans for a Chrome trace (chrome://tracing, Perfetto): one track per pipeline stage plus the
foreground, so the overlap of prefetch and model execution can be seen."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path


class Tracer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._tracks: dict[str, int] = {}

    def span(self, track: str, name: str, start: float, end: float, **args) -> None:
        """A span [start, end] (perf_counter seconds) on `track`."""
        with self._lock:
            tid = self._tracks.setdefault(track, len(self._tracks) + 1)
            self.events.append({"name": name, "ph": "X", "pid": 1, "tid": tid,
                                "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6,
                                "args": args})

    def write(self, path: str | Path) -> None:
        with self._lock:
            names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                      "args": {"name": track}} for track, tid in self._tracks.items()]
            order = [{"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                      "args": {"sort_index": tid}} for tid in self._tracks.values()]
            Path(path).write_text(json.dumps({"traceEvents": names + order + self.events,
                                              "displayTimeUnit": "ms"}))
