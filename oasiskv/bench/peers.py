"""Other engines a CPU user would pick, run on the same prompts as ours: HF transformers.

`hf_from_prefix` decodes from the prompt K/V our engine computed (loaded into a transformers
`DynamicCache`), so the peer skips the long prefill exactly as our modes do and the rows
compare decoding only; its first step computes the last prompt token, as ours does.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors import safe_open

PEERS = ("hf",)


def parse_peers(text: str | None) -> list[str]:
    peers = [p for p in (text or "").split(",") if p]
    bad = [p for p in peers if p not in PEERS]
    if "llamacpp" in bad:
        raise ValueError("--peer llamacpp is not available yet: OasisKV does not drive "
                         "llama-cpp-python's batched API; use --peer hf")
    if bad:
        raise ValueError(f"unknown --peer {bad}; choose from {PEERS}")
    return peers


def load_hf(model: str, dtype: torch.dtype):
    """The HF transformers model for our alias, HF directory or .gguf (dequantized)."""
    from transformers import AutoModelForCausalLM

    from oasiskv.models.registry import resolve_model

    path = resolve_model(model)
    load = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent if load else path, dtype=dtype,
                                                **load).eval()


def prefix_cache(hf, kv_files: list[Path]):
    """A DynamicCache holding each file's prompt K/V ([L, 2, Hkv, n, d]) as one batch, read
    one layer at a time so that only the cache itself is ever in memory."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    handles = [safe_open(str(f), framework="pt") for f in kv_files]
    for layer in range(hf.config.num_hidden_layers):
        kv = torch.stack([h.get_slice("kv")[layer] for h in handles])  # [R, 2, Hkv, n, d]
        cache.update(kv[:, 0].contiguous(), kv[:, 1].contiguous(), layer)
    return cache


def timed_generate(hf, inputs: torch.Tensor, output_len: int,
                   **kwargs) -> tuple[torch.Tensor, list[float]]:
    """Greedy `generate` of exactly output_len tokens per row ([R, T] inputs, no padding);
    returns the output ids and the time each token was produced (a StoppingCriteria clock)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    clock = StepClock()
    with torch.inference_mode():
        out = hf.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                          max_new_tokens=output_len, min_new_tokens=output_len,
                          stopping_criteria=StoppingCriteriaList([clock]), pad_token_id=0,
                          **kwargs)
    return out, clock.times


def hf_from_prefix(hf, prompts: list[list[int]], kv_files: list[Path], output_len: int) -> dict:
    """Greedy `generate` of `output_len` tokens for all prompts at once (equal lengths: no
    padding), from their computed prompt K/V. Same figures as our engine's rows."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("hf peer: prompts must have equal lengths (no padding)")
    cache = prefix_cache(hf, kv_files)
    inputs = torch.tensor(prompts)
    t0 = time.perf_counter()
    out, times = timed_generate(hf, inputs, output_len, cache=cache)
    wall = time.perf_counter() - t0
    steps = len(times) - 1
    decode_s = times[-1] - times[0]
    return {"tps": len(prompts) * output_len / wall, "wall_s": wall,
            "tpot_ms": 1e3 * decode_s / max(steps, 1), "ttft_s": times[0] - t0,
            "running": float(len(prompts)), "step_ms": 1e3 * decode_s / max(steps, 1),
            "preemptions": 0, "failed": 0, "tokens": out[:, inputs.shape[1]:].tolist()}
