"""Load a checkpoint (HF safetensors directory or GGUF file) into HF-named tensors.

Both sources end up as the same `Checkpoint`: a transformers-style config dict, a state dict
with transformers' Llama parameter names, and a tokenizer.
"""

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers import __version__ as hf_version


@dataclass
class Checkpoint:
    hf_config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: PreTrainedTokenizerBase


def load_checkpoint(path: Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path, dtype)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, dtype)
    raise ValueError(f"{path}: not an HF model directory or a .gguf file")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: holds {type(data).__name__}, not a JSON object")
    return data


# The sizes ModelConfig.from_hf reads without a default: each a positive integer.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads")


def _check_sizes(cfg: dict, where: str, names: dict[str, str] | None = None) -> None:
    """Refuses a config whose sizes are missing or not positive integers, naming them all;
    `names`: what each key is called where it comes from (GGUF metadata keys)."""
    keys = _SIZES + tuple(k for k in ("max_position_embeddings",) if k in cfg)  # optional
    bad = [f"{(names or {}).get(k, k)}={cfg.get(k)!r}" for k in keys
           if not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool) or cfg[k] <= 0]
    if bad:
        raise ValueError(f"{where}: missing or not a positive integer: {', '.join(bad)}")


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


# ---------------------------------------------------------------- HF directory


def _load_hf_dir(path: Path, dtype: torch.dtype) -> Checkpoint:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: missing config.json")
    hf_config = _read_json(path / "config.json")
    gen_config = path / "generation_config.json"
    if gen_config.is_file():  # chat models list their end-of-turn ids here (e.g. <|eot_id|>)
        eos = _read_json(gen_config).get("eos_token_id")
        extra = set(_as_list(eos)) - set(_as_list(hf_config.get("eos_token_id")))
        if extra:
            hf_config["eos_token_id"] = sorted({*_as_list(hf_config.get("eos_token_id")), *extra})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no weight_map (tensor name -> file)")
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no safetensors files (model.safetensors or an index)")
    state_dict = {}
    for f in files:
        try:
            tensors = load_file(f)
        except (SafetensorError, OSError) as e:  # a truncated or corrupted file
            raise ValueError(f"{f}: not a readable safetensors file, truncated or corrupted? "
                             f"({e})") from None
        state_dict.update({k: _cast(v, dtype) for k, v in tensors.items()})
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((path / f).is_file() for f in tokenizer_files):
        raise ValueError(f"{path}: no tokenizer files ({', '.join(tokenizer_files)})")
    _check_sizes(hf_config, f"{path / 'config.json'}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # `tokenizers` raises a bare Exception on a spoiled tokenizer.json
        raise ValueError(f"{path}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
    return Checkpoint(hf_config, state_dict, tokenizer)


# ---------------------------------------------------------------- GGUF file

# general.architecture -> (HF architecture, model_type, q/k rows permuted by llama.cpp)
_GGUF_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama.cpp stores llama3 rope scaling only as this per-frequency factor tensor (no metadata),
# and HF Llama has no such parameter.
_ROPE_FREQS = "rope_freqs.weight"


def _hf_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")  # suffix: weight | bias
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m is None or m[2] not in _LAYER_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no HF Llama-family counterpart")
    return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{suffix}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time q/k row order.

    llama.cpp stores each head's rotary halves interleaved (GPT-J style):
    reshape(n_head, 2, d/2, ...).swapaxes(1, 2). This is the inverse.
    """
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _f32(v: Any) -> float:
    # GGUF stores float32: its shortest str restores e.g. 1e-5 rather than 9.99999974e-06.
    return float(str(np.float32(v)))


def _gguf_config(meta: dict[str, Any], names: set[str], n_tokens: int) -> tuple[dict, bool]:
    """HF-style config dict from GGUF metadata, and whether q/k rows need un-permuting."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_GGUF_ARCHS)}"
        )
    hf_arch, model_type, permuted = _GGUF_ARCHS[arch]
    # llama.cpp writes Mistral as "llama" (same graph); only the name tells them apart.
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        hf_arch, model_type = _GGUF_ARCHS["mistral"][:2]

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    gguf_keys = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
                 "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
                 "max_position_embeddings": "context_length"}
    sizes = {hf: key(g) for hf, g in gguf_keys.items()}
    sizes["vocab_size"] = key("vocab_size", n_tokens or None)
    spelled = {hf: f"{arch}.{g}" for hf, g in gguf_keys.items()}
    spelled["vocab_size"] = f"{arch}.vocab_size (or tokenizer.ggml.tokens)"
    _check_sizes(sizes, "GGUF metadata", spelled)
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size", n_tokens),
        # llama.cpp writes output.weight only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if model_type != "qwen2":  # Qwen2's q/k/v bias is implied by the architecture
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {
            "rope_type": scaling,
            "factor": _f32(key("rope.scaling.factor", 1.0)),
        }
        if (ctx := key("rope.scaling.original_context_length")) is not None:
            cfg["rope_scaling"]["original_max_position_embeddings"] = ctx
    return cfg, permuted


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    # Skip the big token arrays: decoding ~100k strings costs seconds and only their count matters.
    big = (
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.scores",
    )
    return {k: f.contents() for k, f in reader.fields.items() if k not in big}


