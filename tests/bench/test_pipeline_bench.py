"""`oasiskv bench pipeline` on a tiny model: frozen admits nothing, sync and async do the same
work, rounds give per-round ratios to frozen, the table, JSON, plot and trace are written."""

import json
import statistics

from conftest import build_model_dir

from oasiskv.bench.common import summary_label
from oasiskv.cli import main


def test_pipeline_bench_runs_every_mode(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=3)
    out, png, trace = tmp_path / "p.json", tmp_path / "p.png", tmp_path / "t.json"
    assert main(["bench", "pipeline", "--model", str(model), "--context", "200", "--batch", "2",
                 "--top-k", "2", "--predictor", "previous", "--f-hbm", "0.5,auto",
                 "--steps", "4", "--warmup", "2", "--json", str(out), "--plot", str(png),
                 "--trace", str(trace), "--repeats", "2",
                 "--kv-cache-dir", str(tmp_path / "kv"), "--summary-dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert "x frozen" in printed and "float32 K/V, summaries bfloat16," in printed
    data = json.loads(out.read_text())
    assert (data["dtype"], data["summary_dtype"]) == ("float32", "bfloat16")
    rows = data["rows"]
    assert [(r["f_hbm"], r["mode"]) for r in rows] == [
        (0.5, "frozen"), (0.5, "sync"), (0.5, "async"),
        ("auto", "frozen"), ("auto", "sync"), ("auto", "async")]
    by = {(r["f_hbm"], r["mode"]): r for r in rows}
    assert by[(0.5, "frozen")]["admitted_per_step"] == 0
    assert by[(0.5, "sync")]["admitted_per_step"] == by[(0.5, "async")]["admitted_per_step"]
    assert by[(0.5, "sync")]["bytes_per_step"] == by[(0.5, "async")]["bytes_per_step"]
    assert by[(0.5, "sync")]["admitted_per_step"] > 0
    for (f, _), row in by.items():
        frozen = by[(f, "frozen")]["step_ms_runs"]
        ratios = [a / b for a, b in zip(row["step_ms_runs"], frozen, strict=True)]
        assert len(ratios) == 2 and row["vs_frozen"] == statistics.median(ratios)
        assert row["step_ms"] in row["step_ms_runs"]
    assert len(list((tmp_path / "kv").glob("*.safetensors"))) == 2  # one per prompt
    assert png.stat().st_size > 0
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e["name"] == "thread_name"}
    assert "foreground" in names and "select" in names


def test_summary_label_names_what_auto_keeps():
    assert summary_label("auto", "float32") == "auto (bfloat16)"
    assert summary_label("auto", "float16") == "auto (float16)"
    assert summary_label("float32", "float32") == "float32"
