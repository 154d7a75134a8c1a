"""Other engines a CPU user would pick, run on the same prompts as ours: HF transformers and
llama.cpp.

`hf_from_prefix` decodes from the prompt K/V our engine computed (loaded into a transformers
`DynamicCache`), so the peer skips the long prefill exactly as our modes do and the rows
compare decoding only; its first step computes the last prompt token, as ours does.
`LlamaCppPeer` runs the same GGUF in llama.cpp (llama-cpp-python's C API: quantized weights as
stored, f16 KV) in a child process (a native crash fails the peer, not the run): it prefills
each prompt but its last token once, into its own sequence (or loads the sequence state an
earlier run saved beside our prompt K/V), and for each batch decodes those sequences together,
then drops the generated tokens again.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from oasiskv.bench.isolated import ChildCrashed, Isolated

__all__ = ["ChildCrashed", "LlamaCppPeer", "hf_from_prefix", "load_hf", "parse_peers"]

PEERS = ("hf", "llamacpp")
LLAMACPP_INSTALL = ("--peer llamacpp needs llama-cpp-python, built from source without AMX "
                    "(minutes on 2 cores): scripts/setup_llamacpp.sh")


def parse_peers(text: str | None, model: str | None = None) -> list[str]:
    """The --peer list, checked before any work: known names, llama.cpp installed and the
    model a GGUF file (llama.cpp runs nothing else)."""
    peers = [p for p in (text or "").split(",") if p]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise ValueError(f"unknown --peer {bad}; choose from {PEERS}")
    if "llamacpp" in peers:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as e:
            raise ValueError(LLAMACPP_INSTALL) from e
        if model is not None:
            from oasiskv.models.registry import resolve_model

            path = resolve_model(model)
            if path.suffix != ".gguf":
                raise ValueError(f"--peer llamacpp runs GGUF models; {model} is {path}")
    return peers


def load_hf(model: str, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """The HF transformers model for our alias, HF directory or .gguf (dequantized), on
    `device` (ours: a peer on another device would compare devices, not engines)."""
    from transformers import AutoModelForCausalLM

    from oasiskv.models.registry import resolve_model

    path = resolve_model(model)
    load = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent if load else path, dtype=dtype,
                                                **load).eval().to(device)


def prefix_cache(hf, kv_files: list[Path]):
    """A DynamicCache holding each file's prompt K/V ([L, 2, Hkv, n, d]) as one batch, read
    one layer at a time so that only the cache itself is ever in memory."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    handles = [safe_open(str(f), framework="pt") for f in kv_files]
    for layer in range(hf.config.num_hidden_layers):
        kv = torch.stack([h.get_slice("kv")[layer] for h in handles]).to(hf.device)
        # kv [R, 2, Hkv, n, d]
        cache.update(kv[:, 0].contiguous(), kv[:, 1].contiguous(), layer)
    return cache


def cache_kwargs(hf, cache) -> dict:
    """The keyword an HF model's forward takes its KV cache by: `cache` from transformers
    5.2x, `past_key_values` before (the GPU machine's 5.17)."""
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    return {name: cache}


def past_cache(out):
    """The KV cache an HF forward returned (`out.cache`, or `out.past_key_values` before 5.2x)."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def timed_generate(hf, inputs: torch.Tensor, output_len: int,
                   on_token: Callable[[int], None] | None = None,
                   **kwargs) -> tuple[torch.Tensor, list[float]]:
    """Greedy `generate` of exactly output_len tokens per row ([R, T] inputs, no padding);
    returns the output ids and the time each token was produced (a StoppingCriteria clock).
    `on_token(i)`: called after the batch's i-th token (progress bars)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kw) -> torch.Tensor:
            self.times.append(time.perf_counter())
            if on_token is not None:
                on_token(len(self.times) - 1)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

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
    inputs = torch.tensor(prompts, device=hf.device)
    t0 = time.perf_counter()
    out, times = timed_generate(hf, inputs, output_len, **cache_kwargs(hf, cache))
    wall = time.perf_counter() - t0
    steps = len(times) - 1
    decode_s = times[-1] - times[0]
    return {"tps": len(prompts) * output_len / wall, "wall_s": wall,
            "tpot_ms": 1e3 * decode_s / max(steps, 1), "ttft_s": times[0] - t0,
            "running": float(len(prompts)), "step_ms": 1e3 * decode_s / max(steps, 1),
            "preemptions": 0, "failed": 0, "tokens": out[:, inputs.shape[1]:].tolist()}


class LlamaCppPeer:
    """llama.cpp on the model's GGUF (`llamacpp.LlamaCppSession`), run in a child process: a
    crash of the native library raises ChildCrashed ("llama.cpp peer crashed: signal 11
    (SIGSEGV)") here and leaves this process running. Prefills on construction."""

    def __init__(self, gguf: Path, prompts: list[list[int]], output_len: int, threads: int,
                 cache_dir: Path | None = None) -> None:
        from oasiskv.bench.llamacpp import LlamaCppSession

        self._child = Isolated("llama.cpp peer", LlamaCppSession, Path(gguf), prompts,
                               output_len, threads, cache_dir)
        try:
            self.system_info: str = self._child.call("system_info")
            self.prefill_s: float = self._child.call("prefill")
            self.load_log: str = self._child.call("log")  # what llama.cpp logged loading
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._child.pid

    def generate(self, count: int, output_len: int) -> dict:
        """Greedy decode of output_len tokens for the first `count` prompts in one batch per
        step, from their prefilled prefixes; the same figures as our engine's rows."""
        return self._child.call("generate", count, output_len)

    def ttft(self, index: int) -> dict:
        """Time to first token of prompt `index` computed from scratch (`LlamaCppSession`)."""
        return self._child.call("ttft", index)

    def close(self) -> None:
        self._child.close()


class RestartingPeer:
    """The llama.cpp peer for one set of prompts, started at its first `generate` and again
    after a crash (loading the sequence states the first start saved in cache_dir), so that a
    crash fails one call, not every one after it. `prefill_s` is the first start's."""

    def __init__(self, gguf: Path, prompts: list[list[int]], output_len: int, threads: int,
                 cache_dir: Path | None) -> None:
        self._args = (gguf, prompts, output_len, threads, cache_dir)
        self._peer: LlamaCppPeer | None = None
        self.prefill_s: float | None = None
        self.system_info: str | None = None

    def generate(self, count: int, output_len: int) -> dict:
        """LlamaCppPeer.generate; raises ChildCrashed when llama.cpp crashed meanwhile."""
        return self._call("generate", count, output_len)

    def ttft(self, index: int) -> dict:
        """LlamaCppPeer.ttft; raises ChildCrashed when llama.cpp crashed meanwhile."""
        return self._call("ttft", index)

    def _call(self, op: str, *args) -> dict:
        try:
            if self._peer is None:
                self._peer = LlamaCppPeer(*self._args)
                if self.prefill_s is None:
                    self.prefill_s, self.system_info = (self._peer.prefill_s,
                                                        self._peer.system_info)
            return getattr(self._peer, op)(*args)
        except ChildCrashed:
            self.close()
            raise

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None
