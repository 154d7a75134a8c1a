"""`oasiskv router`: the OpenAI-compatible front of disaggregated serving.

A request goes to a prefill worker (`/internal/prefill`: it computes the prompts and publishes
their hand-overs to the store), then, with the hand-overs' descriptors (keys and sizes only),
to a decode worker (`/internal/decode`), whose answer (a JSON body or an SSE stream, made by the
same code as `oasiskv serve`'s) is relayed to the client as it comes.

Failures: a prefill worker that breaks before the hand-over (connection lost, no keep-alive
within --worker-timeout) is marked down, what it stored of the request is dropped, and the
request is retried on another prefill worker. A decode worker that breaks mid-stream ends the
client's stream with an error event (within --worker-timeout) and the request's blocks are
dropped from the store through a live worker. A client that leaves closes the connection to
the worker that holds its request, which aborts it there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from oasiskv.disagg import wire
from oasiskv.kv.remote_tier import namespace_for
from oasiskv.serve import protocol as p
from oasiskv.serve.app import _validation_error, add_error_handlers, add_middleware
from oasiskv.serve.errors import APIError, BadRequest, EngineFailure, QueueFull, Unauthorized
from oasiskv.serve.pool import Worker, WorkerPool
from oasiskv.serve.router_metrics import RouterMetrics
from oasiskv.serve.streaming import DONE

log = logging.getLogger(__name__)
GUARD_POLL_S = 0.25  # how often a waiting request checks its client and its worker


class Relayed(APIError):
    """A worker's error answer, passed on as it is (status and OpenAI error body)."""

    def __init__(self, status: int, body: dict) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        # a worker's 503 (queue or store full) may reach us as a stream's error event, which
        # has no headers: the client still gets its Retry-After
        super().__init__(error.get("message", str(body)) if isinstance(error, dict)
                         else str(body), headers={"Retry-After": "1"} if status == 503 else None)
        self.status, self._body = status, body

    def body(self) -> dict:
        return self._body


