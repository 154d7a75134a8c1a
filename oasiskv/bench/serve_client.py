"""`bench serve`'s trace and client: requests with Poisson arrival times, replayed against an
OpenAI-compatible server's streaming /v1/completions, each token chunk's arrival time recorded.

The trace follows vLLM's serving benchmark: the first request at 0 s, then exponential gaps of
mean 1/rate (a Poisson process; rate inf: all at once), optionally at most --max-concurrency in
flight (later arrivals wait for a free slot, their clock already running). Prompts are token
ids, so every server gets exactly --input-len tokens; outputs are fixed with ignore_eos."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from tqdm.auto import tqdm


@dataclass
class TraceRequest:
    index: int
    prompt: list[int]
    arrival_s: float  # when it is sent, from the trace's start


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """[n] send times in seconds: 0, then exponential gaps of mean 1/rate (all 0 for inf)."""
    if not (rate > 0):
        raise ValueError(f"request rate must be positive or inf, got {rate}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(n - 1, 0))
    return np.concatenate([[0.0], np.cumsum(gaps)])[:n]


def make_trace(prompts: list[list[int]], rate: float, seed: int) -> list[TraceRequest]:
    times = poisson_arrivals(len(prompts), rate, seed)
    return [TraceRequest(i, p, float(t)) for i, (p, t) in enumerate(zip(prompts, times,
                                                                       strict=True))]


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from when it was sent (`sent_s`, on
    the trace's clock)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    sent_s: float = 0.0
    status: int | None = None  # HTTP status; None: no response (connection failed)
    error: str | None = None
    chunk_s: list[float] = field(default_factory=list)  # each chunk that carried text
    e2e_s: float | None = None  # the stream's end
    output_tokens: int | None = None  # the server's usage.completion_tokens
    usage_prompt_tokens: int | None = None

    @property
    def rejected(self) -> bool:
        """Turned away for saturation (a full waiting queue): counted apart from failures."""
        return self.status == 503

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.chunk_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive text chunks (one token each unless text was held back)."""
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:], strict=False)]

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1), vLLM's TPOT: the mean gap after the first."""
        if not self.ok or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(ok=self.ok, rejected=self.rejected, ttft_s=self.ttft_s, tpot_s=self.tpot_s)
        return d


def completion_body(model: str, prompt: list[int], output_len: int) -> dict:
    """Greedy, exactly output_len tokens (ignore_eos: vLLM's extension, llama-server's too)."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return body.decode(errors="replace")[:300]


async def send(client: httpx.AsyncClient, model: str, req: TraceRequest, output_len: int,
               t0: float) -> RequestResult:
    """One streamed completion; t0 is the trace's start on time.perf_counter's clock."""
    out = RequestResult(req.index, req.arrival_s, len(req.prompt))
    start = time.perf_counter()
    out.sent_s = start - t0
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=completion_body(model, req.prompt, output_len)) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {_error_text(await r.aread())}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (keep-alives)
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # an error after the stream started
                    out.error = f"stream error: {_error_text(data.encode())}"
                    break
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    out.chunk_s.append(time.perf_counter() - start)
                usage = chunk.get("usage")
                if usage:
                    out.output_tokens = usage.get("completion_tokens")
                    out.usage_prompt_tokens = usage.get("prompt_tokens")
        out.e2e_s = time.perf_counter() - start
        if out.error is None and not out.chunk_s:
            out.error = "the stream carried no text"
        elif out.error is None and out.output_tokens is None:
            out.output_tokens = len(out.chunk_s)  # no usage chunk: one token per chunk
    except (httpx.HTTPError, ValueError) as e:  # connection lost, bad JSON
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_trace(url: str, model: str, trace: list[TraceRequest], output_len: int,
                    max_concurrency: int | None = None, desc: str = "requests",
                    timeout: float = 3600.0) -> tuple[list[RequestResult], float]:
    """Every request of the trace at its arrival time; (results in trace order, seconds from
    the first send to the last response's end)."""
    limits = httpx.Limits(max_connections=len(trace) + 1, max_keepalive_connections=0)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(trace), desc=desc, unit="req", dynamic_ncols=True, leave=False)

    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(timeout, connect=30)) as client:
        t0 = time.perf_counter()

        async def one(req: TraceRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            if gate is None:
                result = await send(client, model, req, output_len, t0)
            else:
                async with gate:
                    result = await send(client, model, req, output_len, t0)
            bar.update()
            return result

        results = await asyncio.gather(*(one(r) for r in trace))
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration


def served_model(url: str, timeout: float = 30.0) -> str:
    """The model id the server at `url` answers to (the first of GET /v1/models)."""
    try:
        r = httpx.get(url + "/v1/models", timeout=timeout)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"{url}/v1/models did not name a model ({type(e).__name__}: {e})") \
            from None
