"""The router's `/metrics`: its own counters, then every healthy worker's metrics, scraped when
the router is scraped.

A worker's samples keep their names and labels and gain `worker` (its URL) and `role`
(prefill|decode): one series per worker, never summed here, as an aggregating exporter does
(sum in the query: `sum by (role) (rate(oasiskv:generation_tokens_total[1m]))`). Summing
here would break histograms' buckets and hide which worker is slow. A worker that is down,
or whose /metrics fails or does not parse within SCRAPE_TIMEOUT_S, is left out of that scrape
(`oasiskv_router:worker_up` 0, `worker_scrapes_skipped_total` + 1): the router's page is
always whole.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from oasiskv.serve.pool import Worker, WorkerPool

log = logging.getLogger(__name__)
R = "oasiskv_router:"
SCRAPE_TIMEOUT_S = 2.0  # a slow worker costs the router's scrape at most this


class _Families:
    """A collector of ready metric families (what generate_latest needs of a registry)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(scraped: list[tuple[Worker, list[Metric]]]) -> list[Metric]:
    """The workers' families, one per name, each sample labelled with its worker and role.
    A family whose type differs from the first worker's (mixed versions) is left out."""
    out: dict[str, Metric] = {}
    for w, families in scraped:
        for fam in families:
            into = out.get(fam.name)
            if into is None:
                into = out[fam.name] = Metric(fam.name, fam.documentation, fam.type)
            elif into.type != fam.type:
                log.warning("%s: %s is a %s there, a %s elsewhere: left out", w.url, fam.name,
                            fam.type, into.type)
                continue
            for s in fam.samples:
                into.add_sample(s.name, {**s.labels, "worker": w.url, "role": w.role},
                                s.value, s.timestamp)
    return list(out.values())


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(R + "requests", "requests by outcome", ["outcome"], registry=r)
        self.retries = Counter(R + "prefill_retries", "requests retried on another prefill "
                               "worker", registry=r)
        self.dropped = Counter(R + "namespaces_dropped", "store namespaces of failed requests "
                               "the router dropped", registry=r)
        self.up = Gauge(R + "worker_up", "1 if the worker's metrics are in the router's last "
                        "scrape, 0 if it was down or its /metrics failed", ["worker", "role"],
                        registry=r)
        self.skipped = Counter(R + "worker_scrapes_skipped", "router scrapes that left a "
                               "worker's metrics out (down, or its /metrics failed)",
                               ["worker", "role"], registry=r)

    async def _scrape(self, client: httpx.AsyncClient, w: Worker) -> list[Metric] | None:
        if not w.healthy:
            return None
        try:
            r = await client.get(w.url + "/metrics", timeout=SCRAPE_TIMEOUT_S)
            r.raise_for_status()
            return list(text_string_to_metric_families(r.text))
        except Exception as e:  # noqa: BLE001 - one worker's page never fails the router's
            log.warning("scraping %s/metrics failed: %s: %s", w.url, type(e).__name__, e)
            return None

    async def render(self, pool: WorkerPool) -> bytes:
        """The router's page: its own metrics, then the workers' (Prometheus text format)."""
        workers = list(pool.workers)
        pages = await asyncio.gather(*(self._scrape(pool.client, w) for w in workers))
        scraped = []
        for w, families in zip(workers, pages, strict=True):
            self.up.labels(w.url, w.role).set(families is not None)
            if families is None:
                self.skipped.labels(w.url, w.role).inc()
            else:
                scraped.append((w, families))
        return generate_latest(self.registry) + generate_latest(_Families(merge(scraped)))
