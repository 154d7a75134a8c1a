"""An object that lives in a child process, so that a crash in the native library behind it
(a segfault in llama.cpp, say) kills only the child: the caller gets a `ChildCrashed` naming
the signal, and everything else goes on.

The protocol is small: the parent sends plain dicts ({"op": method name, "args": [...]}) over
a multiprocessing pipe and the child answers {"ok": result} or {"error": class name,
"message": text}. The child is spawned (not forked), so it starts from a clean interpreter
without the parent's threads or locks.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from typing import Any


class ChildCrashed(RuntimeError):
    """The child process died (a signal or an exit) before it answered."""


def _serve(conn, factory: Callable[..., Any], args: tuple) -> None:
    """The child's loop: build the object, then run each request on it until "close"."""
    obj = None
    try:
        obj = factory(*args)
        conn.send({"ok": None})
        while True:
            request = conn.recv()
            if request["op"] == "close":
                break
            try:
                conn.send({"ok": getattr(obj, request["op"])(*request.get("args", ()))})
            except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
                conn.send({"error": type(e).__name__, "message": str(e)})
    except Exception as e:  # noqa: BLE001 - the factory failed: same
        conn.send({"error": type(e).__name__, "message": str(e)})
    finally:
        if obj is not None and hasattr(obj, "close"):
            obj.close()
        conn.close()


def crash_message(name: str, exitcode: int | None) -> str:
    """"llama.cpp peer crashed: signal 11 (SIGSEGV)" from a child's exit code (negative: the
    signal that killed it)."""
    if exitcode is not None and exitcode < 0:
        try:
            sig = f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            sig = ""
        return f"{name} crashed: signal {-exitcode}{sig}"
    return f"{name} exited unexpectedly (exit status {exitcode})"


class Isolated:
    """`factory(*args)` built and used in a spawned child; `call(op, *args)` runs the
    method `op` there and returns its (picklable) result. An error raised in the child comes
    back as ValueError (for a ValueError) or RuntimeError; a dead child as ChildCrashed."""

    def __init__(self, name: str, factory: Callable[..., Any], *args: Any) -> None:
        self.name, self._ended = name, f"{name} is closed"
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_serve, args=(child, factory, args), daemon=True,
                                    name=name)
        self._process.start()
        child.close()  # only the child holds its end now: its death reads as EOF here
        try:
            self._reply()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def call(self, op: str, *args: Any) -> Any:
        if self._conn.closed:
            raise ChildCrashed(self._ended)
        try:
            self._conn.send({"op": op, "args": args})
        except OSError:  # a broken pipe: the child is already gone
            self._crashed()
        return self._reply()

    def _reply(self) -> Any:
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._crashed()
        if "error" in reply:
            if reply["error"] == "ValueError":  # bad input stays a ValueError
                raise ValueError(reply["message"])
            raise RuntimeError(f"{self.name}: {reply['error']}: {reply['message']}")
        return reply["ok"]

    def _crashed(self) -> None:
        self._process.join(timeout=10)
        self._conn.close()
        self._ended = crash_message(self.name, self._process.exitcode)
        raise ChildCrashed(self._ended)

    def close(self) -> None:
        """Ends the child (its object's close() runs there); nothing to do once it died."""
        if not self._conn.closed:
            try:
                self._conn.send({"op": "close"})
            except OSError:
                pass
            self._conn.close()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
