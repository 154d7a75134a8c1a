"""`oasiskv router`: its flags, and the uvicorn server around the router's app."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys

from oasiskv.config import parse_bytes
from oasiskv.kv.handoff import TRANSFERS
from oasiskv.serve.server import TOKEN_ENV, _after_shutdown, bind


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


COMMANDS = {"router": ("the OpenAI-compatible front of disaggregated serving: routes each "
                       "request to a prefill worker and a decode worker (`serve --role`)")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`router`'s flags."""
    p.add_argument("--prefill", type=_urls, default=[],
                   help="prefill workers, comma-separated: http://HOST:PORT[,...]")
    p.add_argument("--decode", type=_urls, default=[],
                   help="decode workers, comma-separated: http://HOST:PORT[,...]")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' from clients")
    p.add_argument("--worker-token", default=None,
                   help=f"the token the workers were started with (default: ${TOKEN_ENV})")
    p.add_argument("--transfer", choices=TRANSFERS, default=None,
                   help="hand-over for every request (default: each prefill worker's own)")
    p.add_argument("--health-interval", type=float, default=0.5,
                   help="seconds between load reports polled from each worker")
    p.add_argument("--worker-timeout", type=float, default=10.0,
                   help="seconds of silence from a worker before its request fails (workers "
                   "send a keep-alive every second)")
    p.add_argument("--max-body-bytes", default="10MiB", help="largest request body (413 above)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds requests in flight get to finish")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from oasiskv.serve.pool import WorkerPool
    from oasiskv.serve.router import Router, build_router_app

    token = args.worker_token or os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"the router needs the workers' token: --worker-token or ${TOKEN_ENV}")
    for name in ("health_interval", "worker_timeout", "shutdown_timeout"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of "
                             f"seconds, got {value}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    pool = WorkerPool(args.prefill, args.decode, token, args.health_interval)
    router = Router(pool, args.worker_timeout, args.transfer)
    app = build_router_app(router, args.api_key, parse_bytes(args.max_body_bytes))
    sock = bind(args.host, args.port)
    with contextlib.closing(sock):
        host, port = sock.getsockname()[:2]
        print(f"oasiskv router: {len(pool.of('prefill'))} prefill, {len(pool.of('decode'))} "
              f"decode workers; on http://{host}:{port}/v1", file=sys.stderr, flush=True)
        config = uvicorn.Config(app, log_level="warning",
                                timeout_graceful_shutdown=args.shutdown_timeout)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _after_shutdown)
        uvicorn.Server(config).run(sockets=[sock])
    return 0
