"""Streaming: incremental detokenisation that emits only text that is final, and the SSE
framing of a stream (keep-alive comments, an error event, `[DONE]`)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from tokenizers.decoders import DecodeStream

from oasiskv.sampling_params import SamplingParams
from oasiskv.serve.errors import APIError

log = logging.getLogger(__name__)

KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see traffic
DONE = "data: [DONE]\n\n"


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string: text that
    may still turn into a stop string, and so must not be sent yet."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


class TextStream:
    """One choice's text as it streams. The tokenizers library's DecodeStream yields text only
    once its bytes are complete UTF-8; of that, a tail that could still grow into a stop string
    is held back. The engine's final text (stop string cut, or kept when asked) closes it."""

    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer  # the tokenizers.Tokenizer underneath
        self._decoder = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._stops = params.stop
        self.text = ""  # decoded so far
        self.sent = ""  # emitted so far: a prefix of text

    def push(self, token_ids: list[int]) -> str:
        """Decodes new tokens; returns the text that can be sent now (maybe empty)."""
        for t in token_ids:
            chunk = self._decoder.step(self._backend, t)
            if chunk:
                self.text += chunk
        end = max(len(self.text) - held_back(self.text, self._stops), len(self.sent))
        delta = self.text[len(self.sent):end]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text after what was sent."""
        if not final_text.startswith(self.sent):  # a decoder whose text is not prefix-stable
            log.warning("streamed text %r is not a prefix of the final text %r",
                        self.sent[-40:], final_text[-40:])
            return ""
        delta, self.sent = final_text[len(self.sent):], final_text
        return delta


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def sse_events(chunks: AsyncIterator[BaseModel | None]) -> AsyncIterator[str]:
    """SSE text of a chunk stream: `None` (a long wait) is a keep-alive comment; an APIError
    raised mid-stream becomes OpenAI's error object as an event; `[DONE]` always ends it."""
    try:
        async for chunk in chunks:
            yield KEEPALIVE if chunk is None else sse(chunk)
    except APIError as e:
        log.warning("stream ended with an error: %s", e.message)
        yield e.sse()
    yield DONE


class SSEResponse(StreamingResponse):
    """A text/event-stream response that calls `on_close` however it ends (sent, client gone,
    cancelled at shutdown): the request's engine work is aborted if it is still running."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
