"""`bench serve`'s figures for one (server, rate) cell, defined as vLLM's serving benchmark
defines them: TTFT (send to first token), TPOT = (e2e - TTFT) / (output tokens - 1) per
request, ITL (every gap between consecutive token chunks, pooled over requests), e2e latency;
throughput over the cell's duration (first send to last response); goodput = requests per
second that meet every SLO given. Percentiles are numpy's (linear interpolation), shown with
their n: with 32 requests p99 is all but the maximum, so p50, p90 and max are reported."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from oasiskv.bench.serve_client import RequestResult

QUANTILES = (("p50", 50), ("p90", 90), ("max", 100))


def distribution(seconds: list[float]) -> dict:
    """{"n", "mean", "p50", "p90", "max"} in milliseconds (None when n = 0)."""
    out: dict = {"n": len(seconds)}
    if not seconds:
        return out | {"mean": None} | {k: None for k, _ in QUANTILES}
    ms = 1e3 * np.asarray(seconds, dtype=float)
    out["mean"] = float(ms.mean())
    out.update({k: float(np.percentile(ms, q)) for k, q in QUANTILES})
    return out


@dataclass(frozen=True)
class Slo:
    """Per-request limits in milliseconds; a request is good when it meets all that are set."""

    tpot_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("tpot_ms", "ttft_ms", "e2e_ms"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"--slo-{name[:-3]}-ms must be a positive number, got {v}")

    @property
    def set(self) -> bool:
        return any(v is not None for v in (self.tpot_ms, self.ttft_ms, self.e2e_ms))

    def good(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = [(self.ttft_ms, r.ttft_s), (self.e2e_ms, r.e2e_s),
                  # one output token has no TPOT: nothing to break
                  (self.tpot_ms, r.tpot_s if r.tpot_s is not None else 0.0)]
        return all(limit is None or 1e3 * value <= limit for limit, value in checks)

    def as_dict(self) -> dict:
        return {"tpot_ms": self.tpot_ms, "ttft_ms": self.ttft_ms, "e2e_ms": self.e2e_ms}


def cell_metrics(results: list[RequestResult], duration_s: float, slo: Slo) -> dict:
    """The figures of one cell from its requests."""
    ok = [r for r in results if r.ok]
    rejected = sum(r.rejected for r in results)
    output = sum(r.output_tokens or 0 for r in ok)
    out = {
        "requests": len(results), "completed": len(ok), "rejected": rejected,
        "failed": len(results) - len(ok) - rejected,
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": output / duration_s if duration_s > 0 else None,
        "output_tokens": output,
        "ttft_ms": distribution([r.ttft_s for r in ok]),
        "tpot_ms": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in ok]),
    }
    if slo.set:
        good = sum(slo.good(r) for r in results)
        out["good"] = good
        out["goodput"] = good / duration_s if duration_s > 0 else None
        if slo.tpot_ms is not None and out["tpot_ms"]["n"]:
            out["tpot_p90_meets_slo"] = out["tpot_ms"]["p90"] <= slo.tpot_ms
    return out
