"""Disaggregated serving for tests: a Mooncake master and a storage node lending the store its
memory, prefill and decode workers as real `oasiskv serve --role` processes, and routers (in
this process, uvicorn in a thread, so a test can look at their worker pools; one test runs
the `oasiskv router` command itself)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import openai

from oasiskv.serve import pd_launch as launch
from oasiskv.serve.pd_launch import WorkerProc, wait_healthy  # noqa: F401 - for the tests
from oasiskv.serve.pool import WorkerPool
from oasiskv.serve.router import Router, build_router_app
from oasiskv.serve.server import bind
from oasiskv.store.mooncake import MasterHandle

TOKEN = "test-worker-token"
# the tiny model's sparse settings of tests/disagg (top_k=2: the store is read every step)
SPARSE = dict(kv_mode="sparse", top_k=2, f_hbm=0.5, max_num_seqs=3,
              max_num_batched_tokens=640, num_threads=1, device_kv_budget="1MiB")


def start_worker(role: str, model, master: MasterHandle, **engine) -> WorkerProc:
    return launch.start_worker(role, master, {"model": model, **SPARSE, **engine}, TOKEN)


@dataclass
class LiveRouter:
    url: str
    router: Router
    server: object
    thread: threading.Thread = field(repr=False)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)


@contextmanager
def live_router(prefill: list[str], decode: list[str], transfer: str | None = None,
                interval_s: float = 0.2, worker_timeout_s: float = 5.0) -> Iterator[LiveRouter]:
    import uvicorn

    router = Router(WorkerPool(prefill, decode, TOKEN, interval_s), worker_timeout_s, transfer)
    app = build_router_app(router)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.01)
        yield LiveRouter(f"http://127.0.0.1:{sock.getsockname()[1]}", router, server, thread)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def store_leftovers(master: MasterHandle, entries: list[int] | None = None) -> int:
    """Blocks the store holds under OasisKV's key prefix, prefix-cache entries apart (they
    outlive their requests: `entries` gets how many blocks of them there were). Counted by
    removing them all: call it once, when nothing but prefix-cache entries should be left."""
    import torch

    from oasiskv.store.mooncake_store import MooncakeStore

    with MooncakeStore((2, 1, 1, 1), torch.float32, master.address, segment_bytes=0,
                       max_batch_blocks=1) as store:
        cached = store._live().remove_by_regex("^oasiskv/pc:", True)
        if entries is not None:
            entries.append(cached)
        return store._live().remove_by_regex("^oasiskv/", True)


def counter(url: str, name: str) -> float:
    """A worker's /metrics sample `name` (summed over its labels; 0 when absent)."""
    text = httpx.get(url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)
