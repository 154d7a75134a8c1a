"""`random:NAME` models: a published architecture with seeded random weights and the byte-level
stand-in tokenizer (`byte_tokenizer.py`), so that throughput can be measured at a paper's
scale with nothing to download. Their tokens are meaningless: benches say so in their header,
evals refuse them.

The shapes are those of each model's published HF `config.json` (sources:
huggingface.co/Qwen/Qwen3-8B/blob/main/config.json and
huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json; `tiny` is ours, for tests):

| random:      | layers | hidden | FFN   | heads / KV | d   | vocab  | context | RoPE             |
|--------------|--------|--------|-------|------------|-----|--------|---------|------------------|
| qwen3-8b     | 36     | 4096   | 12288 | 32 / 8     | 128 | 151936 | 40960   | θ 1e6; q/k norms |
| llama-3.1-8b | 32     | 4096   | 14336 | 32 / 8     | 128 | 128256 | 131072  | θ 5e5; llama3 x8 |
| tiny         | 2      | 64     | 128   | 4 / 2      | 16  | 258    | 2048    | θ 1e4            |

(llama3 x8: rope_scaling factor 8 over 8192 original positions, low/high frequency factors 1
and 4. RMSNorm eps 1e-6 for Qwen3, 1e-5 for Llama.) Neither 8B model ties its embeddings or
has attention biases. BOS/EOS are the stand-in tokenizer's (256, 257), not the real ones: the
real ids mean nothing to it.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from oasiskv.models.byte_tokenizer import BOS_ID, EOS_ID

PREFIX = "random:"
SEED = 0  # the weights' seed: one model name, device and dtype give the same weights
INIT_STD = 0.02  # transformers' initializer_range for both models

CONFIGS: dict[str, dict] = {
    "qwen3-8b": {  # https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None},
    "llama-3.1-8b": {  # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
    "tiny": {  # ours: the tests' model, the stand-in tokenizer's vocabulary
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 258, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}

NOTE = ("model {name} has random weights and a byte-level stand-in tokenizer: its tokens are "
        "meaningless, accuracy (and greedy agreement with anything but itself) is not "
        "measured; figures are of speed at its shapes only")


def is_random(name: str) -> bool:
    return str(name).lower().startswith(PREFIX)


def random_config(name: str) -> dict:
    """The HF-style config dict of `random:NAME`, BOS/EOS the stand-in tokenizer's."""
    key = str(name).lower().removeprefix(PREFIX)
    if key not in CONFIGS:
        raise ValueError(f"unknown random model {name!r}; known: "
                         f"{', '.join(PREFIX + k for k in CONFIGS)}")
    return {**copy.deepcopy(CONFIGS[key]), "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}


def random_note(name: str) -> str | None:
    """What a bench prints in its header for a `random:` model (None: a real one)."""
    return NOTE.format(name=name) if is_random(name) else None


def refuse_random(name: str, what: str) -> None:
    """Raises ValueError when `what` (an eval, which measures accuracy) is asked of a
    `random:` model."""
    if is_random(name):
        raise ValueError(f"{what} measures accuracy, and {name} has random weights (its "
                         "tokens are meaningless): use a real checkpoint; random: models are "
                         "for throughput benches")


@torch.no_grad()
def init_random(model: nn.Module, seed: int = SEED, std: float = INIT_STD) -> None:
    """Fills every parameter in place, on its device and in its dtype (an 8B model is never
    made in fp32 or on the CPU first): matrices N(0, std), norm gains 1, biases 0. One
    generator on the parameters' device walks them in name order: the same seed, device and
    dtype give the same weights. A model on the meta device is left as it is."""
    params = sorted(model.named_parameters())
    device = params[0][1].device
    if device.type == "meta":
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in params:
        if p.dim() > 1:
            p.normal_(0.0, std, generator=gen)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.zero_()
