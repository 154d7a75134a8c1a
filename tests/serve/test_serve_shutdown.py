"""Shutdown: `oasiskv serve` in its own process gets SIGTERM with streams in flight; it stops
accepting, lets them finish, exits 0. Past --shutdown-timeout the rest are aborted."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

import oasiskv
from oasiskv.serve.server import ServeOptions

pytest_plugins = ["live"]

ROOT = str(Path(oasiskv.__file__).resolve().parent.parent)


def stream_all(url: str, body: dict, started: threading.Event, out: dict) -> None:
    """Reads a whole SSE stream into out["events"] (or out["error"] if it breaks)."""
    events = []
    try:
        with httpx.Client(timeout=120) as h, h.stream("POST", url, json=body) as resp:
            for line in resp.iter_lines():
                if line:
                    events.append(line)
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = e
    finally:
        started.set()
        out["events"] = events


def wait_for_serving(log: Path, proc: subprocess.Popen) -> int:
    end = time.monotonic() + 180
    while time.monotonic() < end:
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if found:
            return int(found.group(1))
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    raise AssertionError(f"the server did not start:\n{log.read_text()}")


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except OSError:
        return True


def test_sigterm_lets_streams_in_flight_finish_then_exits_0(tiny_llama, tmp_path):
    log = tmp_path / "serve.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "oasiskv.cli", "serve", "--model", str(tiny_llama),
             "--port", "0", "--num-threads", "1", "--device-kv-budget", "1MiB"],
            stdout=subprocess.DEVNULL, stderr=err,
            env={**os.environ, "PYTHONPATH": ROOT})
    try:
        port = wait_for_serving(log, proc)
        url = f"http://127.0.0.1:{port}/v1/completions"
        body = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 400, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        runs = [(threading.Event(), {}) for _ in range(4)]
        threads = [threading.Thread(target=stream_all, args=(url, body, ev, out))
                   for ev, out in runs]
        for t in threads:
            t.start()
        for ev, _ in runs:
            ev.wait(60)
        proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 60
        while not refuses(port):  # stops accepting ...
            assert time.monotonic() < end
            time.sleep(0.05)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0  # ... and exits 0 once they are done
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Waiting for connections to close" in text, text  # they were in flight
    for _, out in runs:
        assert "error" not in out, out
        events = out["events"]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 400
        last = json.loads(events[-3].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"


def test_past_the_shutdown_deadline_the_rest_are_aborted(start_server):
    with start_server(ServeOptions(shutdown_timeout=0.5)) as live:
        live.slow_steps(0.05)  # 300 tokens: 15 s, far past the deadline
        body = {"model": live.state.model_name, "prompt": "hi", "max_tokens": 300,
                "stream": True, "ignore_eos": True}
        runs = [(threading.Event(), {}) for _ in range(2)]
        threads = [threading.Thread(target=stream_all,
                                    args=(live.url + "/v1/completions", body, ev, out))
                   for ev, out in runs]
        for t in threads:
            t.start()
        for ev, _ in runs:
            ev.wait(60)
        live.server.should_exit = True  # what uvicorn's SIGTERM handler sets
        for t in threads:
            t.join(60)
        end = time.monotonic() + 60
        while live.state.engine.healthy or live.llm.engine.requests:
            assert time.monotonic() < end
            time.sleep(0.05)
        engine = live.llm.engine
        assert engine.pool.num_used == 0 and not engine.has_unfinished()
        for _, out in runs:  # cut off: no [DONE]
            assert out["events"] and out["events"][-1] != "data: [DONE]"
        assert live.state.engine.metrics.registry.get_sample_value(
            "oasiskv:request_finished_total", {"finished_reason": "abort"}) == 2
