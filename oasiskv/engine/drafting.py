"""Drafting and speculative acceptance in the step loop.

A drafter (`spec/drafters.py`) guesses each request's next token; the guesses ride along in
the next step as draft rows, whose queries the lookahead predictor reads (sparse mode) and,
with speculative="accept", whose logits give one more token when the first draft is the
token the request takes (`verify_draft` keeps the sampled distribution). This module makes
the engine's drafter, feeds it the target's features, verifies and accepts drafts, counts
them and asks for the next ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.engine.failures import StepFailures
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.kv.predictors import PREDICTORS
from oasiskv.layers.sampler import verify_draft
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.sequence import Sequence
from oasiskv.spec.drafters import Drafter, chained_draft, make_drafter, sampling_weights

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def build_drafter(config: EngineConfig, mc: ModelConfig, model: LlamaForCausalLM,
                  make_engine: Callable[..., Any]) -> Drafter | None:
    """The drafter the lookahead predictor or speculative acceptance needs (None: neither);
    a draft model runs in an engine of `make_engine`."""
    lookahead = (config.cache.kv_mode == "sparse"
                 and PREDICTORS[config.cache.predictor].uses_drafts)
    if not (lookahead or config.spec.speculative == "accept"):
        return None
    return make_drafter(config.spec.drafter, config.spec.draft_model, mc.vocab_size,
                        target=model, make_engine=make_engine, dtype=config.dtype,
                        device=config.device, device_kv_budget="1GiB")


def forced_token(seq: Sequence) -> int | None:
    """The request's next token when its parameters force it (teacher forcing)."""
    forced = seq.params.forced_tokens
    return forced[seq.num_output_tokens] if seq.num_output_tokens < len(forced) else None


def observe(drafter: Drafter, batch: ScheduledBatch, features: list[torch.Tensor | None],
            failures: StepFailures) -> None:
    """Gives the drafter the target's features of every position the step computed (the
    requests have advanced); a drafter that fails fails its request."""
    for (seq, n), feats in zip(batch, features, strict=True):
        if feats is not None:
            with failures.guard(seq, "the drafter's observe"):
                drafter.observe(seq.request_id, seq.num_computed_tokens - n, feats[:n])


def verify(engine: LLMEngine, logits: torch.Tensor, seq: Sequence
           ) -> tuple[int | Exception, bool]:
    """(token, whether it is the accepted first draft) from the normal row's `logits` [V],
    or the exception that verification raised (the request alone fails)."""
    try:
        return verify_draft(logits, seq.draft_tokens[0], seq.params, engine._generator(seq))
    except Exception as e:  # noqa: BLE001 - reported per request
        return e, False


def count(engine: LLMEngine, seq: Sequence, token: int | Exception) -> None:
    """The request's first draft of this step was `token`, or not."""
    right = seq.draft_tokens[0] == token
    engine.counters["drafts"] += 1
    engine.counters["drafts_right"] += right
    seq.metrics.num_drafts += 1
    seq.metrics.num_drafts_right += right


def accept(engine: LLMEngine, seq: Sequence, draft_features: torch.Tensor | None) -> None:
    """The first draft was the token just taken: its K/V (computed as a draft row) is kept,
    so the request advances one more token (whose logits, the draft row's, the caller
    samples)."""
    engine.runner.commit_draft(seq)
    if draft_features is not None:  # the accepted draft row's are the true ones
        engine.drafter.observe(seq.request_id, seq.num_computed_tokens, draft_features[:1])
    seq.num_computed_tokens += 1
    engine.counters["decode_tokens"] += 1
    engine.counters["spec_accepted"] += 1


def propose(engine: LLMEngine, seq: Sequence, token: int | Exception, accepted: bool,
            draft_row: torch.Tensor | None) -> None:
    """The request's drafts for its next step, from the drafter (given the logits of this
    step's draft row that was right, when the chain goes on), or its forced next token."""
    spec = engine.config.spec
    forced = forced_token(seq) if spec.forced_drafts == "known" else None
    if forced is not None:
        # teacher forcing: the next token is known, so the lookahead need not guess it
        # (nor guess others); drafters catch up on skipped tokens
        seq.draft_tokens, seq.draft_weights = [forced], None
        return
    right_row = chained_draft(seq.draft_tokens, token)
    prev = seq.draft_tokens[right_row] if seq.draft_tokens else None
    chain = None if accepted or draft_row is None else draft_row[right_row]
    try:
        seq.draft_tokens, probs = engine.drafter.propose_weighted(
            seq.token_ids, chain, prev, spec.num_drafts, seq.request_id)
        seq.draft_weights = sampling_weights(probs, len(seq.draft_tokens),
                                             seq.params.temperature)
    except Exception as e:  # noqa: BLE001 - a draft is a hint, never a failure
        log.warning("drafter failed for request %s: %r", seq.request_id, e)
        seq.draft_tokens, seq.draft_weights = [], None


def release(drafter: Drafter, seq: Sequence) -> None:
    """The request ended: the drafter drops its state (a failure is only logged)."""
    try:
        drafter.release(seq.request_id)
    except Exception as e:  # noqa: BLE001 - its state is a hint; the request is over
        log.warning("drafter failed to release request %s: %r", seq.request_id, e)
