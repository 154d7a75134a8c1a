"""The router's view of its workers: their health and load reports (`GET /internal/load`,
polled every `interval_s`), and the choice of a worker for a request.

Prefill: the fewest queued prompt tokens (the worker's report plus what this router sent it
since, estimated for text prompts). Decode: the most free device KV budget, then the fewest
running and waiting requests (report plus dispatches since). A worker whose poll fails, or
whose connection breaks under a request, is down until a poll succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

log = logging.getLogger(__name__)


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"worker URL must be http://HOST:PORT, got {url!r}")
    return url.rstrip("/")


@dataclass
class Worker:
    url: str
    role: str  # "prefill" | "decode"
    healthy: bool = False
    load: dict = field(default_factory=dict)  # the last report
    since_report: int = 0  # prompt tokens (prefill) or requests (decode) sent since it
    inflight: int = 0  # this router's requests at the worker now
    why_down: str = "not polled yet"

    def prefill_score(self) -> tuple:
        return (self.load.get("queued_prompt_tokens", 0) + self.since_report, self.inflight)

    def decode_score(self) -> tuple:
        free = self.load.get("device_kv_budget", 0) - self.load.get("device_bytes_used", 0)
        busy = self.load.get("running", 0) + self.load.get("waiting", 0) + self.since_report
        return (-free, busy, self.inflight)

    def status(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "inflight": self.inflight, "load": self.load,
                **({} if self.healthy else {"why_down": self.why_down})}


class WorkerPool:
    def __init__(self, prefill: list[str], decode: list[str], token: str,
                 interval_s: float = 0.5, timeout_s: float = 5.0) -> None:
        self.workers: list[Worker] = []
        self.token, self.interval_s, self.timeout_s = token, interval_s, timeout_s
        for role, urls in (("prefill", prefill), ("decode", decode)):
            for url in urls:
                self.add(role, url)
        self.client: httpx.AsyncClient | None = None
        self._task: asyncio.Task | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def add(self, role: str, url: str) -> Worker:
        url = check_url(url)
        for w in self.workers:
            if w.url == url:
                if w.role != role:
                    raise ValueError(f"{url} is already a {w.role} worker")
                return w
        w = Worker(url, role)
        self.workers.append(w)
        return w

    def of(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    async def start(self) -> None:
        self.client = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers)
        await self.poll()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.client is not None:
            await self.client.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - the health loop outlives any one failure
                log.exception("polling workers failed")

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in list(self.workers)))

    async def _poll(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/internal/load")
            r.raise_for_status()
            load = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.mark_down(w, f"load report failed: {type(e).__name__}: {e}")
            return
        if load.get("role") != w.role:
            self.mark_down(w, f"it is a {load.get('role')} worker, not {w.role}")
            return
        if not load.get("healthy", False):
            self.mark_down(w, "its engine loop stopped")
            return
        if not w.healthy:
            log.info("%s worker %s is up", w.role, w.url)
        w.load, w.since_report, w.healthy = {**load, "at": time.time()}, 0, True

    def mark_down(self, w: Worker, why: str) -> None:
        if w.healthy:
            log.warning("%s worker %s is down: %s", w.role, w.url, why)
        w.healthy, w.why_down = False, why

    def pick(self, role: str, exclude: set[str] = frozenset()) -> Worker | None:
        live = [w for w in self.of(role) if w.healthy and w.url not in exclude]
        if not live:
            return None
        key = Worker.prefill_score if role == "prefill" else Worker.decode_score
        return min(live, key=key)

    def any_healthy(self) -> Worker | None:
        return next((w for w in self.workers if w.healthy), None)
