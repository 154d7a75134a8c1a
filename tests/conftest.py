"""Tiny random-weight models in HF layout, built by the tests themselves (no downloads), a
real Mooncake master for the remote-tier tests, and the device the device-dependent tests run
on (`test_device`)."""

from __future__ import annotations

import os
import re
import resource
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from oasiskv.spec.drafters import Drafter
from oasiskv.store.mooncake import (
    INSTALL_HINT,
    mooncake_available,
    private_network,
    start_master,
)

CORPUS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,"
    " must be in want of a wife.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Numbers like 12345 and 67890 appear in text; so do names such as Elizabeth and Darcy.",
] * 4

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                {"sliding_window": None}),
}


def requests_in(store) -> set[str]:
    """The store's namespaces but prefix-cache entries (which outlive their requests)."""
    from oasiskv.kv.prefix_cache import is_entry

    return {n for n in store.namespaces() if not is_entry(n)}


def build_tokenizer(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                                                eos_token="</s>")


def build_model_dir(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Saves a tiny random model + tokenizer as an HF directory; returns it."""
    config_cls, model_cls, extra = ARCHS[arch]
    tokenizer = build_tokenizer()
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    # Random init leaves biases zero; make them count.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def test_device() -> str:
    """The device of the tests that take this fixture (sparse equals dense, the HF reference
    tests, sampling): OASISKV_TEST_DEVICE, default cpu (CI). A device this machine lacks
    fails those tests with the config's reason (no CUDA here, or a CPU-only torch), never
    skips them: a GPU run that silently tested nothing would read as a pass."""
    from oasiskv.config_checks import check_device_present

    name = os.environ.get("OASISKV_TEST_DEVICE", "cpu")
    try:
        check_device_present(torch.device(name))
    except (ValueError, RuntimeError) as e:
        pytest.fail(f"OASISKV_TEST_DEVICE={name}: {e}", pytrace=False)
    return name


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny models are fastest on one thread, and 2-thread OpenMP barriers crawl when the
    machine's cores are shared with another job."""
    torch.set_num_threads(1)


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """A kernel's paths on one thread and shared by two (over one_thread's setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (independently of the kernels' CPUID);
    skips where /proc/cpuinfo has none."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    found = re.search(r"^flags\s*:(.*)$", text, re.M)
    if found is None:
        pytest.skip("no x86 flags in /proc/cpuinfo")
    return set(found.group(1).split())


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny_llama"), "llama")


MARKOV_CHUNK = 48


def markov_corpus(num: int, seed: int) -> list[list[int]]:
    """Token ids from a small 'language': an order-2 Markov chain over 60 ids, so a learner
    can beat the unigram guess."""
    g = torch.Generator().manual_seed(99)
    table = torch.randint(3, 63, (60, 60, 3), generator=g)  # 3 likely successors per context
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        ids = [3, 4]
        while len(ids) < MARKOV_CHUNK:
            choice = int(torch.randint(0, 3, (1,), generator=rng))
            ids.append(int(table[ids[-2] - 3, ids[-1] - 3, choice]))
        out.append(ids)
    return out


class KnownAndDecoy(Drafter):
    """Drafts the true next token (read from a known output: output[n] follows the prompt and
    n output tokens) and a token the output never has, in either order, with `weights`;
    records each call."""

    name = "known-and-decoy"

    def __init__(self, prompt_len: int, output: list[int], decoy: int,
                 decoy_first: bool, weights: list[float] | None = None) -> None:
        self.prompt_len, self.output, self.decoy = prompt_len, output, decoy
        self.decoy_first, self.weights = decoy_first, weights
        self.calls: list[tuple[list[int], torch.Tensor | None, int | None]] = []

    def propose_weighted(self, tokens, draft_logits, prev_draft, num=1, request_id=""):
        self.calls.append((list(tokens), draft_logits, prev_draft))
        n = len(tokens) - self.prompt_len
        known = self.output[n] if n < len(self.output) else self.decoy + 1
        guesses = [self.decoy, known] if self.decoy_first else [known, self.decoy]
        return guesses[:num], self.weights and self.weights[:num]


@pytest.fixture(scope="session")
def tiny_eagle(tiny_llama, tmp_path_factory) -> tuple[Path, dict]:
    """An EAGLE-style head trained for tiny_llama on markov_corpus: (its directory, figures)."""
    from oasiskv.config import EngineConfig
    from oasiskv.engine.engine import LLMEngine
    from oasiskv.train.drafter import run
    from oasiskv.train.spec import TrainSpec

    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("eagle")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama)))
    spec = TrainSpec(model=str(tiny_llama), out=out, chunk=MARKOV_CHUNK, epochs=12, batch=4,
                     lr=3e-3, draft_vocab=256, shard_chunks=16, self_tokens=16 * MARKOV_CHUNK,
                     self_prompt=MARKOV_CHUNK // 3, quiet=True)
    result = run(engine, spec, aux_layers=[0, 1],
                 chunks=(markov_corpus(96, 1), markov_corpus(16, 2)))
    return out, result


needs_mooncake = pytest.mark.skipif(
    not mooncake_available(), reason=f"Mooncake wheel not installed: run {INSTALL_HINT}")


@pytest.fixture(scope="session")
def mooncake_net():
    """A private network namespace for the session's Mooncake processes (yields whether the
    kernel granted one; if not, everything stays bound to 127.0.0.1 on the shared network).
    One per session: a Mooncake client keeps process-wide state that a second namespace
    breaks."""
    if not mooncake_available():
        pytest.skip(f"Mooncake wheel not installed: run {INSTALL_HINT}")
    with private_network() as private, pytest.MonkeyPatch.context() as mp:
        mp.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        if not private:
            warnings.warn("no private network namespace here (unshare refused); Mooncake "
                          "runs loopback-bound and its data ports listen on all interfaces",
                          stacklevel=1)
        yield private


@pytest.fixture(scope="session")
def master(mooncake_net):
    """A real mooncake_master on loopback (short TTLs, so dead holders expire fast)."""
    with start_master(client_ttl_s=2, lease_ttl_ms=500) as handle:
        yield handle


@pytest.fixture
def no_core_dumps():
    """Children a test kills with SIGSEGV leave no core file behind."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    yield
    resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
