"""Request and response bodies of the OpenAI API as vLLM serves it (completions, chat
completions, their stream chunks, usage, models, tokenize), as pydantic models.

A parameter the engine cannot honour is refused with a 400 naming it (`check_supported`), and
an unknown one too (extra="forbid"): nothing a client asks for is silently ignored."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from oasiskv.sampling_params import SamplingParams
from oasiskv.serve.errors import BadRequest

# parameter -> (is the value one the engine honours, why not otherwise)
_NOT_HONOURED = {
    "n": (lambda v: v in (None, 1), "the engine generates one sequence per prompt"),
    "best_of": (lambda v: v in (None, 1), "the engine generates one sequence per prompt"),
    "echo": (lambda v: not v, "the prompt is not echoed"),
    "suffix": (lambda v: not v, "there is no insertion mode"),
    "frequency_penalty": (lambda v: v in (None, 0), "the sampler has no penalties"),
    "presence_penalty": (lambda v: v in (None, 0), "the sampler has no penalties"),
    "repetition_penalty": (lambda v: v in (None, 1), "the sampler has no penalties"),
    "logit_bias": (lambda v: not v, "the sampler has no logit bias"),
    "top_logprobs": (lambda v: v in (None, 0),
                     "the engine keeps only the sampled token's log-probability"),
    "response_format": (lambda v: v is None or v.get("type") == "text",
                        "there is no guided decoding"),
    "tools": (lambda v: not v, "there is no tool calling"),
    "tool_choice": (lambda v: v in (None, "none"), "there is no tool calling"),
    "functions": (lambda v: not v, "there is no function calling"),
    "function_call": (lambda v: v in (None, "none"), "there is no function calling"),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def check_supported(self) -> None:
        """A 400 naming the first parameter set to something the engine cannot do."""
        for name, (honoured, why) in _NOT_HONOURED.items():
            value = getattr(self, name, None)
            if not honoured(value):
                raise BadRequest(f"{name}={value!r} is not supported: {why}", param=name)
        if getattr(self, "stream_options", None) is not None and not self.stream:
            raise BadRequest("stream_options is only for stream=true", param="stream_options")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(_Request):
    """The sampling fields both endpoints share (vLLM's extensions included)."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the client's end-user id: no effect on generation
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        """The engine's params; their own checks raise ValueError (a 400)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # OpenAI's default: 16
    # OpenAI's int: the top-N alternatives besides the sampled token; only 0 (the sampled
    # token's own log-probability) is what the engine keeps
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs not in (None, 0):
            raise BadRequest(f"logprobs={self.logprobs} is not supported: the engine keeps only "
                             f"the sampled token's log-probability (logprobs=0)", param="logprobs")

    @property
    def max_output_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise BadRequest("prompt is empty", param="prompt")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str | list[TextPart] | None = None

    def as_template_input(self, i: int) -> dict:
        """{"role", "content": str}; text parts are joined, others refused."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text" or p.text is None]
            if bad:
                raise BadRequest(f"messages[{i}].content has a {bad[0]!r} part: only text is "
                                 "supported", param=f"messages[{i}].content")
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content if content is not None else ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # OpenAI's older name of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


# ---- responses ----------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "abort"] | None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None = None  # alternatives are not kept
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it


class CompletionResponse(_Response):
    """Also each chunk of a stream (OpenAI streams the same object, text as deltas)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "oasiskv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or messages through the chat template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
