"""`oasiskv serve`: its flags, and the uvicorn server around the app.

Shutdown (SIGTERM or SIGINT): uvicorn stops accepting, lets the responses in flight finish for
up to --shutdown-timeout seconds, cancels the rest (their requests are aborted), then the
app's lifespan stops the engine loop; the process exits 0."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import socket
import sys
from dataclasses import dataclass

from oasiskv.config import parse_bytes

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


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The `serve` subcommand: every engine flag and the server's own."""
    from oasiskv.cli import add_engine_flags

    d = ServeOptions()
    sp = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine")
    sp.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
    sp.add_argument("--port", type=int, default=d.port, help="port (0: any free one)")
    sp.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' (all but /health and /metrics)")
    sp.add_argument("--served-model-name", default=None,
                    help="the model name clients send (default: the --model value)")
    sp.add_argument("--max-waiting", type=int, default=d.max_waiting,
                    help="requests waiting beyond the running batch before new ones get 503")
    sp.add_argument("--request-timeout", type=float, default=None,
                    help="seconds a request may take before it is aborted (default: no limit)")
    sp.add_argument("--max-body-bytes", default=d.max_body_bytes,
                    help="largest request body, e.g. 10MiB (413 above)")
    sp.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                    help="on SIGTERM: seconds requests in flight get to finish")
    sp.add_argument("--sse-keepalive", type=float, default=d.sse_keepalive,
                    help="seconds without output before a stream gets a keep-alive comment")
    add_engine_flags(sp)
    sp.set_defaults(func=run)
    return sp


def make_server(llm, options: ServeOptions, log_level: str = "info"):
    """(uvicorn.Server, ServerState) for an LLM; the server's lifespan runs the engine loop."""
    import uvicorn

    from oasiskv.serve.app import build_app
    from oasiskv.serve.async_engine import AsyncEngine
    from oasiskv.serve.metrics import ServerMetrics
    from oasiskv.serve.serving import ServerState

    engine = AsyncEngine(llm.engine, ServerMetrics(), options.max_waiting,
                         options.request_timeout)
    state = ServerState(llm, engine, options.served_model_name or llm.engine.config.model,
                        options.sse_keepalive)
    app = build_app(state, options.api_key, options.max_body_bytes)
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
    from oasiskv.cli import engine_kwargs

    options = ServeOptions(
        host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, max_waiting=args.max_waiting,
        request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout, sse_keepalive=args.sse_keepalive)
    sock = bind(options.host, options.port)  # before the model loads: a taken port fails fast
    with contextlib.closing(sock):
        llm = LLM(**engine_kwargs(args))
        try:
            server, state = make_server(llm, options)
            host, port = sock.getsockname()[:2]
            print(f"oasiskv serve: {state.model_name} on http://{host}:{port}/v1",
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
