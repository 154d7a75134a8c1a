"""An engine's model: its weights loaded from a checkpoint (or shared with another engine of
the same model, or seeded random weights for a `random:` model), on the engine's device and
dtype, with its config and tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.layers.linear import pack_linears
from oasiskv.models.byte_tokenizer import byte_tokenizer
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.models.loader import load_checkpoint
from oasiskv.models.random_model import init_random, is_random, random_config
from oasiskv.models.registry import resolve_model

if TYPE_CHECKING:
    from oasiskv.engine.engine import LLMEngine


def load_model(config: EngineConfig, share_weights: LLMEngine | None = None,
               ) -> tuple[LlamaForCausalLM, ModelConfig, Any]:
    """(model in eval mode, its config, its tokenizer). `share_weights`: an engine of the
    same model, dtype and device whose weight tensors the model uses instead of loading its
    own copy (the weights are read-only)."""
    device, dtype = torch.device(config.device), config.torch_dtype
    ckpt = None
    if share_weights is None and is_random(config.model):
        mc, tokenizer = ModelConfig.from_hf(random_config(config.model)), byte_tokenizer()
    elif share_weights is None:
        ckpt = load_checkpoint(resolve_model(config.model), dtype=dtype)
        mc, tokenizer = ModelConfig.from_hf(ckpt.hf_config), ckpt.tokenizer
    else:
        other = share_weights.config
        if (other.model, other.torch_dtype, share_weights.device) != (config.model, dtype,
                                                                     device):
            raise ValueError(f"share_weights: that engine runs {other.model} "
                             f"({other.dtype}, {other.device}), this one {config.model} "
                             f"({config.dtype}, {config.device})")
        mc, tokenizer = share_weights.model_config, share_weights.tokenizer
    with torch.device("meta"):  # no time spent on random init of weights we overwrite
        model = LlamaForCausalLM(mc)
    # the dtype first, still on meta: the device's memory is allocated once, in the dtype
    model = model.to(dtype).to_empty(device=device)
    model.model.rotary.build()  # its tables are computed, not loaded
    if share_weights is not None:  # the same Parameter objects (tied embeddings stay tied)
        model.load_state_dict(share_weights.model.state_dict(keep_vars=True), assign=True)
    elif ckpt is None:
        init_random(model)
    else:
        model.load_weights(ckpt.state_dict)
    # CPU: linear weights also in oneDNN's layout (faster decode and prefill)
    pack_linears(model, share_weights.model if share_weights is not None else None)
    return model.eval(), mc, tokenizer
