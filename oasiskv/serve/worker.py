"""A prefill or decode worker: `oasiskv serve --role prefill|decode`, the app of `oasiskv serve`
plus internal endpoints that only a router holding the workers' shared token may call (the
token is the app's API key: every path but /health and /metrics needs it).

- `POST /internal/prefill` {kind, request, request_id, transfer}: the OpenAI request (its
  checks and 400s exactly as `oasiskv serve`'s); each prompt is computed, its blocks put to the
  store, one decode step run, and its hand-over published to the store. The response is an SSE
  stream: a keep-alive comment while it works, then per prompt an item, {index, params,
  handoff: descriptor} or {index, params, output} for a request that ended here; then
  `[DONE]`. If the router leaves before `[DONE]`, the hand-overs it did not get are dropped.
- `POST /internal/decode` {kind, request, items}: continues the hand-overs and answers as
  `oasiskv serve` would (the same stream chunks, errors and usage).
- `POST /internal/drop` {namespaces}: removes them from the store (a router cleaning up after
  a worker that died).
- `GET /internal/load`: the load report a router picks workers by.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import Response

from oasiskv.disagg import wire
from oasiskv.engine.stats import device_memory
from oasiskv.kv.handoff import TRANSFERS
from oasiskv.sampling_params import SamplingParams
from oasiskv.serve import protocol as p
from oasiskv.serve.errors import APIError, BadRequest, EngineFailure, StoreFullError
from oasiskv.serve.server import ROLES
from oasiskv.serve.serving import (
    ServerState,
    chat_sequences,
    completion_sequences,
    respond,
    response_format,
)
from oasiskv.serve.streaming import DONE, KEEPALIVE, SSEResponse
from oasiskv.store.remote_store import RemoteStoreError, StoreFull

log = logging.getLogger(__name__)



class PrefillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["completion", "chat"]
    request: dict[str, Any]
    request_id: str | None = None  # the engine requests are `request_id-i`
    transfer: str | None = None  # default: the worker's --transfer


class DecodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["completion", "chat"]
    request: dict[str, Any]
    items: list[dict[str, Any]]


class DropBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    namespaces: list[str]


def parse_request(kind: str, body: dict) -> p.CompletionRequest | p.ChatCompletionRequest:
    """The OpenAI request as the public endpoint parses it (a 400 for the same faults)."""
    cls = p.ChatCompletionRequest if kind == "chat" else p.CompletionRequest
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        from oasiskv.serve.app import _validation_error

        raise _validation_error(e) from None


@dataclass
class _Done:
    """A choice that ended on the prefill worker: what `Choices` needs of a request."""

    request_id: str
    params: SamplingParams


def _event(item: dict) -> str:
    return f"data: {json.dumps(item)}\n\n"


def add_worker_routes(app: FastAPI, state: ServerState, role: str, transfer: str) -> None:
    engine = state.llm.engine
    remote = engine.remote
    if role not in ROLES:
        raise ValueError(f"--role must be one of {ROLES}, got {role!r}")
    if transfer not in TRANSFERS:
        raise ValueError(f"--transfer must be one of {TRANSFERS}, got {transfer!r}")
    if remote is None:
        raise ValueError(f"--role {role} needs --kv-mode sparse and a --remote-store shared "
                         "with the other workers (mooncake://MASTER:PORT)")
    store = remote.store

    @app.get("/internal/load")
    async def load() -> dict:
        mem = device_memory(engine)
        aeng = state.engine
        return {"role": role, "model": state.model_name, "healthy": aeng.healthy,
                "running": aeng.num_running, "waiting": aeng.num_waiting,
                "queued_prompt_tokens": aeng.queued_prompt_tokens,
                "device_kv_budget": mem["device_kv_budget"],
                "device_bytes_used": mem["device_bytes_used"], "store_tag": remote.tag,
                "transfer": transfer}

    @app.post("/internal/drop")
    async def drop(body: DropBody) -> dict:
        return {"removed": await asyncio.to_thread(wire.drop, store, body.namespaces)}

    if role == "prefill":
        @app.post("/internal/prefill")
        async def prefill(body: PrefillBody) -> Response:
            return _prefill(state, store, body, body.transfer or transfer)
    else:
        @app.post("/internal/decode")
        async def decode(body: DecodeBody, request: Request) -> Response:
            return await _decode(state, store, body, request)


def _prefill(state: ServerState, store, body: PrefillBody, transfer: str) -> Response:
    if transfer not in TRANSFERS:
        raise BadRequest(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
    req = parse_request(body.kind, body.request)
    make = chat_sequences if body.kind == "chat" else completion_sequences
    seqs = make(state, req, body.request_id)
    for seq in seqs:
        seq.transfer = transfer
    stream = state.engine.submit(seqs)
    index = {s.request_id: i for i, s in enumerate(seqs)}
    params = {s.request_id: dataclasses.asdict(s.params) for s in seqs}
    published: list[dict] = []
    delivered = False

    async def events() -> AsyncIterator[str]:
        nonlocal delivered
        try:
            async for out in stream.events(tick_s=state.sse_keepalive_s):
                if out is None:
                    yield KEEPALIVE
                    continue
                if not out.finished:
                    continue
                item = {"index": index[out.request_id], "params": params[out.request_id]}
                if out.finish_reason == "handoff":
                    try:
                        desc = await asyncio.to_thread(wire.publish, store, out.handoff)
                    except RemoteStoreError as e:
                        h = out.handoff
                        await asyncio.to_thread(wire.drop, store, [h.namespace] + (
                            [h.slab_namespace] if h.slab_namespace else []))
                        error = StoreFullError if isinstance(e, StoreFull) else EngineFailure
                        raise error(f"publishing the hand-over of request "
                                    f"{out.request_id} failed: {e}") from None
                    published.append(desc)
                    item["handoff"] = desc
                else:
                    item["output"] = wire.output_to_json(out)
                yield _event(item)
        except APIError as e:
            yield e.sse()
            return
        # before the last send: a router that breaks off now drops what it got itself, and
        # one that got it all may close before this generator would run again
        delivered = True
        yield DONE

    def on_close() -> None:
        stream.abort()
        if not delivered and published:  # nobody will take these hand-overs
            names = [n for d in published for n in wire.namespaces(d)]
            wire.drop(store, names)

    return SSEResponse(events(), on_close=on_close)


async def _decode(state: ServerState, store, body: DecodeBody, request: Request) -> Response:
    req = parse_request(body.kind, body.request)
    engine = state.llm.engine
    choices, handed, finished = [], [], []
    pending = [n for item in body.items if "handoff" in item
               for n in wire.namespaces(item["handoff"])]
    try:
        for item in body.items:
            params = SamplingParams(**item["params"])
            if "handoff" in item:
                h = await asyncio.to_thread(wire.fetch, store, item["handoff"])
                seq = engine.make_handoff_sequence(h, params)
                handed.append(seq)
                choices.append(seq)
            else:
                out = wire.output_from_json(item["output"])
                finished.append(out)
                choices.append(_Done(out.request_id, params))
        stream = state.engine.submit(handed)
    except (ValueError, TypeError, KeyError, RemoteStoreError, APIError) as e:
        await asyncio.to_thread(wire.drop, store, pending)  # no engine request holds them
        if isinstance(e, APIError):
            raise
        raise EngineFailure(f"taking the hand-over failed: {type(e).__name__}: {e}") from None
    for out in finished:  # answered beside the engine's: the queue takes them as outputs
        stream.unfinished.add(out.request_id)
        stream.queue.put_nowait(out)
    return await respond(state, request, stream, choices, req,
                         response_format(req, state.model_name))
