"""Running a sequence outside the scheduler (`LLMEngine.forward`): the model drafter, drafter
training and the recall tool drive the model through it, never through the runner or the
allocator; and the prefix K/V it computes for `add_request(prefix_kv=)`, and its checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from oasiskv.context import StepContext
from oasiskv.engine.runner import StepOutput
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine


def forward(engine: LLMEngine, seq: Sequence, num_tokens: int | None = None,
            sample_rows: list[int] | None = None, aux_layers: tuple[int, ...] = (),
            edit_context: Callable[[StepContext], None] | None = None) -> StepOutput:
    """Runs a sequence of `make_sequence` that is not a request (drafting, training,
    evaluation) through the model outside the scheduler, as a step that scheduled it
    alone would: its next `num_tokens` tokens (default: all that lack K/V), its draft
    tokens riding along in a decode step. Its blocks grow to hold them and their K/V is
    written; the caller advances `seq.num_computed_tokens` and gives the blocks back with
    `free`. Returns the logits at `sample_rows` (rows of these tokens; default the last),
    the draft rows' logits and the outputs of `aux_layers` (`StepOutput`).
    `edit_context(ctx)` may change the step's context before the model runs (the recall
    tool's per-K draft views and its probe)."""
    n = seq.num_tokens - seq.num_computed_tokens if num_tokens is None else num_tokens
    engine.kv.grow(seq, seq.num_computed_tokens + n)
    runner = engine.runner
    runner.aux_layers, saved = aux_layers, runner.aux_layers
    try:
        return runner.run([(seq, n)], [n - 1] if sample_rows is None else sample_rows,
                          edit_context)
    finally:
        runner.aux_layers = saved


@torch.inference_mode()
def compute_prefix_kv(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Prefills `ids` outside the scheduler and returns their K/V [L, 2, Hkv, n, d]
    (dense attention, chunks of max_num_batched_tokens), for `add_request(prefix_kv=)`
    of this or another engine with the same model: prefill once, decode many ways."""
    seq = engine.make_sequence(list(ids) + [0], SamplingParams(max_tokens=1))
    chunk = engine.config.scheduler.max_num_batched_tokens
    try:
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            forward(engine, seq, n, sample_rows=[])
            seq.num_computed_tokens += n
        return engine.runner.read_kv(seq, len(ids))
    finally:
        engine.free(seq)


def check_prefix_kv(engine: LLMEngine, kv: torch.Tensor,
                    num_prompt_tokens: int) -> torch.Tensor:
    """A given prefix K/V [L, 2, Hkv, n, d] fits this model and the prompt, in the KV dtype."""
    mc = engine.model_config
    want = (mc.num_layers, 2, mc.num_kv_heads, mc.head_dim)
    if kv.dim() != 5 or (*kv.shape[:3], kv.shape[4]) != want:
        raise ValueError(f"prefix_kv has shape {tuple(kv.shape)}; this model's is "
                         f"[{want[0]}, 2, {want[2]}, n, {want[3]}]")
    if not 0 < kv.shape[3] < num_prompt_tokens:
        raise ValueError(f"prefix_kv covers {kv.shape[3]} tokens; it must cover 1 to "
                         f"{num_prompt_tokens - 1} (the last prompt token is computed to "
                         "sample the first output)")
    return kv.to(engine.runner.device_kv.dtype)
