"""The bad files of the census (tests/test_census.py): a tiny model's directory spoiled one way
each, GGUFs without size keys or cut short, draft heads with wrong fields or shapes, prompt
files that are empty or not UTF-8."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.spec.eagle import EagleConfig, EagleHead


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _write_gguf(path: Path, sizes: bool) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    if sizes:
        w.add_vocab_size(8)
        w.add_context_length(64)
        w.add_embedding_length(4)
        w.add_feed_forward_length(8)
        w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _head_variant(head: Path, dst: Path, edit: Callable[[dict], None] | None = None,
                  cut: bool = False) -> Path:
    shutil.copytree(head, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if cut:
        w = dst / "head.safetensors"
        w.write_bytes(w.read_bytes()[:200])
    return dst


def make_bad_files(d: Path, tiny_llama: Path, target: LlamaForCausalLM) -> dict[str, str]:
    """Writes every bad file under `d`; returns name -> path. `target`: the tiny model loaded
    (the draft heads are made for it)."""
    f: dict[str, Path] = {}
    f["no_config"] = _copy(tiny_llama, d / "no_config")
    (f["no_config"] / "config.json").unlink()
    f["bad_json"] = _copy(tiny_llama, d / "bad_json")
    (f["bad_json"] / "config.json").write_text("{not json")
    f["config_fields"] = _copy(tiny_llama, d / "config_fields")
    cfg = json.loads((tiny_llama / "config.json").read_text())
    (f["config_fields"] / "config.json").write_text(
        json.dumps({k: v for k, v in cfg.items() if k != "num_attention_heads"}))
    f["bad_tokenizer"] = _copy(tiny_llama, d / "bad_tokenizer")
    (f["bad_tokenizer"] / "tokenizer.json").write_text("{broken")
    f["truncated_st"] = _copy(tiny_llama, d / "truncated_st")
    weights = f["truncated_st"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    f["corrupt_st"] = _copy(tiny_llama, d / "corrupt_st")
    weights = f["corrupt_st"] / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])  # a header length past the end
    f["gguf_meta"] = _write_gguf(d / "meta.gguf", sizes=False)
    whole = _write_gguf(d / "whole.gguf", sizes=True).read_bytes()
    f["gguf_cut_header"] = d / "cut_header.gguf"
    f["gguf_cut_header"].write_bytes(whole[:60])
    f["gguf_cut_data"] = d / "cut_data.gguf"
    f["gguf_cut_data"].write_bytes(whole[:-40])
    # a (random) draft head made for the tiny model, then spoiled in one way each
    cfg = EagleConfig.for_target("tiny", target.config, draft_vocab=64, aux_layers=[0, 1],
                                 window=32)
    head = d / "head"
    EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight,
              torch.arange(64)).save(head)
    f["head_missing"] = _head_variant(head, d / "head_missing", lambda c: c.pop("head_dim"))
    f["head_unknown"] = _head_variant(head, d / "head_unknown", lambda c: c.update(heads=4))
    f["head_type"] = _head_variant(head, d / "head_type", lambda c: c.update(hidden_size="64"))
    f["head_shape"] = _head_variant(head, d / "head_shape",
                                    lambda c: c.update(intermediate_size=100))
    f["head_other"] = _head_variant(head, d / "head_other",
                                    lambda c: c.update(target="other", vocab_size=999))
    f["head_cut"] = _head_variant(head, d / "head_cut", cut=True)
    f["empty_prompt"] = d / "empty.txt"
    f["empty_prompt"].write_bytes(b"")
    f["latin1_prompt"] = d / "latin1.txt"
    f["latin1_prompt"].write_bytes("Café au lait".encode("latin-1"))
    return {k: str(v) for k, v in f.items()}
