"""`oasiskv serve`: its flags, and the uvicorn server around the app.

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting, lets the responses in flight finish for
up to --shutdown-timeout seconds, cancels the rest (their requests are aborted), then the
app's lifespan stops the engine loop; the process exits 0."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import signal
import socket
import sys
from dataclasses import dataclass

from oasiskv.config import parse_bytes
from oasiskv.kv.handoff import TRANSFERS

ROLES = ("prefill", "decode")
TOKEN_ENV = "OASISKV_WORKER_TOKEN"
WORKER_KEEPALIVE = 1.0  # seconds: a router tells a live worker's silence from a dead one's

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model value
    max_waiting: int = 256  # requests queued beyond the running batch before a 503
    request_timeout: float | None = None  # seconds; None: no limit
    max_body_bytes: int | str = 10 * 2**20
    shutdown_timeout: float = 30.0
    sse_keepalive: float = 15.0  # seconds without output before a stream's keep-alive comment
    role: str | None = None  # "prefill" | "decode": a worker behind `oasiskv router`
    transfer: str = "partial"  # a prefill worker's hand-over (kv.handoff.TRANSFERS)

    def __post_init__(self) -> None:
        self.max_body_bytes = parse_bytes(self.max_body_bytes)
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_waiting < 1:
            raise ValueError(f"--max-waiting must be at least 1, got {self.max_waiting}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"--max-body-bytes must be positive, got {self.max_body_bytes}")
        for name in ("request_timeout", "shutdown_timeout", "sse_keepalive"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of "
                                 f"seconds, got {value}")
        if self.api_key == "":
            raise ValueError("--api-key is empty")
        if self.role is not None and not self.api_key:
            raise ValueError(f"--role {self.role} needs the token it shares with the router: "
                             f"--worker-token or ${TOKEN_ENV}")


COMMANDS = {"serve": "an OpenAI-compatible HTTP server over the engine"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's flags: every engine flag and the server's own."""
    from oasiskv.engine_args import add_engine_flags

    d = ServeOptions()
    p.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=d.port, help="port (0: any free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (all but /health and /metrics)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting,
                   help="requests waiting beyond the running batch before new ones get 503")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take before it is aborted (default: no limit)")
    p.add_argument("--max-body-bytes", default=d.max_body_bytes,
                   help="largest request body, e.g. 10MiB (413 above)")
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM: seconds requests in flight get to finish")
    p.add_argument("--sse-keepalive", type=float, default=None,
                   help="seconds without output before a stream gets a keep-alive comment "
                   f"(default: {d.sse_keepalive}; {WORKER_KEEPALIVE} for a --role worker)")
    p.add_argument("--role", choices=ROLES, default=None,
                   help="a worker behind `oasiskv router` (disaggregated serving): prefill "
                   "computes prompts and hands them over through --remote-store, decode "
                   "continues them")
    p.add_argument("--worker-token", default=None,
                   help=f"with --role: the token shared with the router (default: ${TOKEN_ENV})")
    p.add_argument("--transfer", choices=TRANSFERS, default=d.transfer,
                   help="with --role prefill: what a hand-over moves at admission (partial: "
                   "the first working sets' blocks; slab: their per-head slices; full: the "
                   "whole prompt)")
    add_engine_flags(p)


def make_server(llm, options: ServeOptions, log_level: str = "info"):
    """(uvicorn.Server, ServerState) for an LLM; the server's lifespan runs the engine loop."""
    import uvicorn

    from oasiskv.serve.app import build_app
    from oasiskv.serve.async_engine import AsyncEngine
    from oasiskv.serve.metrics import ServerMetrics
    from oasiskv.serve.serving import ServerState
    from oasiskv.serve.worker import add_worker_routes

    engine = AsyncEngine(llm.engine, ServerMetrics(), options.max_waiting,
                         options.request_timeout)
    state = ServerState(llm, engine, options.served_model_name or llm.engine.config.model,
                        options.sse_keepalive)
    app = build_app(state, options.api_key, options.max_body_bytes)
    if options.role is not None:
        add_worker_routes(app, state, options.role, options.transfer)
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=log_level,
                            timeout_graceful_shutdown=options.shutdown_timeout)
    return uvicorn.Server(config), state


def bind(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), reuse_port=False)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def run(args: argparse.Namespace) -> int:
    from oasiskv import LLM
    from oasiskv.engine_args import engine_kwargs

    role = args.role
    if role is None and args.worker_token:
        raise ValueError("--worker-token is for a --role worker")
    keepalive = args.sse_keepalive or (WORKER_KEEPALIVE if role else ServeOptions.sse_keepalive)
    options = ServeOptions(
        host=args.host, port=args.port,
        api_key=(args.worker_token or os.environ.get(TOKEN_ENV)) if role else args.api_key,
        served_model_name=args.served_model_name, max_waiting=args.max_waiting,
        request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout, sse_keepalive=keepalive, role=role,
        transfer=args.transfer)
    if role and args.api_key:
        raise ValueError("a --role worker takes --worker-token, not --api-key (clients talk "
                         "to the router, which has its own --api-key)")
    kwargs = engine_kwargs(args)
    if role:  # the hand-over is the sparse mode's; a decode worker lends the store nothing
        kwargs = {"kv_mode": "sparse", **({"remote_lend": 0} if role == "decode" else {}),
                  **kwargs}
    sock = bind(options.host, options.port)  # before the model loads: a taken port fails fast
    with contextlib.closing(sock):
        llm = LLM(**kwargs)
        try:
            server, state = make_server(llm, options)
            host, port = sock.getsockname()[:2]
            what = f"{role} worker" if role else "serve"
            print(f"oasiskv {what}: {state.model_name} on http://{host}:{port}/v1",
                  file=sys.stderr, flush=True)
            # uvicorn handles SIGTERM/SIGINT itself and, once shut down, raises the signal
            # again for the handler that was there before it: that one must not kill us.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, _after_shutdown)
            server.run(sockets=[sock])
        finally:
            llm.close()
    return 0


def _after_shutdown(signum: int, frame) -> None:
    log.info("shut down on signal %d", signum)