def _load_gguf(path: Path, dtype: torch.dtype) -> Checkpoint:
    try:
        reader = GGUFReader(path)
        meta = _metadata(reader)
    except (ValueError, IndexError, KeyError, OSError) as e:  # gguf's parse errors
        raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupted? "
                         f"({type(e).__name__}: {e})") from None
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    try:
        cfg, permuted = _gguf_config(meta, names, len(tokens.data) if tokens else 0)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    state_dict = {}
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            msg = f"{path.name}: ignoring {_ROPE_FREQS} (llama3 rope scaling is not reconstructed)"
            warnings.warn(msg, stacklevel=2)
            continue
        # GGUF shapes list the fastest dimension first: torch's shape is the reverse.
        w = dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if permuted and kind in heads:
            w = _unpermute(w, heads[kind])
        state_dict[_hf_name(t.name)] = _cast(torch.from_numpy(np.array(w, np.float32)), dtype)
    tokenizer = _gguf_tokenizer(path, meta.get("tokenizer.chat_template"))
    return Checkpoint(cfg, state_dict, tokenizer)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model (an HF directory or a .gguf file) without its weights."""
    path = Path(path)
    return _gguf_tokenizer(path, None) if path.suffix == ".gguf" else \
        AutoTokenizer.from_pretrained(path)


def _cache_root() -> Path:
    return Path(os.environ.get("OASISKV_CACHE", Path.home() / ".cache" / "oasiskv"))


def _gguf_tokenizer(path: Path, chat_template: str | None) -> PreTrainedTokenizerBase:
    """transformers' GGUF tokenizer conversion (seconds), cached as a saved tokenizer (~0.3 s)."""
    stat = path.resolve().stat()
    ident = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{hf_version}"
    cache = _cache_root() / "tokenizers" / hashlib.sha256(ident.encode()).hexdigest()[:32]
    if (cache / "oasiskv.json").is_file():
        # save_pretrained drops add_bos/eos_token; passing them back rebuilds the post-processor.
        flags = json.loads((cache / "oasiskv.json").read_text())
        tok = AutoTokenizer.from_pretrained(cache, **flags)
    else:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        flags = {k: bool(getattr(tok, k, False)) for k in ("add_bos_token", "add_eos_token")}
        _save_atomic(tok, flags, cache)
    if tok.chat_template is None and chat_template:
        tok.chat_template = chat_template
    return tok


def _save_atomic(tok: PreTrainedTokenizerBase, flags: dict, cache: Path) -> None:
    # Write to a sibling temp dir and rename, so a concurrent or killed run never sees half a cache.
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache.parent))
        tok.save_pretrained(tmp)
        (tmp / "oasiskv.json").write_text(json.dumps(flags))
        try:
            tmp.rename(cache)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # the cache is an optimisation only (e.g. read-only home)
