from __future__ import annotations  # annotations as text, which check_field_types reads

import numbers
from dataclasses import dataclass, field

from oasiskv.config_checks import FieldTypeError, check_field_types


@dataclass
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and defaults)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False  # report each output token's log-probability (of the raw logits)
    # Teacher forcing: emit these tokens first instead of sampling (with logprobs, this scores
    # a given continuation through the decode path; evaluation uses it for perplexity).
    forced_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_field_types(self)  # the scalars: ints, finite floats, bools
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = _token_list("stop_token_ids", self.stop_token_ids)
        self.forced_tokens = _token_list("forced_tokens", self.forced_tokens)
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if len(self.forced_tokens) > self.max_tokens:
            raise ValueError(f"{len(self.forced_tokens)} forced tokens exceed max_tokens "
                             f"{self.max_tokens}")
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        # Below 1e-5 logits/temperature overflows; such requests mean greedy (as in vLLM).
        return self.temperature < 1e-5


def _stop_list(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise FieldTypeError(f"stop must be a string or a list of strings, got {stop!r}")
    return list(stop)


def _token_list(name: str, ids: object) -> list[int]:
    """Token ids as a list; their range is the engine's check (it knows the vocabulary)."""
    if not isinstance(ids, list | tuple) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise FieldTypeError(f"{name} must be a list of integer token ids, got {ids!r}")
    return [int(t) for t in ids]
