from dataclasses import dataclass

from oasiskv.sequence import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]  # generated tokens only
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "error", "handoff"
    metrics: RequestMetrics
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: str | None = None
    retryable: bool = False  # the error is a want of room (a full store): retry later
    logprobs: list[float] | None = None  # per generated token, when the request asked
    handoff: object | None = None  # finish_reason "handoff": a kv.handoff.Handoff
