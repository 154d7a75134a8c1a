"""`bench serve`: the bytes that reach the decode hosts from the store, sampled once a second
while a rate's trace runs.

The decode side's counters: `oasiskv:sparse_store_to_host_bytes_total` (blocks a decode step
wanted and its host did not hold) plus `oasiskv:sparse_handoff_bytes_total` (hand-overs
admitted: kept prompt blocks or slab, and the rest), and the gauge `oasiskv:kv_host_bytes_used`
(decode-host KV memory). Read from the router's /metrics, the samples labelled role="decode"
summed over decode workers; or from one server's own page (no role label: a colocated
server, whose store reads are the same counter). Each window's figure is its counter increase
divided by its length (bytes per second; the windows are 1 s apart, a missed scrape widens
one); their mean and p99 are the link bandwidth figures of the paper.
"""

from __future__ import annotations

import logging
import threading
import time
from itertools import pairwise

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)
COUNTERS = {"store_to_host": "oasiskv:sparse_store_to_host_bytes_total",
            "handoff": "oasiskv:sparse_handoff_bytes_total"}
HOST_USED = "oasiskv:kv_host_bytes_used"


def decode_totals(text: str) -> dict[str, float] | None:
    """{store_to_host, handoff, host_bytes} of the decode side from a /metrics page (samples
    with role="decode" or no role); None when the page has none of the counters."""
    totals = {"store_to_host": 0.0, "handoff": 0.0, "host_bytes": 0.0}
    seen = False
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("role", "decode") != "decode":
                continue
            for key, name in COUNTERS.items():
                if s.name == name:
                    totals[key] += s.value
                    seen = True
            if s.name == HOST_USED:
                totals["host_bytes"] += s.value
    return totals if seen else None


def windows(samples: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(end time, bytes per second) of each window between consecutive (time, total bytes)
    samples."""
    return [(t1, (b1 - b0) / (t1 - t0)) for (t0, b0), (t1, b1) in pairwise(samples) if t1 > t0]


def window_stats(rates: list[float]) -> dict:
    """{"n", "mean", "p99", "max"} of the windows' bytes per second (numpy's percentile)."""
    if not rates:
        return {"n": 0, "mean": None, "p99": None, "max": None}
    a = np.asarray(rates, dtype=float)
    return {"n": len(rates), "mean": float(a.mean()), "p99": float(np.percentile(a, 99)),
            "max": float(a.max())}


class ByteSampler:
    """`with ByteSampler(url) as s:` samples url/metrics at 0 s, every interval_s after, and at
    the block's end (a last gap under half an interval joins the window before it);
    `s.result()` then."""

    def __init__(self, url: str, interval_s: float = 1.0) -> None:
        self.url, self.interval_s = url.rstrip("/"), interval_s
        self.samples: list[tuple[float, dict]] = []  # (seconds from the start, totals)
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=max(interval_s, 2.0))
        self._thread = threading.Thread(target=self._run, daemon=True, name="byte-sampler")
        self.available = True  # the server has the counters

    def _sample(self, first: bool = False) -> dict | None:
        try:
            r = self._client.get(self.url + "/metrics")
            r.raise_for_status()
            return decode_totals(r.text)
        except (httpx.HTTPError, ValueError) as e:
            # the first probe failing means a server without our counters (llama-server):
            # nothing went wrong, the bytes are just not measured
            log.log(logging.INFO if first else logging.WARNING, "sampling %s/metrics failed: %s",
                    self.url, e)
            return None

    def _take(self) -> None:
        totals = self._sample()
        if totals is not None:
            self.samples.append((time.perf_counter() - self.t0, totals))

    def _run(self) -> None:
        k = 1
        while not self._stop.wait(max(0.0, self.t0 + k * self.interval_s - time.perf_counter())):
            self._take()
            # a scrape that took longer than a tick skips the ticks it missed
            k = max(k + 1, int((time.perf_counter() - self.t0) / self.interval_s) + 1)

    def __enter__(self) -> ByteSampler:
        self.t0 = time.perf_counter()
        first = self._sample(first=True)
        if first is None:
            self.available = False
        else:
            self.samples.append((0.0, first))
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.available:
            self._thread.join()
            last = self._sample()
            if last is not None:
                t = time.perf_counter() - self.t0
                if len(self.samples) > 1 and t - self.samples[-1][0] < self.interval_s / 2:
                    self.samples.pop()
                self.samples.append((t, last))
        self._client.close()

    def result(self) -> dict | None:
        """The windows (`t_s`: each one's end, `bytes_per_s`), their statistics, and the
        totals over the trace; None when the server has no such counters."""
        if not self.available or not self.samples:
            return None
        w = windows([(t, d["store_to_host"] + d["handoff"]) for t, d in self.samples])
        first, last = self.samples[0][1], self.samples[-1][1]
        moved = {k: last[k] - first[k] for k in COUNTERS}
        return {"interval_s": self.interval_s, "t_s": [t for t, _ in w],
                "bytes_per_s": [r for _, r in w], **window_stats([r for _, r in w]),
                "total_bytes": sum(moved.values()), "handoff_bytes": moved["handoff"],
                "store_to_host_bytes": moved["store_to_host"],
                "decode_host_bytes_peak": max(d["host_bytes"] for _, d in self.samples)}
