"""Configuration: one dataclass per concern, validated once, at construction.

`EngineConfig.from_kwargs` routes flat keywords (the `LLM(...)` call, the CLI flags) to the
dataclass that owns each field, so every field is settable from Python and the command line
under one name. Here: each field with its default and help text; the rules its values must
meet (and the values a field takes): `config_checks.py`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oasiskv.config_checks import (
    DTYPES,
    check_cache,
    check_device_present,
    check_field_types,
)
from oasiskv.config_checks import parse_bytes as parse_bytes  # its home was here


@dataclass
class ModelConfig:
    """Architecture of a Llama-family model, read from an HF config dict (or GGUF metadata)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in cls.SUPPORTED:
            raise ValueError(f"architecture {arch} is not supported; supported: {cls.SUPPORTED}")
        heads = hf["num_attention_heads"]
        # transformers >= 5 nests rope settings in `rope_parameters`; older configs use
        # rope_theta + rope_scaling.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        qwen2 = arch == "Qwen2ForCausalLM"
        window = hf.get("sliding_window") if hf.get("use_sliding_window", not qwen2) else None
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qwen2 or bool(hf.get("attention_bias", False)),
            o_bias=not qwen2 and bool(hf.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=window,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token position occupies across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _field(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


DRAFTERS = ("self", "ngram", "resync", "model")
HEAD_DRAFTERS = ("eagle", "resync-eagle")  # NAME:DIR runs a head made by `oasiskv train-drafter`


def head_dir(drafter: str) -> str | None:
    """DIR of a drafter that runs a trained head (`eagle:DIR`, `resync-eagle:DIR`), else None."""
    name, sep, path = drafter.partition(":")
    return path if sep and name in HEAD_DRAFTERS else None


@dataclass
class CacheConfig:
    block_size: int = _field(16, "tokens per KV block")
    device_kv_budget: int | str = _field(
        "4GiB", "bytes of KV cache on the device (e.g. 512MiB, 2GiB); sets the block pool size")
    kv_mode: str = _field(
        "dense", "dense: every block on the device; sparse: a per-head working set of top_k "
        "blocks on the device, the full history in the host tier")
    top_k: int = _field(128, "sparse: resident blocks per KV head (K); the active block is extra")
    f_hbm: float | str = _field(
        0.05, "sparse: at most ceil(f_hbm*top_k) new blocks admitted per head, layer and step; "
        "auto: the cap whose transfers fit in one forward pass (measured bandwidth, moving "
        "forward time)")
    host_kv_budget: int | str = _field(
        "8GiB", "sparse: bytes of host memory for the complete KV history of running requests")
    predictor: str = _field(
        "lookahead", "sparse: which query picks the blocks: lookahead (the draft token's, for "
        "the next step), previous (this step's, for the next), exact (this step's, for this "
        "step: on the critical path), oracle (the true top-K by this step's attention mass: "
        "reads every key, an upper bound for evaluation, one node only)")
    sink_blocks: int = _field(
        0, "sparse: the first blocks of a request stay in every working set (attention sinks, "
        "as Quest/FreeKV keep sink tokens; the paper's OasisKV uses none); part of top_k")
    recent_blocks: int = _field(
        0, "sparse: the last complete blocks stay in every working set (a local window, as "
        "Quest/FreeKV keep recent tokens); part of top_k")
    dense_layers: int = _field(
        0, "sparse: the first N decoder layers attend to their whole context (dense "
        "attention, as Quest and FreeKV keep layers 0-1), with no selection or prefetch; their "
        "K/V is a device copy of each request's whole history, charged to device_kv_budget "
        "beside the summaries (N layers x 2 x KV heads x block_size x head_dim x dtype bytes "
        "per block); the slab and summaries cover the other layers only")
    score_alpha: float = _field(
        1.0, "sparse: block score q.c + alpha*|q|.r over the min/max key summary (1 = Quest)")
    score_aggregation: str = _field(
        "sum", "sparse: how a KV head's query heads combine into one block score. sum: their "
        "summed bounds (one head with large norms decides for the group); softmax-sum / "
        "softmax-max: each query head's bounds (Quest's, score_alpha) normalised by a softmax "
        "over the request's blocks at the attention scale, then summed / the largest taken")
    summary_splits: int = _field(
        1, "sparse: min/max key summaries per block, one per block_size/summary_splits-token "
        "sub-block (a power of two <= block_size); a block scores the largest of its "
        "sub-blocks' bounds, each a tighter bound on its own tokens. Blocks, fetches and working "
        "sets stay whole blocks; the summaries' device bytes (and scoring work) grow "
        "summary_splits times")
    rerank: float = _field(
        float("inf"), "sparse: 0 (off) or c >= 1: the best c*top_k blocks by summary score are "
        "re-ranked by the predicting query's attention over their keys (rerank_source: the "
        "device's key copy or the host tier; c*top_k*block_size keys per KV head, layer and "
        "step); inf (the default): every complete block ranked by its attention mass over the "
        "key copy, no summary bound first (the copy read in order; as fast as c=2 on a 2-core "
        "CPU and closer to the oracle: docs/results/2026-12-07-rerank-every-block.md). The "
        "Quest bound alone (0) loses needles and perplexity at K=128; predictor=oracle, which "
        "ranks by attention already, ignores it", inf=True)
    rerank_source: str = _field(
        "int8", "sparse, with rerank: where the re-ranking reads its candidates' keys. host: "
        "the host tier (exact); int8 / int4: a device copy of every complete block's post-RoPE "
        "keys, 8 or 4 bits with one scale per block and KV head, written with its summary "
        "(charged to device_kv_budget beside the summaries: B*d+4 bytes per block, layer and "
        "KV head for int8, B*d/2+4 for int4)")
    prefetch: str = _field(
        "sync", "sparse: async runs each layer's next-step selection and fetch in the "
        "background (worker threads on the CPU, a CUDA stream per stage on a GPU); sync runs "
        "them inline "
        "(the default: on a 2-core CPU the workers compete with the model for the cores)")
    prefetch_group: int = _field(
        0, "sparse, async: layers per prefetch job (the next step's "
        "selection, submitted once the last of them has attended, and a completed block's "
        "fill); 0: half the model's layers (two jobs per step, each running while the other "
        "half computes: fewer, larger jobs cost the foreground less than one per layer)")
    remote_store: str = _field(
        "none", "sparse: the remote tier under the host tier. none: the host holds every "
        "block; inprocess: an in-process store; inprocess://NAME: one shared by the engines "
        "of this process that name it (prefill and decode workers); mooncake://HOST:PORT: a "
        "Mooncake Store whose master listens there. With a store, a request's complete prompt "
        "blocks go to it when its prefill is done and the host keeps a bounded cache of them "
        "(f_host)")
    remote_lend: int | str = _field(
        "256MiB", "mooncake: host memory this engine lends to the store, where its puts (a "
        "prefill worker's prompt blocks) can land; 0 on a decode-only worker, so that prompt "
        "blocks stay on the prefill host")
    prefix_cache_bytes: int | str = _field(
        "1GiB", "sparse with a remote_store: bytes of complete prompt blocks this engine keeps "
        "in the store after their requests end (the prefix cache, LRU), so that a later prompt "
        "with the same prefix on any engine sharing the store reads them instead of computing "
        "them; per engine (N prefill workers: at most N times this); 0: cache nothing (still "
        "reuses what other engines cached)")
    f_host: float = _field(
        1.0, "sparse with a remote_store: decode-host residency ratio of prompt blocks; a "
        "request keeps ceil(f_host*P) of its P complete prompt blocks on the host (at least "
        "min(P, top_k * KV heads), so that its working sets fit) plus all its generated "
        "blocks, and fetches evicted ones again from the store")

    handoff_summaries: str = _field(
        "exact", "sparse, on a prefill worker: how a hand-over sends the block summaries. "
        "exact: as this engine keeps them (summary_dtype); int8: 8-bit codes with one float32 "
        "scale per block and KV head, kmin rounded down and kmax up so that they still bound "
        "every key (Quest's score stays an upper bound, a looser one): about half the "
        "summaries' bytes (at 7K tokens and top_k=32 they are most of a slab hand-over); the "
        "decode worker's selections may then differ from one engine's")
    summary_dtype: str = _field(
        "auto", "sparse: dtype of the block summaries (kmin/kmax). auto: bfloat16 for float32 "
        "K/V, else the KV dtype; float16 or bfloat16 halve their device memory, the bytes a "
        "hand-over sends and what scoring reads each step (rounded outward, so that they still "
        "bound every key of their block; no measured loss of accuracy against float32 ones)")
    prefault_kv: bool = _field(
        False, "write every page of the KV pools (and summaries) when the engine starts, so "
        "that the first requests do not wait for the OS to map that memory in (on a VM whose "
        "fresh memory maps in at ~250 MB/s this is seconds per GiB: servers, benchmarks)")

    def __post_init__(self) -> None:
        check_field_types(self)
        check_cache(self)

    def summary_torch_dtype(self, kv_dtype: torch.dtype) -> torch.dtype:
        if self.summary_dtype != "auto":
            return DTYPES[self.summary_dtype]
        # float32 summaries double what scoring reads for bounds that bf16 ones, rounded
        # outward, keep as well (fidelity at 4K and 7K tokens: no measured difference)
        return torch.bfloat16 if kv_dtype == torch.float32 else kv_dtype

    @property
    def slab_blocks(self) -> int:
        """sparse: device blocks of a request's slab: its K working-set slots, the active
        block, and a draft block where each step's drafts' K/V sit for attention to read."""
        return self.top_k + 2

    @property
    def reranks(self) -> bool:
        """sparse: whether selections re-rank their candidates (rerank on, summary scores to
        re-rank: not predictor=oracle)."""
        return self.kv_mode == "sparse" and self.rerank > 0 and self.predictor != "oracle"

    @property
    def bounds(self) -> bool:
        """sparse: whether selections bound blocks by their summaries (kmin/kmax on the
        device): not where every block is re-ranked (rerank=inf) or the oracle ranks."""
        return self.kv_mode == "sparse" and self.predictor != "oracle" and not (
            self.reranks and math.isinf(self.rerank))

    @property
    def key_copy(self) -> bool:
        """sparse: whether the device holds a key copy (a rerank from int8 or int4)."""
        return self.reranks and self.rerank_source in ("int8", "int4")

    @property
    def key_copy_bits(self) -> int:
        """sparse, with a key copy: bits per key element (8 or 4)."""
        return int(self.rerank_source[3:])

    @property
    def fetch_cap(self) -> int:
        """Newly admitted blocks per head, layer and step once a working set is seeded."""
        f_hbm = 0.05 if self.f_hbm == "auto" else self.f_hbm  # auto starts here
        return math.ceil(f_hbm * self.top_k)


SPECULATIVE = ("off", "accept")
FORCED_DRAFTS = ("known", "guessed")


@dataclass
class SpecConfig:
    """Draft tokens: the lookahead predictor's queries, and optionally speculative decoding."""

    drafter: str = _field(
        "resync", f"where draft tokens come from: {DRAFTERS} (resync: best measured recall of "
        "the training-free ones), eagle:DIR (a head made by `oasiskv train-drafter`) or "
        "resync-eagle:DIR (the self chain while its draft was right, the head after a miss)")
    draft_model: str | None = _field(
        None, "drafter=model: a small model sharing the tokenizer (alias, HF dir or .gguf)",
        path=True)
    num_drafts: int = _field(
        1, "drafts per request and step: the lookahead predicts with the first (greedy) or "
        "the drafts' mean weighted by their probability of being sampled (temperature > 0); "
        "the draft chain continues from whichever was right")
    speculative: str = _field(
        "off", "accept: verify the first draft and keep it when right, so a step can emit two "
        "tokens (rejection sampling keeps the output distribution unchanged)")
    forced_drafts: str = _field(
        "known", "a request with forced tokens (teacher forcing): known = its next forced token "
        "is its only draft (the engine knows it); guessed = the drafter guesses it, as in "
        "generation")

    def __post_init__(self) -> None:
        check_field_types(self)
        head = head_dir(self.drafter)
        if head is not None:
            if not (Path(head) / "config.json").is_file():
                raise ValueError(f"drafter {self.drafter!r}: {head} holds no trained head "
                                 "(config.json); make one with `oasiskv train-drafter`")
        elif self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, eagle:DIR or "
                             f"resync-eagle:DIR, got {self.drafter!r}")
        if self.drafter == "model" and not self.draft_model:
            raise ValueError("drafter 'model' needs draft_model (a model alias, HF directory or "
                             ".gguf file sharing the target's tokenizer)")
        if self.num_drafts <= 0:
            raise ValueError(f"num_drafts must be positive, got {self.num_drafts}")
        if self.forced_drafts not in FORCED_DRAFTS:
            raise ValueError(f"forced_drafts must be one of {FORCED_DRAFTS}, "
                             f"got {self.forced_drafts!r}")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative must be one of {SPECULATIVE}, "
                             f"got {self.speculative!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = _field(64, "most requests in one running batch")
    max_num_batched_tokens: int = _field(
        2048, "most tokens one step processes; longer prompts are prefilled in chunks of this")
    max_model_len: int | None = _field(
        None, "longest context (prompt + output) a request may reach; default: the model's")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass
class EngineConfig:
    model: str = _field("smollm2-135m", "model alias, HF directory or .gguf file", path=True)
    dtype: str = _field("float32", "weights and KV dtype: float32, bfloat16, float16")
    device: str = _field("cpu", "torch device: cpu, cuda, cuda:1 ...")
    num_threads: int | None = _field(None, "torch CPU threads (default: torch's choice)")
    seed: int = _field(0, "seed for sampling when a request gives none")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(set(DTYPES))}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
        check_device_present(device)
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.cache.kv_mode == "sparse" and self.spec.num_drafts > self.cache.block_size:
            raise ValueError(f"num_drafts is {self.spec.num_drafts}; a sparse request's drafts "
                             f"share one block (block_size {self.cache.block_size})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Nested config dataclasses whose fields are flattened into keywords / flags."""
        return {"cache": CacheConfig, "scheduler": SchedulerConfig, "spec": SpecConfig}

    @classmethod
    def flat_fields(cls) -> list[tuple[str | None, dataclasses.Field]]:
        """(section or None, field) for every user-settable field."""
        out: list[tuple[str | None, dataclasses.Field]] = [
            (None, f) for f in dataclasses.fields(cls) if f.name not in cls.sections()]
        for section, dc in cls.sections().items():
            out += [(section, f) for f in dataclasses.fields(dc)]
        return out

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        owner = {f.name: section for section, f in cls.flat_fields()}
        unknown = sorted(set(kwargs) - set(owner))
        if unknown:
            raise ValueError(f"unknown config option(s) {unknown}; known: {sorted(owner)}")
        top = {k: v for k, v in kwargs.items() if owner[k] is None}
        for section, dc in cls.sections().items():
            top[section] = dc(**{k: v for k, v in kwargs.items() if owner[k] == section})
        return cls(**top)
