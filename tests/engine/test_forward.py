"""`LLMEngine.forward`, the engine's entry for running a sequence outside the scheduler (the
model drafter, drafter training, the recall tool): its logits, K/V and features are those of a
scheduled step of the same tokens, and of HF transformers; it gives its blocks back."""

from __future__ import annotations

import pytest
import torch
import transformers

from oasiskv import LLM, SamplingParams
from oasiskv.spec.drafters import make_drafter

PROMPT = [(7 * i) % 290 + 3 for i in range(40)]  # no special tokens


@pytest.fixture(scope="module")
def hf(tiny_llama, test_device):
    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32).eval().to(test_device)


@pytest.fixture()
def engine(tiny_llama, test_device):
    """On OASISKV_TEST_DEVICE (conftest), as its transformers reference."""
    return LLM(str(tiny_llama), device_kv_budget="1MiB", device=test_device).engine


def test_forward_equals_a_scheduled_prefill_and_decode(engine):
    """The scheduled request's first tokens and log-probs, and its K/V after each step, are
    what `forward` computes for the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=True)
    seq = engine.make_sequence(PROMPT, params)
    engine.add_sequence(seq)
    scheduled_kv = []  # after the step that sampled output token i (prefill: maybe chunked)
    while not seq.is_finished:
        engine.step()
        if not seq.is_finished and seq.num_output_tokens > len(scheduled_kv):
            scheduled_kv.append(engine.runner.read_kv(seq, seq.num_computed_tokens))
    tokens, logprobs = seq.output_token_ids, seq.logprobs
    mine = engine.make_sequence(list(PROMPT), SamplingParams(max_tokens=3))
    try:
        for i in range(len(scheduled_kv)):
            logits = engine.forward(mine).logits  # [1, V]: the last token's
            mine.num_computed_tokens = mine.num_tokens
            assert int(logits[0].argmax()) == tokens[i]
            torch.testing.assert_close(float(torch.log_softmax(logits[0], -1)[tokens[i]]),
                                       logprobs[i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(engine.runner.read_kv(mine, mine.num_computed_tokens),
                                       scheduled_kv[i], atol=1e-5, rtol=1e-5)
            mine.token_ids.append(tokens[i])
    finally:
        engine.free(mine)
    assert engine.pool.num_used == 0


def test_forward_logits_and_features_equal_transformers(engine, hf):
    seq = engine.make_sequence(list(PROMPT), SamplingParams(max_tokens=1))
    rows = list(range(len(PROMPT)))
    try:
        out = engine.forward(seq, sample_rows=rows, aux_layers=(0,))
    finally:
        engine.free(seq)
    assert engine.runner.aux_layers == ()  # the engine's own setting is back
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT], device=engine.device), output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    # layer 0's output: HF's hidden state after its first layer
    torch.testing.assert_close(out.features[0], ref.hidden_states[1][0], atol=1e-4, rtol=1e-4)
    assert engine.pool.num_used == 0


def test_forward_in_chunks_and_with_an_edited_context(engine, hf):
    """Two chunks give the logits of one pass; `edit_context` sees the step's context before
    the model runs (one view of the chunk's rows over everything computed so far)."""
    seq = engine.make_sequence(list(PROMPT), SamplingParams(max_tokens=1))
    seen = []
    try:
        first = engine.forward(seq, 25, sample_rows=[24],
                               edit_context=lambda ctx: seen.append(ctx.seqs[0].kv_len))
        seq.num_computed_tokens = 25
        second = engine.forward(seq, edit_context=lambda ctx: seen.append(ctx.seqs[0].kv_len))
    finally:
        engine.free(seq)
    assert seen == [25, len(PROMPT)]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT], device=engine.device)).logits[0]
    torch.testing.assert_close(first.logits[0], ref[24], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second.logits[0], ref[-1], atol=1e-4, rtol=1e-4)


def test_attach_drafter_sets_the_features_the_steps_compute(engine):
    drafter = make_drafter("ngram")
    drafter.feature_layers = (1,)
    engine.attach_drafter(drafter)
    assert engine.drafter is drafter and engine.runner.aux_layers == (1,)
    engine.attach_drafter(None)
    assert engine.drafter is None and engine.runner.aux_layers == ()


def test_model_drafter_needs_an_engine_factory(tiny_llama):
    with pytest.raises(ValueError, match="make_engine"):
        make_drafter("model", str(tiny_llama), 320)
