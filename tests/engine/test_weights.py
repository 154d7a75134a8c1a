"""`engine/weights.py`: a model loaded from a checkpoint computes HF transformers' logits, one
that shares another engine's weights holds the same tensors, and a mismatch is refused."""

from __future__ import annotations

import pytest
import torch
import transformers

from oasiskv import LLM
from oasiskv.config import EngineConfig
from oasiskv.engine.weights import load_model

IDS = [5, 17, 42, 99, 7, 250, 31]


def test_a_loaded_model_computes_transformers_logits(tiny_llama):
    """The attention layers read the engine's step context: the model runs in an engine,
    whose model `load_model` builds."""
    model, mc, tokenizer = load_model(EngineConfig.from_kwargs(model=str(tiny_llama)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    assert (mc.num_layers, mc.num_kv_heads, mc.head_dim) == (2, 2, 16)
    assert tokenizer.eos_token_id == hf.config.eos_token_id
    assert not model.training
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    engine = LLM(str(tiny_llama)).engine
    seq = engine.make_sequence(IDS)
    try:
        got = engine.forward(seq, sample_rows=list(range(len(IDS)))).logits
    finally:
        engine.free(seq)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_shared_weights_are_the_same_tensors(tiny_llama):
    first = LLM(str(tiny_llama)).engine
    model, mc, tokenizer = load_model(first.config, share_weights=first)
    assert mc is first.model_config and tokenizer is first.tokenizer
    mine = dict(model.named_parameters())
    for name, p in first.model.named_parameters():
        assert mine[name].data_ptr() == p.data_ptr(), name


def test_sharing_weights_of_another_dtype_is_refused(tiny_llama):
    first = LLM(str(tiny_llama)).engine
    other = EngineConfig.from_kwargs(model=str(tiny_llama), dtype="bfloat16")
    with pytest.raises(ValueError, match="share_weights: that engine runs"):
        load_model(other, share_weights=first)
