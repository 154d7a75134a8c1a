"""The FastAPI app: the OpenAI routes, /health, /metrics, /tokenize and /detokenize, and every
error as OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from oasiskv.serve import protocol as p
from oasiskv.serve.errors import APIError, BadRequest, EngineFailure
from oasiskv.serve.middleware import ApiKey, BodyLimit, RequestId
from oasiskv.serve.serving import ServerState, create_chat_completion, create_completion

log = logging.getLogger(__name__)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_error(exc: RequestValidationError) -> BadRequest:
    """pydantic's errors as one message; `param` is the first offending field."""
    parts, first = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = ".".join(loc) or "body"
        first = first or name
        if err.get("type") == "extra_forbidden":
            parts.append(f"unsupported parameter {name!r}")
        else:
            parts.append(f"{name}: {err.get('msg')}")
    return BadRequest("invalid request: " + "; ".join(parts), param=first)


def add_middleware(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(ApiKey, api_key=api_key)
    app.add_middleware(RequestId)  # outermost: every response carries the id


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error JSON."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        error = APIError(str(exc.detail))
        error.status, error.type = exc.status_code, "invalid_request_error"
        return _error_response(error)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return _error_response(EngineFailure(f"internal error: {type(exc).__name__}: {exc}"))


def build_app(state: ServerState, api_key: str | None = None,
              max_body_bytes: int = 10 * 2**20) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="oasiskv", lifespan=lifespan, docs_url=None, redoc_url=None)
    add_middleware(app, api_key, max_body_bytes)
    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        ok = state.engine.healthy
        return JSONResponse({"status": "ok" if ok else "engine loop stopped"},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.engine.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=state.model_name,
                                             max_model_len=state.llm.engine.max_model_len)])

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest, request: Request) -> Response:
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: p.ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, req, request)

    @app.post("/tokenize")
    async def tokenize(req: p.TokenizeRequest) -> p.TokenizeResponse:
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give either prompt or messages", param="prompt")
        try:
            if req.messages is not None:
                ids = state.llm.apply_chat_template(
                    [m.as_template_input(i) for i, m in enumerate(req.messages)])
            else:
                ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return p.TokenizeResponse(count=len(ids), max_model_len=state.llm.engine.max_model_len,
                                  tokens=ids)

    @app.post("/detokenize")
    async def detokenize(req: p.DetokenizeRequest) -> p.DetokenizeResponse:
        state.check_model(req.model)
        vocab = state.llm.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                             param="tokens")
        return p.DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))

    return app
