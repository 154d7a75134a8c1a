"""A request as the engine tracks it: tokens, KV progress, block table, timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

import torch

from oasiskv.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0  # steps whose draft row guessed this request's next token
    num_drafts_right: int = 0  # ... and guessed it right

    @property
    def draft_accuracy(self) -> float | None:
        """Share of the drafts that were the next token (None without drafts)."""
        return self.num_drafts_right / self.num_drafts if self.num_drafts else None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.finish_time is None or self.first_token_time is None:
            return None
        if self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.num_prompt_tokens,
                "generated_tokens": self.num_generated_tokens,
                "ttft_s": self.ttft, "tpot_s": self.tpot,
                "e2e_s": None if self.finish_time is None
                else self.finish_time - self.arrival_time,
                "preemptions": self.num_preemptions, "drafts": self.num_drafts,
                "draft_accuracy": self.draft_accuracy}


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    params: SamplingParams
    prompt: str | None = None
    max_context: int = 0  # prompt + max_tokens, capped by the model's context
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)  # device blocks (sparse: the slab)
    # sparse: host blocks of the history, logical block b in host_table[b]; with a remote
    # store, once the prompt is handed over, the blocks the host cache owns (host_cache maps)
    host_table: list[int] = field(default_factory=list)
    # sparse with a remote store: summary id of each logical block (without one: host_table)
    summary_table: list[int] = field(default_factory=list)
    host_cache: object | None = None  # kv.host_cache.HostCache once the prompt is in the store
    # prefill worker: "partial"/"full", hand the request over after one decode step
    transfer: str | None = None
    # decode worker: the kv.handoff.Handoff it came with (installed at admission);
    # prefill worker: the one it left with
    handoff: object | None = None
    host_budget: int | None = None  # a handed-over request: host blocks its cache will own
    working_set: object | None = None  # sparse: kv.working_set.WorkingSet once decoding
    draft_tokens: list[int] = field(default_factory=list)  # guesses of the next token
    # how likely each is to be taken next, up to a factor (`spec.drafters.sampling_weights`;
    # None: equal): the lookahead's query is the drafts' mean with these weights
    draft_weights: list[float] | None = None
    # K/V of the first n prompt tokens computed elsewhere, [L, K/V, Hkv, n, d]: the runner
    # writes it into the cache the first time the request runs, instead of computing it.
    prefix_kv: torch.Tensor | None = None
    logprobs: list[float] = field(default_factory=list)  # per output token, if asked
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    error: str | None = None
    retryable: bool = False  # its error is a want of room (a full store), not its own fault
    stop_reason: str | int | None = None
    output_text: str = ""
    suspect: bool = False  # a batch it was in failed; it runs alone until it succeeds
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    @property
    def summary_ids(self) -> list[int]:
        """sparse: where each logical block's summary lives (kmin/kmax rows)."""
        return self.summary_table or self.host_table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """More than one token still lacks KV: the prompt, or recompute after preemption."""
        return self.num_tokens - self.num_computed_tokens > 1
