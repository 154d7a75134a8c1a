"""Other engines a CPU user would pick, run on the same prompts as ours: HF transformers and
llama.cpp.

`hf_from_prefix` decodes from the prompt K/V our engine computed (loaded into a transformers
`DynamicCache`), so the peer skips the long prefill exactly as our modes do and the rows
compare decoding only; its first step computes the last prompt token, as ours does.
`LlamaCppPeer` runs the same GGUF in llama.cpp (llama-cpp-python's C API: quantized weights as
stored, f16 KV): it prefills each prompt but its last token once, into its own sequence (or
loads the sequence state an earlier run saved beside our prompt K/V), and for each batch
decodes those sequences together, then drops the generated tokens again.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

PEERS = ("hf", "llamacpp")
LLAMACPP_INSTALL = ("--peer llamacpp needs llama-cpp-python, built from source by pip (minutes "
                    "on 2 cores): pip install 'oasiskv[llamacpp]'")


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


class LlamaCppPeer:
    """llama.cpp on the model's GGUF, every prompt in its own sequence of one context (each
    sequence gets its own slice of the f16 KV cache, so attention reads only its own tokens)."""

    CHUNK = 512  # tokens per llama_decode call while prefilling

    def __init__(self, gguf: Path, prompts: list[list[int]], output_len: int, threads: int,
                 cache_dir: Path | None = None) -> None:
        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # no load chatter
        self.lib, self.prompts = llama_cpp, prompts
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        per_seq = -(-(max(map(len, prompts)) + output_len) // 256) * 256
        params.n_seq_max = len(prompts)
        params.n_ctx = per_seq * len(prompts)
        params.n_batch = params.n_ubatch = max(self.CHUNK, len(prompts))
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise ValueError(f"llama.cpp could not make a context of {params.n_ctx} tokens")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self.gguf, self.cache_dir = gguf, cache_dir
        self.prefill_s = self._prefill()

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) items."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(items)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _prefill(self) -> float:
        """Every prompt but its last token (what our engines load as prompt K/V), read from
        llama.cpp's sequence state files in cache_dir when an earlier run saved them.
        Returns the seconds spent computing."""
        seconds = 0.0
        for seq, p in enumerate(tqdm(self.prompts, desc="llama.cpp prefill", unit="prompt")):
            prefix = (self.lib.llama_token * (len(p) - 1))(*p[:-1])
            state = None
            if self.cache_dir is not None:
                key = hashlib.sha256(f"{self.gguf.resolve()}|llama.cpp|".encode()
                                     + np.array(p[:-1], dtype=np.int32).tobytes())
                state = self.cache_dir / f"llamacpp-{key.hexdigest()[:32]}.state"
                if state.exists() and self._load_state(state, seq, len(prefix)):
                    continue
            t0 = time.perf_counter()
            for start in range(0, len(p) - 1, self.CHUNK):
                chunk = p[start:min(start + self.CHUNK, len(p) - 1)]
                self._decode([(t, start + i, seq, False) for i, t in enumerate(chunk)])
            seconds += time.perf_counter() - t0
            if state is not None:
                self.lib.llama_state_seq_save_file(self.ctx, str(state).encode(), seq, prefix,
                                                   len(prefix))
        return seconds

    def _load_state(self, path: Path, seq: int, n: int) -> bool:
        """A saved prefix into sequence `seq`; False (and nothing loaded) when it does not fit."""
        tokens, count = (self.lib.llama_token * n)(), ctypes.c_size_t(0)
        read = self.lib.llama_state_seq_load_file(self.ctx, str(path).encode(), seq, tokens, n,
                                                  ctypes.byref(count))
        if read and count.value == n:
            return True
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), seq, -1, -1)
        return False

    def generate(self, count: int, output_len: int) -> dict:
        """Greedy decode of output_len tokens for the first `count` prompts in one batch per
        step, from their prefilled prefixes; the same figures as our engine's rows."""
        prompts = self.prompts[:count]
        last = [p[-1] for p in prompts]
        tokens: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        times = []
        for step in range(output_len):
            self._decode([(t, len(p) - 1 + step, seq, True)
                          for seq, (t, p) in enumerate(zip(last, prompts, strict=True))])
            for seq in range(count):
                logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, seq),
                                               shape=(self.vocab,))
                last[seq] = int(logits.argmax())
                tokens[seq].append(last[seq])
            times.append(time.perf_counter())
        wall = times[-1] - t0
        memory = self.lib.llama_get_memory(self.ctx)
        for seq, p in enumerate(prompts):  # back to the prefilled prefix for the next batch
            self.lib.llama_memory_seq_rm(memory, seq, len(p) - 1, -1)
        steps = len(times) - 1
        step_ms = 1e3 * (times[-1] - times[0]) / max(steps, 1)
        return {"tps": count * output_len / wall, "wall_s": wall, "tpot_ms": step_ms,
                "ttft_s": times[0] - t0, "running": float(count), "step_ms": step_ms,
                "preemptions": 0, "failed": 0, "tokens": tokens}

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None
