"""Disaggregated serving on one machine: `oasiskv pd --serve` starts a Mooncake master, a
storage node lending the store its memory, N prefill and M decode workers (`oasiskv serve
--role`, each its own process) and a router in front of them.

Master, storage node and workers live in a private network namespace (loopback only; on the
shared network, loopback-bound, where the kernel refuses one), so none of their ports is
visible outside. The router's listening socket is made before entering it, so clients reach the
router at --host:--port as usual, while its connections to the workers stay inside.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

from oasiskv.serve.server import TOKEN_ENV
from oasiskv.store.mooncake import MasterHandle, free_port, local_master
from oasiskv.store.store_node import StoreNode


def flags(kwargs: dict) -> list[str]:
    """Engine keyword arguments as the CLI's flags."""
    return [a for k, v in kwargs.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@dataclass
class WorkerProc:
    role: str
    url: str
    process: subprocess.Popen
    log: object  # a temporary file: its output

    def log_tail(self, n: int = 30) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def start_worker(role: str, master: MasterHandle, engine: dict, token: str) -> WorkerProc:
    """`oasiskv serve --role ROLE` on a free loopback port; its blocks go to storage nodes
    (--remote-lend 0), so that its death loses only what it had not handed over."""
    port = free_port()
    args = [sys.executable, "-m", "oasiskv.cli", "serve", "--role", role, "--port", str(port),
            "--remote-store", f"mooncake://{master.address}", "--remote-lend", "0",
            *flags(engine)]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=dict(os.environ, **{TOKEN_ENV: token}))
    return WorkerProc(role, f"http://127.0.0.1:{port}", proc, log)


def wait_healthy(workers: list[WorkerProc], timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    for w in workers:
        while True:
            if w.process.poll() is not None:
                raise RuntimeError(f"a {w.role} worker exited with code "
                                   f"{w.process.returncode}:\n{w.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(w.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"a {w.role} worker did not come up:\n{w.log_tail()}")
            time.sleep(0.2)


def serve_local(engine: dict, prefill: int, decode: int, store_bytes: int,
                host: str = "127.0.0.1", port: int = 8000, transfer: str | None = None,
                decode_engine: dict | None = None) -> int:
    """Runs until SIGINT/SIGTERM; returns 0."""
    import uvicorn

    from oasiskv.serve.pool import WorkerPool
    from oasiskv.serve.router import Router, build_router_app
    from oasiskv.serve.server import _after_shutdown, bind

    if prefill < 1 or decode < 1:
        raise ValueError(f"--prefill-workers and --decode-workers must be at least 1, got "
                         f"{prefill} and {decode}")
    token = secrets.token_hex(16)
    sock = bind(host, port)  # on this namespace's network: where clients reach the router
    workers: list[WorkerProc] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.closing(sock))
        master = stack.enter_context(local_master())
        stack.enter_context(StoreNode(master.address, store_bytes))
        stack.callback(lambda: [w.stop() for w in workers])
        workers += [start_worker("prefill", master, engine, token) for _ in range(prefill)]
        workers += [start_worker("decode", master, {**engine, **(decode_engine or {})}, token)
                    for _ in range(decode)]
        wait_healthy(workers)
        pool = WorkerPool([w.url for w in workers if w.role == "prefill"],
                          [w.url for w in workers if w.role == "decode"], token)
        app = build_router_app(Router(pool, transfer=transfer))
        h, p = sock.getsockname()[:2]
        print(f"oasiskv pd --serve: {prefill} prefill + {decode} decode workers, Mooncake master "
              f"{master.address} (private network); router on http://{h}:{p}/v1",
              file=sys.stderr, flush=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _after_shutdown)
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0
