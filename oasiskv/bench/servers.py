"""The servers `bench serve` starts itself, on loopback, one at a time: our `oasiskv serve` (dense,
or sparse with any CacheConfig options), prefill-decode disaggregation behind its router
(`oasiskv pd --serve`: a Mooncake master, a storage node, prefill and decode workers, the
router; `pd:transfer=...` and CacheConfig options) and llama.cpp's own C++ `llama-server` on
the same GGUF (parallel slots, continuous batching). Each runs as a child process with its
output in a log file; it is ready once GET /health answers 200, and stopped with SIGTERM
(SIGKILL after a deadline)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from oasiskv.bench.sparse_options import parse_sparse
from oasiskv.config import parse_bytes
from oasiskv.kv.handoff import TRANSFERS

KINDS = ("dense", "sparse", "pd", "llama-server")
OPTIONED = ("sparse", "pd")  # the kinds that take KEY=VAL options
# pd's own options (`oasiskv pd --serve` flags); its others are CacheConfig fields as sparse's
PD_OPTIONS = {"transfer": "partial, slab or full", "prefill_workers": "an integer >= 1",
              "decode_workers": "an integer >= 1", "store_bytes": "a size (4GiB)"}
LLAMA_SERVER_ENV = "OASISKV_LLAMA_SERVER"
LLAMA_SERVER_BUILD = ("llama-server is not built: scripts/setup_llama_server.sh builds it from "
                      "llama-cpp-python's source distribution (about 20 minutes on 2 cores) "
                      "into .venv/llama-server/bin/")


@dataclass(frozen=True)
class ServerSpec:
    """One entry of --servers: its kind and, for sparse and pd, KEY=VAL options as given
    (CacheConfig fields, checked by parse_sparse; pd's PD_OPTIONS too)."""

    kind: str
    options: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.options)
        return f"{self.kind}:{opts}" if opts else self.kind


def check_pd_option(key: str, value: str) -> None:
    try:
        ok = (value in TRANSFERS if key == "transfer" else int(value) >= 1
              if key.endswith("_workers") else parse_bytes(value) > 0)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"pd option {key}: expected {PD_OPTIONS[key]}, got {value!r}")


def parse_servers(text: str) -> list[ServerSpec]:
    """"dense,sparse:top_k=64,f_hbm=0.1,llama-server" -> three specs. Options are
    comma-separated too: an item with "=" and no kind continues the sparse or pd spec before
    it."""
    specs: list[tuple[str, list[str]]] = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        kind, sep, first = item.partition(":")
        if not sep and "=" in item:  # KEY=VAL after sparse:KEY=VAL
            if not specs or specs[-1][0] not in OPTIONED or not specs[-1][1]:
                raise ValueError(f"--servers {text!r}: {item!r} is an option without a "
                                 f"sparse:KEY=VAL or pd:KEY=VAL before it")
            specs[-1][1].append(item)
            continue
        if kind not in KINDS:
            raise ValueError(f"--servers {text!r}: unknown server {kind!r}; the kinds are "
                             f"{', '.join(KINDS)} (sparse:KEY=VAL,... for sparse options)")
        if sep and kind not in OPTIONED:
            raise ValueError(f"--servers {text!r}: {kind} takes no options")
        specs.append((kind, [first] if sep and first else []))
    if not specs:
        raise ValueError(f"--servers {text!r}: no server")
    out = []
    for kind, items in specs:
        pairs = tuple(tuple(x.strip() for x in i.split("=", 1)) for i in items if i != "default")
        if kind == "pd":
            for key, value in pairs:
                if key in PD_OPTIONS:
                    check_pd_option(key, value)
                if key in ("remote_store", "remote_lend"):
                    raise ValueError(f"--servers {text!r}: pd sets {key} itself (its Mooncake "
                                     "master and storage node)")
            # checked as the workers' CacheConfig: with a remote store (f_host < 1 needs one)
            items = [f"{k}={v}" for k, v in pairs if k not in PD_OPTIONS] + [
                "remote_store=inprocess"]
        try:
            parse_sparse(",".join(items) or "default")  # a bad key or value fails here
        except ValueError as e:
            raise ValueError(f"--servers {text!r}: {e}") from None
        out.append(ServerSpec(kind, pairs))
    labels = [s.label for s in out]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"--servers {text!r}: {twice[0]} twice")
    return out


