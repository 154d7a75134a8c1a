"""A local Mooncake master for tests and demos, and a private network namespace to run it in.

Mooncake (kvcache-ai/Mooncake) is the multi-machine backend of the remote KV tier. Its master
keeps object metadata and placement; the data lives in memory segments that clients mount. The
CPU wheel `mooncake-transfer-engine-non-cuda` ships the `mooncake.store` client and the
`mooncake_master` binary; `scripts/setup_mooncake.sh` installs both.

Why a network namespace: with P2PHANDSHAKE metadata every store client opens its handshake and
TCP data ports on all interfaces (MC_TCP_BIND_ADDRESS only changes the advertised address), so
tests and demos on a shared machine run master and clients inside a fresh namespace whose only
interface is loopback (`private_network()`), and fall back to a loopback-bound master where the
kernel refuses a new namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

INSTALL_HINT = "bash scripts/setup_mooncake.sh"
# The master's own eviction off: by default, past its high watermark it silently drops the
# oldest objects (live requests' blocks too, which then read as missing); without it a full
# store refuses a put (-200 NO_AVAILABLE_HANDLE), the engine evicts its prefix cache
# (kv/prefix_cache.py) and refuses the request if there is still no room.
NO_EVICTION = ("-eviction_ratio=0", "-eviction_high_watermark_ratio=1.0")
CLONE_NEWNET = 0x40000000


class MooncakeUnavailable(ImportError, ValueError):
    """The Mooncake wheel is not installed (or does not load). Also a ValueError: a
    `mooncake://` remote store is then a setting this machine cannot honour."""


def require_mooncake() -> ModuleType:
    """Returns the `mooncake.store` module, or raises an error that names the install script."""
    try:
        from mooncake import store
    except ImportError as e:  # the wheel, or a library it links (libibverbs), is missing
        raise MooncakeUnavailable(
            f"Mooncake is not installed ({e}); install it with: {INSTALL_HINT}") from e
    return store


def mooncake_available() -> bool:
    try:
        require_mooncake()
    except MooncakeUnavailable:
        return False
    return True


def master_binary() -> Path:
    """The `mooncake_master` executable shipped inside the wheel (the .venv/bin entry point
    only execs it, so we start it directly and its pid is the master's)."""
    require_mooncake()
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.is_file():
        raise MooncakeUnavailable(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on `host` (the master cannot pick its own and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return False
    return True


@dataclass
class MasterHandle:
    """A running `mooncake_master`; stop() (or the context manager) ends it."""

    process: subprocess.Popen
    host: str
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)
    owns_log: bool = False  # a temporary log that stop() deletes

    @property
    def address(self) -> str:
        """What MooncakeStore takes as `master_addr`."""
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, no cleanup: what a crashed master looks like to its clients."""
        if self.alive():
            self.process.kill()
        self.process.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()
        if self.owns_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> MasterHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_master(port: int | None = None, *, host: str = "127.0.0.1", client_ttl_s: int = 10,
                 lease_ttl_ms: int = 10_000, timeout_s: float = 20.0,
                 extra_args: Sequence[str] = (), log_path: str | Path | None = None
                 ) -> MasterHandle:
    """Starts `mooncake_master` on host:port and returns once it accepts connections.

    Self-contained: no HTTP metadata server (clients use P2PHANDSHAKE), no etcd/HA, metrics
    HTTP server bound to `host` on a free port, no eviction (`NO_EVICTION`). `client_ttl_s`
    is how long the master keeps a client that stopped heartbeating (its objects answer -800
    until then, -704 after);
    `lease_ttl_ms` is how long a read protects an object from a non-forced remove.
    """
    binary = master_binary()
    port = port or free_port(host)
    if port_open(host, port, 0.2):
        raise RuntimeError(f"cannot start a Mooncake master on {host}:{port}: the port is taken")
    owns_log = log_path is None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"mooncake_master_{port}_", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    args = [str(binary), f"-rpc_address={host}", f"-rpc_port={port}",
            f"-metrics_host={host}", f"-metrics_port={free_port(host)}",
            "-enable_metric_reporting=false", "-enable_http_metadata_server=false",
            f"-client_ttl={client_ttl_s}", f"-default_kv_lease_ttl={lease_ttl_ms}",
            *NO_EVICTION, "-logtostderr", *extra_args]
    env = dict(os.environ, MC_TCP_BIND_ADDRESS=host)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    handle = MasterHandle(proc, host, port, log_path, args, owns_log)
    deadline = time.monotonic() + timeout_s
    while not port_open(host, port, 0.2):
        if not handle.alive() or time.monotonic() > deadline:
            tail = handle.log_tail()
            handle.stop()
            raise RuntimeError(f"mooncake_master did not come up on {host}:{port} "
                               f"(exit code {proc.returncode}); its log:\n{tail}")
        time.sleep(0.05)
    return handle


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _loopback_up() -> None:
    """`ip link set lo up` without needing iproute2: SIOCGIFFLAGS / SIOCSIFFLAGS on `lo`."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


@contextlib.contextmanager
def private_network() -> Iterator[bool]:
    """Moves the calling thread into a fresh network namespace with only loopback (up), and
    back on exit. Yields True inside a private namespace, False when the kernel refused one
    (no CAP_SYS_ADMIN, or a seccomp/user-namespace sandbox): then nothing changed and the
    caller runs loopback-bound on the shared network.

    Only the calling thread moves, plus the threads and processes it starts from then on: start
    the master and create the stores from this thread, and close them before leaving, since
    sockets opened inside stay in the private namespace. (Python 3.11 has no os.unshare, hence
    ctypes; unshare(CLONE_NEWNET) is allowed in a multi-threaded process.)
    """
    libc = _libc()
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            yield False
            return
        try:
            _loopback_up()
            yield True
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"could not return to the original network namespace: "
                                   f"{os.strerror(err)}")
    finally:
        os.close(home)


@contextlib.contextmanager
def local_master() -> Iterator[MasterHandle]:
    """A master of our own with its ports hidden in a private network namespace (loopback-bound
    where the kernel refuses one). Create the stores, and start their processes, inside it."""
    with private_network():
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        with start_master() as master:
            yield master
