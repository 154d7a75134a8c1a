"""A live server on a free loopback port, in this process (uvicorn in a thread) over a tiny
model, the official `openai` client pointed at it, and the offline API as the reference.
(Fixtures live here, imported by the test files: a second conftest.py would shadow the root
one's `import conftest` in other test directories.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from oasiskv import LLM
from oasiskv.serve.server import ServeOptions, bind, make_server
from oasiskv.serve.serving import ServerState

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ENGINE = dict(num_threads=1, device_kv_budget="1MiB", max_num_seqs=8)  # 2048 tokens of KV


@dataclass
class Live:
    url: str
    state: ServerState
    llm: LLM
    server: object  # the uvicorn.Server: `should_exit = True` is what SIGTERM's handler sets

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 30, **kwargs})

    def metrics(self) -> dict[str, float]:
        """/metrics parsed by prometheus-client's own parser: sample name{labels} -> value."""
        text = self.http().get("/metrics").text
        return {s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def wait_for(self, condition, timeout: float = 30.0) -> dict[str, float]:
        """/metrics once `condition(metrics)` holds (polled: the loop acts between steps)."""
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting; /metrics: {m}")
            time.sleep(0.02)

    def wait_idle(self) -> dict[str, float]:
        """/metrics once no request runs or waits."""
        m = self.wait_for(lambda m: m["oasiskv:num_requests_running"] == 0
                          and m["oasiskv:num_requests_waiting"] == 0)
        assert not self.llm.engine.requests
        return m

    def slow_steps(self, seconds: float) -> None:
        """Every engine step takes at least this long (a hook the loop thread calls)."""
        self.llm.engine.step_hooks.append(lambda batch: time.sleep(seconds))


@contextmanager
def live_server(model, options: ServeOptions | None = None, **engine_kwargs) -> Iterator[Live]:
    llm = LLM(str(model), **{**ENGINE, **engine_kwargs})
    llm.tokenizer.chat_template = CHATML
    server, state = make_server(llm, options or ServeOptions(), log_level="warning")
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield Live(f"http://127.0.0.1:{sock.getsockname()[1]}", state, llm, server)
    finally:
        server.should_exit = True
        thread.join(60)
        llm.close()


@pytest.fixture
def start_server(tiny_llama):
    """`with start_server(ServeOptions(...), **engine_kwargs) as live:` a server of its own."""
    return lambda options=None, **kw: live_server(tiny_llama, options, **kw)


@pytest.fixture(scope="module")
def live(tiny_llama) -> Iterator[Live]:
    with live_server(tiny_llama) as handle:
        yield handle


@pytest.fixture(scope="module")
def ref(tiny_llama) -> Iterator[LLM]:
    """The offline API on the same engine config: what every answer is checked against."""
    llm = LLM(str(tiny_llama), **ENGINE)
    llm.tokenizer.chat_template = CHATML
    yield llm
    llm.close()
