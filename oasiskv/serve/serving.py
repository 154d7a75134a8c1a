"""/v1/completions and /v1/chat/completions: a request's prompts become engine requests, their
outputs become one response or a stream of chunks. The two endpoints differ only in their
prompt (text or ids vs messages through the chat template) and their chunk shapes."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from oasiskv.outputs import RequestOutput
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence
from oasiskv.serve import protocol as p
from oasiskv.serve.async_engine import AsyncEngine, RequestStream
from oasiskv.serve.errors import BadRequest, ModelNotFound
from oasiskv.serve.streaming import SSEResponse, TextStream, sse_events

DISCONNECT_POLL_S = 0.5  # a non-streamed request checks this often that its client is there


@dataclass
class ServerState:
    llm: object  # oasiskv.LLM: the engine, its tokenizer and chat template
    engine: AsyncEngine
    model_name: str
    sse_keepalive_s: float = 15.0

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"The model `{name}` does not exist: this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")


@dataclass
class Piece:
    """What one choice adds in one chunk: text, the tokens since its last chunk, the end."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Choices:
    """A request's choices (one per prompt) as their outputs arrive."""

    def __init__(self, tokenizer, seqs: list[Sequence], eos_token_ids: set[int]) -> None:
        self.tokenizer, self.seqs, self.eos = tokenizer, seqs, eos_token_ids
        self.index = {s.request_id: i for i, s in enumerate(seqs)}
        self.texts = [TextStream(tokenizer, s.params) for s in seqs]
        self.fed = [0] * len(seqs)  # tokens decoded into texts[i]
        self.reported = [0] * len(seqs)  # tokens whose log-probabilities went out
        self.offsets = [0] * len(seqs)  # completions' text_offset of the next token
        self.final: list[RequestOutput | None] = [None] * len(seqs)

    def update(self, out: RequestOutput) -> Piece | None:
        """The piece to stream for this output, or None while all its text is held back."""
        i = self.index[out.request_id]
        if out.finished:
            self.final[i] = out
            text = self.texts[i].finish(out.text)
        else:
            text = self.texts[i].push(out.token_ids[self.fed[i]:])
            self.fed[i] = len(out.token_ids)
            if not text:
                return None
        lo, hi = self.reported[i], len(out.token_ids)
        self.reported[i] = hi
        return Piece(i, text, out.token_ids[lo:hi],
                     None if out.logprobs is None else out.logprobs[lo:hi],
                     out.finish_reason if out.finished else None,
                     self.stop_reason(i, out) if out.finished else None)

    def whole(self, i: int) -> Piece:
        out = self.final[i]
        return Piece(i, out.text, out.token_ids, out.logprobs, out.finish_reason,
                     self.stop_reason(i, out))

    def stop_reason(self, i: int, out: RequestOutput) -> int | str | None:
        """vLLM's: the stop string or stop token id; None for EOS (as for any other end)."""
        r = out.stop_reason
        if isinstance(r, int) and r in self.eos and r not in self.seqs[i].params.stop_token_ids:
            return None
        return r

    def usage(self) -> p.Usage:
        prompt = sum(len(o.prompt_token_ids) for o in self.final if o is not None)
        completion = sum(len(o.token_ids) for o in self.final if o is not None)
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion,
                       total_tokens=prompt + completion)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    def completion_logprobs(self, piece: Piece) -> p.CompletionLogprobs | None:
        if piece.logprobs is None:
            return None
        tokens = self.token_texts(piece.token_ids)
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[piece.index])
            self.offsets[piece.index] += len(t)
        return p.CompletionLogprobs(tokens=tokens, token_logprobs=piece.logprobs,
                                    text_offset=offsets)

    def chat_logprobs(self, piece: Piece) -> p.ChatChoiceLogprobs | None:
        if piece.logprobs is None:
            return None
        return p.ChatChoiceLogprobs(content=[
            p.ChatLogprob(token=t, logprob=lp, bytes=list(t.encode()))
            for t, lp in zip(self.token_texts(piece.token_ids), piece.logprobs, strict=True)])


class CompletionFormat:
    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = f"cmpl-{rid}", model

    def choice(self, choices: Choices, piece: Piece) -> p.CompletionChoice:
        return p.CompletionChoice(index=piece.index, text=piece.text,
                                  logprobs=choices.completion_logprobs(piece),
                                  finish_reason=piece.finish_reason,
                                  stop_reason=piece.stop_reason)

    def response(self, choices: Choices) -> BaseModel:
        return p.CompletionResponse(id=self.rid, model=self.model, usage=choices.usage(),
                                    choices=[self.choice(choices, choices.whole(i))
                                             for i in range(len(choices.final))])

    def first_chunks(self, n: int) -> list[BaseModel]:
        return []

    def chunk(self, choices: Choices, piece: Piece) -> BaseModel:
        return p.CompletionResponse(id=self.rid, model=self.model,
                                    choices=[self.choice(choices, piece)])

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.CompletionResponse(id=self.rid, model=self.model, choices=[], usage=usage)