def llama_server_binary(path: str | None = None) -> Path:
    """The llama-server to run: `path`, $OASISKV_LLAMA_SERVER, or the one
    scripts/setup_llama_server.sh built into this Python's venv."""
    chosen = path or os.environ.get(LLAMA_SERVER_ENV)
    binary = Path(chosen or Path(sys.prefix) / "llama-server" / "bin" / "llama-server")
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        how = "" if chosen else f"; {LLAMA_SERVER_BUILD}"
        raise ValueError(f"no llama-server at {binary}{how}")
    return binary


@dataclass
class ServerSettings:
    """What every started server shares: the model, the most requests it runs at once (our
    --max-num-seqs, llama-server's -np slots), the context each request needs, threads."""

    model: str
    max_num_seqs: int
    context: int  # tokens one request needs: prompt + output
    dtype: str = "bfloat16"
    device_kv_budget: str = "1GiB"
    device: str = "cpu"  # our servers' torch device
    threads: int | None = None
    max_waiting: int = 256
    llama_server: str | None = None  # its binary; default llama_server_binary()
    startup_timeout: float = 600.0
    extra: dict = field(default_factory=dict)  # more engine flags for our servers


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(spec: ServerSpec, settings: ServerSettings, port: int) -> list[str]:
    """The command line that starts `spec` on 127.0.0.1:port."""
    from oasiskv.models.registry import resolve_model

    if spec.kind == "llama-server":
        binary = llama_server_binary(settings.llama_server)
        gguf = resolve_model(settings.model)
        if gguf.suffix != ".gguf":
            raise ValueError(f"llama-server runs GGUF models; {settings.model} is {gguf}")
        per_slot = -(-(settings.context + 16) // 256) * 256
        cmd = [str(binary), "-m", str(gguf),
               "--host", "127.0.0.1", "--port", str(port), "-a", settings.model,
               "-np", str(settings.max_num_seqs), "-cb",
               "-c", str(per_slot * settings.max_num_seqs),  # split evenly among the slots
               "--cache-ram", "0",  # no prompt cache across requests (ours has none either)
               "--no-webui"]
        if settings.threads:
            cmd += ["-t", str(settings.threads), "-tb", str(settings.threads)]
        return cmd
    threads = settings.threads
    if spec.kind == "pd":  # the whole deployment in one command; each worker its share
        opts = dict(spec.options)
        workers = int(opts.get("prefill_workers", 1)) + int(opts.get("decode_workers", 1))
        threads = threads and max(1, threads // workers)
        cmd = [sys.executable, "-m", "oasiskv.cli", "pd", "--serve", "--kv-mode", "sparse"]
    else:
        cmd = [sys.executable, "-m", "oasiskv.cli", "serve", "--kv-mode", spec.kind,
               "--max-waiting", str(settings.max_waiting)]
    cmd += ["--model", settings.model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", settings.dtype, "--device-kv-budget", settings.device_kv_budget,
            "--max-num-seqs", str(settings.max_num_seqs), "--device", settings.device]
    if threads:
        cmd += ["--num-threads", str(threads)]
    for key, value in [*settings.extra.items(), *spec.options]:
        cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd


@dataclass
class RunningServer:
    label: str
    url: str
    process: subprocess.Popen | None  # None: a server this bench did not start
    log_path: Path | None = None

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None,
                 what: str = "the server") -> None:
    """Until GET /health answers 200; a ValueError when the process exits or time runs out."""
    end = time.monotonic() + timeout
    with httpx.Client(timeout=5) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{what} exited with status {process.returncode} before it "
                                   f"was ready")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > end:
                raise RuntimeError(f"{what} was not ready at {url}/health after {timeout:g} s")
            time.sleep(0.25)


def stop(process: subprocess.Popen, timeout: float = 60.0) -> int:
    """SIGTERM (a graceful stop for both servers), SIGKILL after `timeout` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextlib.contextmanager
def start_server(spec: ServerSpec, settings: ServerSettings,
                 log_dir: Path | None = None) -> Iterator[RunningServer]:
    """`spec` running on a free loopback port until the block ends; its output in
    log_dir/<label>.log (a temporary directory by default)."""
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="oasiskv-bs-")))
        port = free_port()
        cmd = server_command(spec, settings, port)
        log_path = Path(log_dir) / (spec.label.replace("/", "_").replace(":", "_") + ".log")
        log = stack.enter_context(open(log_path, "wb"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2])]
            + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        server = RunningServer(spec.label, f"http://127.0.0.1:{port}", process, log_path)
        try:
            try:
                wait_healthy(server.url, settings.startup_timeout, process, spec.label)
            except RuntimeError as e:
                raise RuntimeError(f"{e}; its log ({log_path}) ends:\n"
                                   f"{server.log_tail()}") from None
            yield server
        finally:
            stop(process)
