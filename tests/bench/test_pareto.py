"""`oasiskv bench pareto` on a tiny model: dense and two sparse configurations in one run, at
dense's maximum concurrency and twice it; the configuration whose K covers every block
decodes exactly as dense (agreement 1, the same answers, ppl ratio 1, Δ 0) while K=2 does
not; the JSON has every cell, and keeps the finished ones when a later part crashes; bad
--sparse options are one-line errors; TPOT percentiles by hand."""

import json
import re

import pytest
from conftest import build_model_dir

import oasiskv.bench.pareto as pareto
from oasiskv.bench.sparse_options import parse_settings, parse_sparse
from oasiskv.cli import main
from oasiskv.config import CacheConfig

FULL, SMALL = "sparse K=64 lookahead", "sparse K=2 lookahead"
# 512 B per token (fp32, 2 layers, 2 KV heads of 16): a dense request of 720 + 8 tokens takes
# 46 blocks of 8 KiB, so 760 KiB holds 2 at once (dense-max 2, 2x 4); 64 blocks of 16 tokens
# cover the model's whole 1024-token context
ARGS = ["bench", "pareto", "--context", "720", "--output-len", "8", "--device-kv-budget",
        "760KiB", "--dtype", "float32", "--sparse", "top_k=2", "--sparse", "top_k=64",
        "--samples", "3", "--ppl-samples", "2", "--ppl-tokens", "16", "--repeats", "2",
        "--num-threads", "1", "--concurrency", "dense-max,3,2x"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny_long"), max_position_embeddings=1024)


def test_one_run_of_dense_and_two_sparse_configurations(model, tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main([*ARGS, "--model", str(model), "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["complete"] and data["dense_capacity"] == 2
    assert data["levels"] == {"2": "dense-max", "3": "", "4": "2x"}
    assert data["settings"] == ["dense", SMALL, FULL]
    rows = {(r["setting"], r["concurrency"]): r for r in data["rows"]}
    assert set(rows) == {(s, c) for s in data["settings"] for c in (2, 3, 4)}  # every cell
    assert {(r["task"], r["setting"]) for r in data["accuracy"]} == {
        (t, s) for t in ("passkey", "needle", "ppl") for s in data["settings"]}
    for c in (2, 3, 4):
        dense, small, full = rows[("dense", c)], rows[(SMALL, c)], rows[(FULL, c)]
        assert full["agreement"] == 1.0 and small["agreement"] < 1.0
        assert full["ppl_ratio"] == pytest.approx(1.0, abs=1e-4) and full["ppl_agreement"] == 1
        assert small["ppl_ratio"] != pytest.approx(1.0, abs=1e-4)
        for task in ("passkey", "needle"):
            assert full[task] == dense[task] and full[f"{task}_delta"] == 0
        assert full["accuracy_delta"] == 0 and "accuracy_delta" not in dense
        for r in (dense, small, full):
            assert r["repeats"] == 2 and sorted(r["tps_runs"])[0] == r["tps"]
            assert 0 < r["tpot_p50_ms"] <= r["tpot_p99_ms"] and r["step_ms"] > 0
            assert r["failed"] == 0 and r["device_peak_bytes"] <= 760 * 1024
        assert small["tps_ratio"] == small["tps"] / dense["tps"]
        # what a request holds on the device: its whole K/V (46 blocks of 8 KiB) against a
        # K+2-block slab and its 46 blocks' int8 key copies (2 layers x 2 heads x (16 x 16
        # codes + a float32 scale): 1,040 B); rerank=inf (the default) keeps no summaries
        assert dense["device_bytes_per_request"] == 46 * 8192
        assert small["device_bytes_per_request"] == 4 * 8192 + 46 * 1040
    assert rows[("dense", 4)]["running_max"] == 2 and rows[(SMALL, 4)]["running_max"] == 4
    assert rows[("dense", 3)]["running"] < 2  # the third request waited: bytes per request
    # are per request held at once, not per mean batch
    answers = data["per_sample"]
    for task in ("passkey", "needle"):  # the same answers, not only the same scores
        assert [r["output"] for r in answers[task][FULL]] == [
            r["output"] for r in answers[task]["dense"]]
    assert [r["tokens"] for r in answers["ppl"][FULL]] == [
        r["tokens"] for r in answers["ppl"]["dense"]]
    table = printed.split("## accuracy against throughput")[1]
    assert "| configuration | conc | level |" in table and f"| {FULL} | 4 | 2x |" in table
    assert re.search(r"one [0-9.]+M model with 1K context \(the paper measured 8B-235B "
                     r"models on LongBench v2\); .+, 1 thread; oasiskv bench pareto", table)
    assert "oasiskv bench pareto --model" in table and "--sparse top_k=2 --sparse top_k=64" in (
        table)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_crash_keeps_the_cells_done(model, tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    real = pareto.run_samples

    def crash_on_needle(engine_for, names, samples, *a, **kw):
        if samples[0].task == "needle":
            raise RuntimeError("out of memory")
        return real(engine_for, names, samples, *a, **kw)

    monkeypatch.setattr(pareto, "run_samples", crash_on_needle)
    with pytest.raises(RuntimeError, match="out of memory"):
        main(["bench", "pareto", "--model", str(model), "--context", "720", "--output-len",
              "4", "--device-kv-budget", "760KiB", "--dtype", "float32", "--sparse", "top_k=2",
              "--samples", "2", "--repeats", "1", "--num-threads", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["rows"] == []
    assert {(r["setting"], r["concurrency"]) for r in data["throughput"]} == {
        (s, c) for s in ("dense", SMALL) for c in (2, 4)}
    assert {r["task"] for r in data["accuracy"]} == {"passkey"}


def test_a_crash_in_the_throughput_runs_keeps_the_levels_done(model, tmp_path, monkeypatch):
    out = tmp_path / "p.json"
    real = pareto.run_mode

    def crash_at_four(kw, prompts, *a):
        if len(prompts) == 4:
            raise RuntimeError("killed")
        return real(kw, prompts, *a)

    monkeypatch.setattr(pareto, "run_mode", crash_at_four)
    with pytest.raises(RuntimeError, match="killed"):
        main(["bench", "pareto", "--model", str(model), "--context", "720", "--output-len",
              "4", "--device-kv-budget", "760KiB", "--dtype", "float32", "--sparse", "top_k=2",
              "--repeats", "1", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["accuracy"] == []
    assert [(r["setting"], r["concurrency"]) for r in data["throughput"]] == [
        ("dense", 2), (SMALL, 2)]


@pytest.mark.parametrize("spec, message", [
    ("foo=1", "--sparse 'foo=1': unknown key 'foo'; the keys are CacheConfig fields: "),
    ("top_k=many", "--sparse 'top_k=many': top_k: expected an integer, got 'many'"),
    ("top_k=0", "--sparse 'top_k=0': top_k must be a positive number of blocks, got 0"),
    ("prefault_kv=maybe", "prefault_kv: expected true/false, got 'maybe'"),
    ("top_k", "--sparse 'top_k': 'top_k' is not KEY=VAL (or default)"),
    ("kv_mode=dense", "kv_mode is sparse in every --sparse configuration"),
    ("top_k=8,top_k=9", "top_k given twice"),
])
def test_bad_sparse_options_are_one_line_errors(model, capsys, spec, message):
    assert main(["bench", "pareto", "--model", str(model), "--sparse", spec]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("oasiskv: error: ")


def test_the_same_configuration_twice_and_bad_levels_fail_first(model, capsys):
    assert main(["bench", "pareto", "--model", str(model), "--sparse", "default", "--sparse",
                 "top_k=128"]) == 2
    assert "the same configuration twice: 'sparse K=128 lookahead'" in capsys.readouterr().err
    for levels in ("0x", "dense-max,0", "twice"):
        assert main(["bench", "pareto", "--model", str(model), "--concurrency", levels]) == 2
        assert (f"--concurrency takes positive integers, dense-max and multiples of it such as "
                f"2x, got {levels!r}") in capsys.readouterr().err


def test_any_cache_field_is_an_option_of_its_setting():
    opts = parse_sparse("top_k=64,score_alpha=0.5,f_hbm=0.05,prefault_kv=yes,rerank=3")
    assert opts == {"top_k": 64, "score_alpha": 0.5, "f_hbm": 0.05, "prefault_kv": True,
                    "rerank": 3.0}
    dense, setting = parse_settings(["top_k=64,score_alpha=0.5,f_hbm=0.05,prefault_kv=yes,"
                                     "rerank=3"])
    assert dense.name == "dense" and setting.options == (("score_alpha", 0.5),
                                                         ("prefault_kv", True))
    # named fields by Setting's own words, the others as field=value where not the default
    assert setting.name == "sparse K=64 lookahead rerank=3 score_alpha=0.5 prefault_kv=True"
    kw = setting.engine_kwargs()
    assert kw["score_alpha"] == 0.5 and kw["prefault_kv"] is True and kw["top_k"] == 64
    default = parse_settings(None)[1]
    assert default.engine_kwargs()["top_k"] == CacheConfig.top_k
    assert default.name == f"sparse K={CacheConfig.top_k} {CacheConfig.predictor}"