class ChatFormat(CompletionFormat):
    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = f"chatcmpl-{rid}", model

    def response(self, choices: Choices) -> BaseModel:
        return p.ChatCompletionResponse(id=self.rid, model=self.model, usage=choices.usage(),
                                        choices=[self._choice(choices, choices.whole(i))
                                                 for i in range(len(choices.final))])

    def _choice(self, choices: Choices, piece: Piece) -> p.ChatChoice:
        return p.ChatChoice(index=piece.index, message=p.AssistantMessage(content=piece.text),
                            logprobs=choices.chat_logprobs(piece),
                            finish_reason=piece.finish_reason, stop_reason=piece.stop_reason)

    def first_chunks(self, n: int) -> list[BaseModel]:
        return [p.ChatCompletionChunk(id=self.rid, model=self.model, choices=[
            p.ChatStreamChoice(index=i, delta=p.Delta(role="assistant", content=""))
            for i in range(n)])]

    def chunk(self, choices: Choices, piece: Piece) -> BaseModel:
        return p.ChatCompletionChunk(id=self.rid, model=self.model, choices=[
            p.ChatStreamChoice(index=piece.index, delta=p.Delta(content=piece.text),
                               logprobs=choices.chat_logprobs(piece),
                               finish_reason=piece.finish_reason,
                               stop_reason=piece.stop_reason)])

    def usage_chunk(self, usage: p.Usage) -> BaseModel:
        return p.ChatCompletionChunk(id=self.rid, model=self.model, choices=[], usage=usage)


def _params(req: p.SamplingRequest, max_tokens: int, logprobs: bool) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def _sequences(state: ServerState, prompts: list, params: list[SamplingParams],
               base: str | None = None) -> list[Sequence]:
    """Engine requests, validated by the engine (its ValueError is the 400's message); their
    ids are `base-i` (a router names them, to find their store namespaces)."""
    base, seqs = base or uuid.uuid4().hex, []
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        try:
            seqs.append(state.llm.engine.make_sequence(prompt, sp, request_id=f"{base}-{i}"))
        except ValueError as e:
            where = f"prompt {i}: " if len(prompts) > 1 else ""
            raise BadRequest(f"{where}{e}", param="prompt") from None
    return seqs


def completion_sequences(state: ServerState, req: p.CompletionRequest,
                         base: str | None = None) -> list[Sequence]:
    state.check_model(req.model)
    req.check_supported()
    prompts = req.prompts()
    params = _params(req, req.max_output_tokens, logprobs=req.logprobs is not None)
    return _sequences(state, prompts, [params] * len(prompts), base)


def chat_sequences(state: ServerState, req: p.ChatCompletionRequest,
                   base: str | None = None) -> list[Sequence]:
    state.check_model(req.model)
    req.check_supported()
    messages = [m.as_template_input(i) for i, m in enumerate(req.messages)]
    try:
        ids = state.llm.apply_chat_template(messages)
    except ValueError as e:
        raise BadRequest(str(e), param="messages") from None
    max_tokens = req.max_output_tokens  # default: the rest of the context, as vLLM's
    if max_tokens is None:
        max_tokens = max(1, state.llm.engine.max_model_len - len(ids))
    return _sequences(state, [ids], [_params(req, max_tokens, logprobs=req.logprobs)], base)


def response_format(req: p.SamplingRequest, model_name: str) -> CompletionFormat:
    cls = ChatFormat if isinstance(req, p.ChatCompletionRequest) else CompletionFormat
    return cls(uuid.uuid4().hex, model_name)


async def create_completion(state: ServerState, req: p.CompletionRequest,
                            request: Request) -> Response:
    seqs = completion_sequences(state, req)
    return await _respond(state, request, seqs, req, response_format(req, state.model_name))


async def create_chat_completion(state: ServerState, req: p.ChatCompletionRequest,
                                 request: Request) -> Response:
    seqs = chat_sequences(state, req)
    return await _respond(state, request, seqs, req, response_format(req, state.model_name))


async def _respond(state: ServerState, request: Request, seqs: list[Sequence],
                   req: p.SamplingRequest, fmt: CompletionFormat) -> Response:
    return await respond(state, request, state.engine.submit(seqs), seqs, req, fmt)


async def respond(state: ServerState, request: Request, stream: RequestStream, seqs: list,
                  req: p.SamplingRequest, fmt: CompletionFormat) -> Response:
    """The response to a request whose engine requests `stream` follows; `seqs` (anything
    with `request_id` and `params`) are its choices in order."""
    choices = Choices(state.tokenizer, seqs, state.llm.engine.eos_token_ids)
    if not req.stream:
        check_at = time.monotonic() + DISCONNECT_POLL_S
        try:
            async for out in stream.events(tick_s=DISCONNECT_POLL_S):
                if out is not None:
                    choices.update(out)
                if time.monotonic() >= check_at:  # outputs or not: a busy request too
                    if await request.is_disconnected():
                        return Response(status_code=499)  # nobody reads it; `finally` aborts
                    check_at = time.monotonic() + DISCONNECT_POLL_S
        finally:
            stream.abort()
        return JSONResponse(fmt.response(choices).model_dump())
    # Wait for the first output (or a keep-alive's worth) before the response starts, so a
    # request that fails before then gets a plain HTTP error.
    events = stream.events(tick_s=state.sse_keepalive_s)
    try:
        first = await anext(events)
    except BaseException:
        stream.abort()
        raise

    async def chunks() -> AsyncIterator[BaseModel | None]:
        for c in fmt.first_chunks(len(seqs)):
            yield c
        out: RequestOutput | None = first
        while True:
            piece = None if out is None else choices.update(out)
            if out is None or piece is not None:
                yield None if out is None else fmt.chunk(choices, piece)
            try:
                out = await anext(events)
            except StopAsyncIteration:
                break
        if req.include_usage:
            yield fmt.usage_chunk(choices.usage())

    return SSEResponse(sse_events(chunks()), on_close=stream.abort)
