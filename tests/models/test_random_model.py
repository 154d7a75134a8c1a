"""`random:` models (`models/random_model.py`): their layers are the ones transformers builds
from the same published config (compared on the meta device: no 8B allocation), their seeded
weights repeat, the byte-level stand-in tokenizer round-trips text, a tiny one generates
through `LLM(...)`, and a bench on one says in its header that its tokens are meaningless."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from oasiskv import LLM, SamplingParams
from oasiskv.cli import main
from oasiskv.config import EngineConfig
from oasiskv.engine.weights import load_model
from oasiskv.models.byte_tokenizer import BOS_ID, EOS_ID, byte_tokenizer
from oasiskv.models.llama import stack_fused
from oasiskv.models.random_model import CONFIGS, init_random, random_config

HF_CLASSES = {"LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}


def test_the_published_shapes():
    """The table's numbers (models/random_model.py), against the configs' own sizes."""
    q, ll = CONFIGS["qwen3-8b"], CONFIGS["llama-3.1-8b"]
    assert (q["num_hidden_layers"], q["hidden_size"], q["intermediate_size"],
            q["num_attention_heads"], q["num_key_value_heads"], q["head_dim"],
            q["vocab_size"], q["max_position_embeddings"]) == (36, 4096, 12288, 32, 8, 128,
                                                               151936, 40960)
    assert (ll["num_hidden_layers"], ll["hidden_size"], ll["intermediate_size"],
            ll["num_attention_heads"], ll["num_key_value_heads"], ll["head_dim"],
            ll["vocab_size"], ll["max_position_embeddings"]) == (32, 4096, 14336, 32, 8, 128,
                                                                 128256, 131072)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layers_equal_what_transformers_builds_from_the_same_config(name):
    cfg = random_config(f"random:{name}")
    config_cls, model_cls = HF_CLASSES[cfg["architectures"][0]]
    with torch.device("meta"):
        hf = model_cls(config_cls(**cfg))
    want = {k: tuple(v.shape) for k, v in stack_fused(dict(hf.named_parameters())).items()}
    # the engine's own path, on the meta device: nothing of 8B is allocated
    model, mc, tok = load_model(EngineConfig(model=f"random:{name}", device="meta",
                                             dtype="bfloat16"))
    got = {k: tuple(v.shape) for k, v in model.named_parameters()}
    assert got == want
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert mc.vocab_size == cfg["vocab_size"] and tok.bos_token_id == BOS_ID
    billions = sum(v.numel() for v in hf.parameters()) / 1e9
    assert name == "tiny" or 7.5 < billions < 8.3  # an 8B model (Qwen3-8B: 8.19B)


def test_seeded_weights_repeat_in_the_engines_dtype():
    def weights(dtype="float32"):
        model, _, _ = load_model(EngineConfig(model="random:tiny", dtype=dtype))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    a, b = weights(), weights()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    w = a["model.layers.0.self_attn.qkv_proj.weight"]
    assert 0.015 < float(w.std()) < 0.025 and abs(float(w.mean())) < 0.005  # N(0, 0.02)
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert all(v.dtype == torch.bfloat16 for k, v in weights("bfloat16").items()
               if v.is_floating_point() and "rotary" not in k)
    model, _, _ = load_model(EngineConfig(model="random:tiny"))
    init_random(model, seed=1)
    assert not torch.equal(model.state_dict()["lm_head.weight"], a["lm_head.weight"])


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_the_stand_in_tokenizer_round_trips_text_as_bytes(text):
    tok = byte_tokenizer()
    assert tok.encode(text, add_special_tokens=False) == list(text.encode())
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and tok.decode(ids, skip_special_tokens=True) == text
    assert (len(tok), tok.eos_token_id) == (258, EOS_ID)


def test_a_tiny_random_model_generates_through_llm(test_device):
    llm = LLM("random:tiny", device=test_device, device_kv_budget="4MiB")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first, again = (llm.generate(["hello, world"], greedy, use_tqdm=False)[0]
                    for _ in range(2))
    assert len(first.token_ids) == 12 and first.token_ids == again.token_ids
    assert isinstance(first.text, str) and first.prompt_token_ids[0] == BOS_ID
    sparse = LLM("random:tiny", device=test_device, kv_mode="sparse", top_k=8,
                 device_kv_budget="4MiB")  # 8 blocks of 16 cover the whole context
    prompt = list(range(1, 90))
    assert (sparse.generate([prompt], greedy, use_tqdm=False)[0].token_ids
            == llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids)


def test_unknown_random_model_and_file_needs_are_clear_errors(capsys):
    with pytest.raises(ValueError, match=r"unknown random model 'random:gpt5'; known: "
                                         r"random:qwen3-8b"):
        LLM("random:gpt5")
    # bench decode's HF rows need a checkpoint
    assert main(["bench", "decode", "--model", "random:tiny", "--context", "32",
                 "--batch", "1", "--output-len", "2"]) == 2
    assert "random:tiny' has random weights and no file" in capsys.readouterr().err


def test_a_bench_says_in_its_header_that_the_tokens_are_meaningless(capsys):
    assert main(["bench", "decode", "--model", "random:tiny", "--context", "32", "--batch",
                 "1", "--output-len", "2", "--no-hf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("> NOTE: model random:tiny has random weights and a byte-level "
                          "stand-in tokenizer: its tokens are meaningless, accuracy")


@pytest.mark.parametrize("command", [["eval", "passkey"], ["eval", "ruler"],
                                     ["eval", "recall"], ["bench", "pareto"]])
def test_evals_refuse_random_models(command, capsys):
    assert main([*command, "--model", "random:tiny"]) == 2  # tiny: no 8B built if a refusal breaks
    err = capsys.readouterr().err
    assert "measures accuracy, and random:tiny has random weights" in err, err
    assert err.count("\n") == 1
