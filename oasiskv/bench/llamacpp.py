"""llama.cpp itself, through llama-cpp-python's C API (ctypes): the session that
`peers.LlamaCppPeer` runs in a child process, so that a crash in the native library (such as
its AMX matmul's segfault on Sapphire Rapids, ggml-org/llama.cpp#20824) takes down only the
child.

Every prompt gets its own sequence of one context (its own slice of the f16 KV cache, so
attention reads only its own tokens); each prompt but its last token is prefilled once (or its
sequence state loaded from a file an earlier run saved), and each `generate` decodes the first
`count` sequences together, then drops the generated tokens again.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

GGML_LOG_LEVEL_ERROR = 4


class LlamaCppSession:
    """llama.cpp on a GGUF with one sequence per prompt. `system_info` is the library's own
    line of what it was built with; `log` what it logged (loading included)."""

    CHUNK = 512  # tokens per llama_decode call while prefilling

    def __init__(self, gguf: Path, prompts: list[list[int]], output_len: int, threads: int,
                 cache_dir: Path | None = None) -> None:
        import llama_cpp

        self.lib, self.prompts = llama_cpp, prompts
        self.gguf, self.cache_dir = Path(gguf), cache_dir
        self.ctx = None
        self._log: list[str] = []
        # llama.cpp's (and ggml's) log, kept: it says which buffers the model went into
        self._log_callback = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._log_callback, ctypes.c_void_p(0))
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

    def _on_log(self, level: int, text: bytes, user_data) -> None:
        message = text.decode(errors="replace")
        self._log.append(message)
        if level == GGML_LOG_LEVEL_ERROR:  # errors still reach the terminal; the rest is chatter
            print(message, end="", file=sys.stderr, flush=True)

    def system_info(self) -> str:
        return self.lib.llama_print_system_info().decode()

    def log(self) -> str:
        return "".join(self._log)

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

    def prefill(self) -> float:
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

    def ttft(self, index: int) -> dict:
        """Time to first token of prompt `index` from scratch: its sequence emptied, the whole
        prompt computed in CHUNK-token calls, the first token picked; then its sequence holds
        the prefix again, as prefill() left it (the same K/V, recomputed)."""
        p = self.prompts[index]
        memory = self.lib.llama_get_memory(self.ctx)
        self.lib.llama_memory_seq_rm(memory, index, -1, -1)
        t0 = time.perf_counter()
        for start in range(0, len(p), self.CHUNK):
            chunk = p[start:start + self.CHUNK]
            last = start + len(chunk) == len(p)
            self._decode([(t, start + i, index, last and i == len(chunk) - 1)
                          for i, t in enumerate(chunk)])
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1),
                                       shape=(self.vocab,))
        token = int(logits.argmax())
        ttft = time.perf_counter() - t0
        self.lib.llama_memory_seq_rm(memory, index, len(p) - 1, -1)
        return {"ttft_s": ttft, "token": token}

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = None
