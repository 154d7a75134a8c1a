"""CacheConfig's rules (`config_checks.check_cache`), applied to a config whose one field was
changed after construction: each broken rule names its field; budgets are parsed in place."""

import dataclasses

import pytest
import torch

from oasiskv.cli import main
from oasiskv.config import CacheConfig, EngineConfig
from oasiskv.config_checks import DTYPES, KV_MODES, PREDICTORS, check_cache


@pytest.mark.parametrize("changes, message", [
    ({"block_size": 12}, r"block_size must be a positive power of two, got 12"),
    ({"device_kv_budget": 0}, r"device_kv_budget must be positive"),
    ({"host_kv_budget": "lots"}, r"host_kv_budget: cannot read 'lots' as a size"),
    ({"kv_mode": "paged"}, r"kv_mode must be one of \('dense', 'sparse'\)"),
    ({"predictor": "psychic"}, r"predictor must be one of"),
    ({"top_k": 0}, r"top_k must be a positive number of blocks"),
    ({"f_hbm": "most"}, r"f_hbm must be a fraction in \(0, 1\] or auto, got 'most'"),
    ({"f_hbm": 1.5}, r"f_hbm must be in \(0, 1\] or auto, got 1.5"),
    ({"prefetch": "later"}, r"prefetch must be one of"),
    ({"prefetch_group": -1}, r"prefetch_group must be >= 0"),
    ({"sink_blocks": 100, "top_k": 100}, r"must leave room in top_k \(100\)"),
    ({"recent_blocks": -1}, r"recent_blocks must be >= 0"),
    ({"dense_layers": -1}, r"dense_layers must be >= 0"),
    ({"summary_dtype": "int8"}, r"summary_dtype 'int8' is not auto"),
    ({"score_alpha": -0.5}, r"score_alpha must be >= 0"),
    ({"score_aggregation": "max"}, r"score_aggregation must be one of"),
    ({"score_aggregation": "softmax-sum", "predictor": "oracle"}, r"predictor=oracle has none"),
    ({"summary_splits": 3}, r"summary_splits must be a power of two from 1 to block_size"),
    ({"rerank": 0.5}, r"rerank must be 0 \(off\) or >= 1"),
    ({"rerank": float("-inf")}, r"rerank must be 0 \(off\) or >= 1"),
    ({"rerank": float("nan")}, r"rerank must be 0 \(off\) or >= 1"),
    ({"rerank_source": "fp8"}, r"rerank_source must be one of"),
    ({"rerank_source": "int4", "block_size": 1}, r"block_size must be even, got 1"),
    ({"remote_store": "redis://h:1"}, r"remote_store must be none, inprocess"),
    ({"remote_store": "inprocess", "kv_mode": "dense"}, r"needs kv_mode=sparse"),
    ({"remote_store": "inprocess", "rerank_source": "host"}, r"rerank_source=host reads"),
    ({"remote_store": "inprocess", "dense_layers": 1}, r"dense_layers with remote_store"),
    ({"remote_lend": "-1"}, r"remote_lend"),
    ({"f_host": 0.0}, r"f_host must be in \(0, 1\], got 0.0"),
    ({"f_host": 0.5}, r"f_host=0.5 < 1 needs a remote store"),
    ({"handoff_summaries": "int4"}, r"handoff_summaries must be one of \('exact', 'int8'\)"),
])
def test_each_broken_rule_names_its_field(changes, message):
    c = CacheConfig(kv_mode="sparse")
    for name, value in changes.items():
        setattr(c, name, value)
    with pytest.raises(ValueError, match=message):
        check_cache(c)


def test_a_valid_config_passes_and_its_text_values_are_parsed_in_place():
    c = CacheConfig()
    before = dataclasses.asdict(c)
    check_cache(c)
    assert dataclasses.asdict(c) == before
    c.device_kv_budget, c.host_kv_budget, c.f_hbm = "2MiB", "1e6", "0.25"
    check_cache(c)
    assert (c.device_kv_budget, c.host_kv_budget, c.f_hbm) == (2 * 2**20, 10**6, 0.25)
    c.f_hbm = "auto"
    check_cache(c)
    assert c.f_hbm == "auto"
    c.rerank = float("inf")  # every block re-scored: the one field that takes +inf
    check_cache(c)
    assert CacheConfig(rerank=float("inf")).rerank == float("inf")
    for name in ("rerank", "score_alpha"):  # -inf nowhere, +inf only where a field says
        for value in (float("-inf"), float("nan")) + ((float("inf"),) if name != "rerank" else ()):
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                CacheConfig(**{name: value})


def test_the_values_fields_take():
    assert KV_MODES == ("dense", "sparse")
    assert set(PREDICTORS) == {"lookahead", "previous", "exact", "oracle"}
    assert {str(d) for d in DTYPES.values()} == {"torch.float32", "torch.float16",
                                                 "torch.bfloat16"}
    assert CacheConfig(summary_dtype="bf16").summary_torch_dtype(DTYPES["fp32"]) == DTYPES["bf16"]


@pytest.mark.parametrize("device, built, message", [
    ("cuda", True, r"device 'cuda': this machine has no cuda device \(torch .*\); use "
                   r"device='cpu'"),
    ("cuda:1", False, r"device 'cuda:1': this torch build has no CUDA \(a CPU-only wheel\)"),
])
def test_cuda_is_refused_at_the_config_where_torch_has_none(monkeypatch, device, built,
                                                            message):
    """Whatever this machine has: torch told that CUDA is missing (and whether the wheel was
    built with it) refuses the device when the config is made, not at the first tensor."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    with pytest.raises(ValueError, match=message):
        EngineConfig(device=device)
    EngineConfig(device="cpu")  # the CPU always passes


def test_the_cli_refuses_cuda_in_one_line_with_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--device", "cuda", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("oasiskv: error: device 'cuda': "), err
    assert "Traceback" not in err
