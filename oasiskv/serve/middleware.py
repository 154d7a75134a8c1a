"""ASGI middleware, one concern each: X-Request-Id, the API key, the body size limit. Plain
ASGI (not Starlette's BaseHTTPMiddleware) so streamed responses and disconnects pass through
untouched; refusals are OpenAI error JSON like every other error."""

from __future__ import annotations

import hmac
import json
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oasiskv.serve.errors import APIError, BodyTooLarge, Unauthorized


async def send_error(send: Send, error: APIError, extra_headers: list | None = None) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status,
                "headers": headers + (extra_headers or [])})
    await send({"type": "http.response.body", "body": body})


class RequestId:
    """Echoes the client's X-Request-Id, or makes one, on every response; the app finds it in
    `request.state.request_id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1").strip()
        rid = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


class ApiKey:
    """With a key set, every path but the open ones needs `Authorization: Bearer KEY` (401)."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app, self.key = app, api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is not None and scope["type"] == "http" and scope["path"] not in self.OPEN:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = Unauthorized("missing or wrong API key: send the header "
                                     "'Authorization: Bearer KEY'", code="invalid_api_key")
                return await send_error(send, error, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a request body over `limit` bytes with a 413, whether it says its length or
    not. The body is read here (it is small: the limit caps it) and replayed to the app, whose
    later `receive` calls see the client's disconnect as usual."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = BodyTooLarge(f"the request body is over the server's limit of {self.limit} "
                                 f"bytes (--max-body-bytes)", code="request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await send_error(send, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await send_error(send, too_large)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
