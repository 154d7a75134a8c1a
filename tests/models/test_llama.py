"""Our Llama-family model equals transformers' on prefill and incremental decode."""

import pytest
import torch
import transformers
from conftest import build_model_dir

from oasiskv.bench.peers import cache_kwargs, past_cache
from oasiskv.config import ModelConfig
from oasiskv.engine import runner as runner_module
from oasiskv.engine.runner import ModelRunner, allocate_kv
from oasiskv.kv.blocks import BlockPool, is_contiguous
from oasiskv.layers import gemv
from oasiskv.layers.linear import Linear, pack_linears
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.models.loader import load_checkpoint
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence

CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-rope-llama3": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-rope-linear": ("llama", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


def ours_and_hf(tmp_path, case, device="cpu"):
    arch, overrides = CASES[case]
    path = build_model_dir(tmp_path, arch, **overrides)
    ckpt = load_checkpoint(path)
    model = LlamaForCausalLM(ModelConfig.from_hf(ckpt.hf_config))
    model.load_weights(ckpt.state_dict)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model.to(device).eval(), hf.to(device)


def run_chunks(model, tokens, chunks, num_blocks=64, scatter=False, dtype=torch.float32):
    """Feeds `tokens` through our runner in the given chunk sizes; returns logits [T, V] and
    the block table used (the KV pool on the model's device)."""
    pool = BlockPool(num_blocks, 16)
    device = model.lm_head.weight.device
    runner = ModelRunner(model, allocate_kv(model.config, num_blocks, 16, dtype, device), 16)
    seq = Sequence("s", list(tokens), len(tokens), SamplingParams())
    logits = []
    for n in chunks:
        end = seq.num_computed_tokens + n
        pool.grow(seq.block_table, end)
        if scatter:  # take the block after ours: the table fragments -> gather path
            pool.grow([seq.block_table[-1]], 32)
        rows = list(range(n))
        logits.append(runner.run([(seq, n)], rows).logits)
        seq.num_computed_tokens = end
    return torch.cat(logits), seq.block_table


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_logits_match_transformers(tmp_path, case, test_device):
    model, hf = ours_and_hf(tmp_path, case, test_device)
    torch.manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (90,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens], device=test_device)).logits[0]  # [T, V]
    prefill_then_decode, table = run_chunks(model, tokens, [70] + [1] * 20)
    assert is_contiguous(table)  # the in-place view path
    torch.testing.assert_close(prefill_then_decode, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_runs", [runner_module.MAX_KV_RUNS, 0])  # run by run; gathered
def test_chunked_and_fragmented_kv_match_transformers(tmp_path, monkeypatch, max_runs):
    monkeypatch.setattr(runner_module, "MAX_KV_RUNS", max_runs)
    views, view = [], ModelRunner._view
    monkeypatch.setattr(ModelRunner, "_view", lambda *a: views.append(view(*a)) or views[-1])
    model, hf = ours_and_hf(tmp_path, "qwen2")
    tokens = torch.randint(0, model.config.vocab_size, (100,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    got, table = run_chunks(model, tokens, [33, 17, 40, 1, 1, 8], scatter=True)
    assert not is_contiguous(table)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    decodes = [v for v in views if v.num_queries == 1]
    assert len(decodes) == 2 and all((len(v.kv_runs or []) > 1) == (max_runs > 0)
                                     and (v.kv_slots is None) == (max_runs > 0) for v in decodes)


def test_hf_incremental_decode_with_cache_agrees(tmp_path):
    """The same comparison against HF's own KV-cached decode, token by token."""
    model, hf = ours_and_hf(tmp_path, "llama")
    tokens = torch.randint(0, model.config.vocab_size, (40,)).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:30]]), use_cache=True)
        ref = [out.logits[0, -1]]
        past = past_cache(out)
        for t in tokens[30:]:
            out = hf(torch.tensor([[t]]), **cache_kwargs(hf, past), use_cache=True)
            past = past_cache(out)
            ref.append(out.logits[0, -1])
    got, _ = run_chunks(model, tokens, [30] + [1] * 10)
    torch.testing.assert_close(got[[29] + list(range(30, 40))], torch.stack(ref),
                               atol=1e-4, rtol=1e-4)


def test_bf16_decode_with_the_linear_kernel_matches_onednn_and_transformers(tmp_path,
                                                                          monkeypatch):
    """bf16, packed as the engine packs: the decode steps' linears (one row) by the kernel
    (layers/gemv.py) give the logits oneDNN's give, to bf16 rounding, and transformers' fp32
    ones to bf16's error over the model; prefill (70 rows) takes oneDNN either way."""
    monkeypatch.setenv(gemv.ENV, "kernel")
    if gemv.extension() is None:
        pytest.skip("the linear kernel does not run here (no AVX-512 BF16)")
    model, hf = ours_and_hf(tmp_path, "qwen2")  # q/k/v biases
    tokens = torch.randint(0, model.config.vocab_size, (90,)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0, 69:]  # [21, V] the decode steps'
    model = model.to(torch.bfloat16)
    got, calls, real = {}, [], gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda p, x: calls.append(x.shape[0]) or real(p, x))
    for choice in ("onednn", "kernel"):
        monkeypatch.setenv(gemv.ENV, choice)
        pack_linears(model)
        kernel = [m.gemv_packed is not None for m in model.modules() if isinstance(m, Linear)]
        assert all(kernel) == (choice == "kernel") and any(kernel) == all(kernel)
        got[choice] = run_chunks(model, tokens, [70] + [1] * 20, dtype=torch.bfloat16)[0][69:]
    # per decode step: 2 layers x (qkv, o, gate_up, down) and lm_head, one row each
    assert calls == [1] * 20 * 9
    scale = ref.abs().max().item()
    torch.testing.assert_close(got["kernel"].float(), got["onednn"].float(), rtol=0,
                               atol=0.02 * scale)
    torch.testing.assert_close(got["kernel"].float(), ref, rtol=0, atol=0.05 * scale)


def test_fused_projections_load_from_separate_ones(tmp_path):
    """q/k/v and gate/up load stacked into the fused products; a checkpoint missing one part
    is refused with the fused projection and the parts named."""
    path = build_model_dir(tmp_path, "qwen2")  # q/k/v biases too
    ckpt = load_checkpoint(path)
    model = LlamaForCausalLM(ModelConfig.from_hf(ckpt.hf_config))
    model.load_weights(ckpt.state_dict)
    layer, sd = model.model.layers[0], ckpt.state_dict
    prefix = "model.layers.0."
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat(
        [sd[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat(
        [sd[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(
        [sd[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]))
    broken = {k: v for k, v in sd.items() if k != prefix + "self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.self_attn.qkv_proj.weight'\]"
                                         r".*unexpected .*q_proj.weight"):
        LlamaForCausalLM(ModelConfig.from_hf(ckpt.hf_config)).load_weights(broken)
