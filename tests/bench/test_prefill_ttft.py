"""`bench throughput --ttft`: one prompt per context computed from scratch by each of our modes
and each peer in the same run, a TTFT table beside decode. HF's first token is ours dense's
(the same model in fp32), and so is ours sparse's (its prefill attends to everything)."""

import json

import pytest
from conftest import build_model_dir

from oasiskv.cli import main


def test_ttft_rows_beside_decode(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(model), "--context", "300",
                 "--concurrency", "1", "--output-len", "2", "--top-k", "2", "--rerank", "0",
                 "--peer", "hf", "--repeats", "2", "--ttft", "--json", str(out)]) == 0
    assert "### time to first token" in capsys.readouterr().out
    ttft = {r["engine"]: r for r in json.loads(out.read_text())["ttft"]}
    assert set(ttft) == {"ours dense", "ours sparse", "hf"}
    for r in ttft.values():  # the lower middle of two runs, in the order they ran
        assert r["context"] == 300 and len(r["ttft_s_runs"]) == 2
        assert r["ttft_s"] == min(r["ttft_s_runs"]) > 0
        assert r["prefill_tps"] == pytest.approx(300 / r["ttft_s"])
    dense = ttft["ours dense"]
    for name in ("hf", "ours sparse"):
        assert ttft[name]["first_token"] == "yes", name
        assert ttft[name]["vs_ours"] == pytest.approx(ttft[name]["ttft_s"] / dense["ttft_s"])
    assert "vs_ours" not in dense


def test_without_the_flag_there_is_no_ttft_table(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(model), "--context", "100",
                 "--concurrency", "1", "--output-len", "2", "--kv-mode", "dense",
                 "--json", str(out)]) == 0
    assert "time to first token" not in capsys.readouterr().out
    assert json.loads(out.read_text())["ttft"] == []