class AddWorker(BaseModel):
    """`POST /admin/workers`: a worker started after the router."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    url: str  # http://HOST:PORT


class ClientGone(Exception):
    pass


class WorkerLost(Exception):
    pass


def _relayed(status: int, raw: bytes) -> Relayed:
    try:
        return Relayed(status, json.loads(raw))
    except ValueError:
        return Relayed(status, EngineFailure(f"worker answered {status}: {raw[:200]!r}").body())


async def _events(resp: httpx.Response) -> AsyncIterator[str]:
    """Whole SSE events (comments included), each ending in a blank line."""
    lines: list[str] = []
    async for line in resp.aiter_lines():
        if line:
            lines.append(line)
        elif lines:
            yield "\n".join(lines) + "\n\n"
            lines = []


def _data(event: str) -> str | None:
    return event[len("data: "):].strip() if event.startswith("data: ") else None


class Router:
    def __init__(self, pool: WorkerPool, worker_timeout_s: float = 10.0,
                 transfer: str | None = None) -> None:
        self.pool, self.timeout_s, self.transfer = pool, worker_timeout_s, transfer
        self.metrics = RouterMetrics()
        self.requests, self.retries, self.dropped = (self.metrics.requests, self.metrics.retries,
                                                     self.metrics.dropped)
        self._tasks: set[asyncio.Task] = set()

    @property
    def client(self) -> httpx.AsyncClient:
        return self.pool.client

    # ---- store cleanup ----------------------------------------------------------------------

    def drop(self, names: list[str]) -> None:
        """Removes namespaces from the store through a live worker, in the background."""
        if names:
            task = asyncio.get_running_loop().create_task(self._drop(list(names)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _drop(self, names: list[str]) -> None:
        w = self.pool.any_healthy()
        if w is None:
            log.warning("no live worker to drop %d namespaces from the store", len(names))
            return
        try:
            r = await self.client.post(w.url + "/internal/drop", json={"namespaces": names})
            r.raise_for_status()
            self.dropped.inc(len(names))
        except httpx.HTTPError as e:
            log.warning("dropping %s through %s failed: %r", names, w.url, e)

    @staticmethod
    def handoff_names(items: list[dict]) -> list[str]:
        return [n for it in items if "handoff" in it for n in wire.namespaces(it["handoff"])]

    # ---- the two phases ---------------------------------------------------------------------

    async def guard(self, coro, request: Request, worker: Worker | None = None):  # noqa: ANN001, ANN201
        """Awaits `coro` unless the client leaves (ClientGone) or `worker` goes down."""
        task = asyncio.ensure_future(coro)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=GUARD_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone
                if worker is not None and not worker.healthy:
                    raise WorkerLost(worker.why_down)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def prefill(self, kind: str, body: dict, rid: str, num_prompts: int,
                      est_tokens: int) -> list[dict]:
        """The prompts' items (hand-over descriptors or finished outputs), in prompt order;
        retried on another prefill worker while none was delivered."""
        tried: set[str] = set()
        last: APIError | None = None
        while True:
            w = self.pool.pick("prefill", tried)
            if w is None:
                raise last or QueueFull("no prefill worker is up", headers={"Retry-After": "1"})
            tried.add(w.url)
            w.since_report += est_tokens
            w.inflight += 1
            items: list[dict] = []
            try:
                return await self._prefill_on(w, kind, body, rid, items)
            except Relayed as e:
                if e.status != 503:
                    raise
                last = e  # that worker's queue is full: another may have room
            except (httpx.HTTPError, ValueError) as e:
                self.pool.mark_down(w, f"prefill failed: {type(e).__name__}: {e}")
                tag = w.load.get("store_tag")
                mine = [namespace_for(tag, f"{rid}-{i}") for i in range(num_prompts)] \
                    if tag else []
                self.drop(self.handoff_names(items) + [
                    n for ns in mine for n in (ns, ns + ".slab", wire.meta_namespace(ns))])
                self.retries.inc()
            except BaseException:  # the client left, or a worker's error: nobody takes them
                self.drop(self.handoff_names(items))
                raise
            finally:
                w.inflight -= 1

    async def _prefill_on(self, w: Worker, kind: str, body: dict, rid: str,
                          items: list[dict]) -> list[dict]:
        payload = {"kind": kind, "request": body, "request_id": rid, "transfer": self.transfer}
        async with self.client.stream("POST", w.url + "/internal/prefill", json=payload,
                                      timeout=self.timeout_s) as r:
            if r.status_code != 200:
                raise _relayed(r.status_code, await r.aread())
            async for event in _events(r):
                data = _data(event)
                if data == "[DONE]":
                    return sorted(items, key=lambda it: it["index"])
                if data is None:
                    continue  # keep-alive
                obj = json.loads(data)
                if "error" in obj:
                    code = obj["error"].get("code")
                    raise Relayed(code if isinstance(code, int) else 500, obj)
                items.append(obj)
        raise httpx.RemoteProtocolError("the prefill stream ended before [DONE]")

    async def decode(self, kind: str, body: dict, items: list[dict], stream: bool,
                     request: Request) -> Response:
        tried: set[str] = set()
        while True:
            w = self.pool.pick("decode", tried)
            if w is None:
                self.drop(self.handoff_names(items))
                raise QueueFull("no decode worker is up", headers={"Retry-After": "1"})
            tried.add(w.url)
            w.since_report += 1
            payload = {"kind": kind, "request": body, "items": items}
            timeout = httpx.Timeout(self.timeout_s, read=self.timeout_s if stream else None)
            req = self.client.build_request("POST", w.url + "/internal/decode", json=payload,
                                            timeout=timeout)
            try:  # a JSON answer's headers come at its end: wait as long as all is well
                resp = await self.guard(self.client.send(req, stream=True), request, w)
            except ClientGone:  # the worker aborts (and drops) on the closed connection
                self.requests.labels("client_gone").inc()
                return Response(status_code=499)
            except httpx.ConnectError as e:  # it never got the request: another can take it
                self.pool.mark_down(w, f"connect failed: {e}")
                continue
            except (WorkerLost, httpx.HTTPError) as e:
                return self._lost(w, items, e)
            break
        w.inflight += 1
        if resp.status_code != 200:
            raw = await resp.aread()
            await resp.aclose()
            w.inflight -= 1
            raise _relayed(resp.status_code, raw)
        if stream:
            return StreamingResponse(self._relay(w, resp, items), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            raw = await resp.aread()
        except httpx.HTTPError as e:
            return self._lost(w, items, e)
        finally:
            await resp.aclose()
            w.inflight -= 1
        return Response(raw, media_type="application/json")

    def _lost(self, w: Worker, items: list[dict], e: BaseException) -> Response:
        self.pool.mark_down(w, f"decode failed: {type(e).__name__}: {e}")
        self.drop(self.handoff_names(items))
        raise EngineFailure(f"the decode worker {w.url} failed: {type(e).__name__}: {e}")

    async def _relay(self, w: Worker, resp: httpx.Response, items: list[dict]
                     ) -> AsyncIterator[str]:
        done = False
        try:
            async for event in _events(resp):
                yield event
                done = done or event == DONE
            if not done:
                raise httpx.RemoteProtocolError("the stream ended before [DONE]")
        except httpx.HTTPError as e:
            self.pool.mark_down(w, f"decode stream broke: {type(e).__name__}: {e}")
            self.drop(self.handoff_names(items))
            self.requests.labels("decode_lost").inc()
            yield EngineFailure(f"the decode worker {w.url} failed mid-stream: "
                                f"{type(e).__name__}: {e}").sse()
            yield DONE
        finally:
            await resp.aclose()
            w.inflight -= 1

    async def complete(self, kind: str, req: p.CompletionRequest | p.ChatCompletionRequest,
                       request: Request) -> Response:
        body = req.model_dump(exclude_unset=True)
        prompts = req.prompts() if kind == "completion" else [None]
        est = sum(len(x) if isinstance(x, list) else len(x or "") // 4 + 1 for x in prompts) \
            if kind == "completion" else sum(len(str(m.content)) // 4 + 1 for m in req.messages)
        try:
            items = await self.guard(
                self.prefill(kind, body, uuid.uuid4().hex, len(prompts), est), request)
        except ClientGone:
            self.requests.labels("client_gone").inc()
            return Response(status_code=499)
        response = await self.decode(kind, body, items, req.stream, request)
        self.requests.labels("routed").inc()
        return response


def build_router_app(router: Router, api_key: str | None = None,
                     max_body_bytes: int = 10 * 2**20) -> FastAPI:
    pool = router.pool

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        yield
        await pool.stop()

    app = FastAPI(title="oasiskv router", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_middleware(app, api_key, max_body_bytes)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        up = {role: sum(w.healthy for w in pool.of(role)) for role in ("prefill", "decode")}
        ok = all(up.values())
        return JSONResponse({"status": "ok" if ok else "no worker up for a role", "up": up},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.metrics.render(pool), media_type=CONTENT_TYPE_LATEST)

    @app.get("/workers")
    async def workers() -> dict:
        return {"workers": [w.status() for w in pool.workers]}

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> dict:
        token = request.headers.get("x-oasiskv-worker-token", "")
        if not secrets.compare_digest(token.encode(), pool.token.encode()):
            raise Unauthorized("adding a worker needs the header X-OasisKV-Worker-Token")
        try:  # read here, not by FastAPI: the token is checked before the body
            body = AddWorker.model_validate(await request.json())
        except ValidationError as e:
            raise _validation_error(e) from None
        except ValueError:
            raise BadRequest("the body must be JSON: {\"role\": ..., \"url\": ...}") from None
        try:
            w = pool.add(body.role, body.url)
        except ValueError as e:
            raise BadRequest(str(e), param="url") from None
        await pool.poll()  # up now if it answers; else the health loop keeps asking
        return w.status()

    async def forward(method: str, path: str, body: dict | None = None) -> Response:
        w = pool.pick("prefill") or pool.pick("decode")
        if w is None:
            raise QueueFull("no worker is up", headers={"Retry-After": "1"})
        r = await router.client.request(method, w.url + path, json=body)
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        return await forward("GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest) -> Response:
        return await forward("POST", "/tokenize", req.model_dump(exclude_unset=True))

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest) -> Response:
        return await forward("POST", "/detokenize", req.model_dump(exclude_unset=True))

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        return await router.complete("completion", req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: p.ChatCompletionRequest, request: Request) -> Response:
        return await router.complete("chat", req, request)

    return app
