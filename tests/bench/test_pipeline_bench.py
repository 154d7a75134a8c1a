"""`oasiskv bench pipeline` on a tiny model: frozen admits nothing, sync and async do the same
work, rounds give per-round ratios to frozen, the table, JSON, plot and trace are written."""

import json
import statistics
import subprocess
import sys

from conftest import build_model_dir, needs_mooncake

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


@needs_mooncake
def test_pipeline_bench_reads_misses_from_a_mooncake_storage_node(tmp_path):
    """--remote-store mooncake: a master and a storage node started by the bench; the host
    keeps a third of each prompt, so sync and async read the same misses through Mooncake and
    frozen reads none. A process of its own: the bench enters its own network namespace."""
    model = build_model_dir(tmp_path / "m", num_hidden_layers=3)
    out = tmp_path / "p.json"
    done = subprocess.run(
        [sys.executable, "-m", "oasiskv.cli", "bench", "pipeline", "--model", str(model),
         "--context", "300", "--batch", "2", "--top-k", "4", "--predictor", "previous",
         "--f-hbm", "1.0", "--steps", "6", "--warmup", "2", "--remote-store", "mooncake",
         "--f-host", "0.3", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "remote store mooncake, host keeps 0.3 of each prompt" in done.stdout
    data = json.loads(out.read_text())
    assert (data["remote_store"], data["f_host"]) == ("mooncake", 0.3)
    by = {r["mode"]: r for r in data["rows"]}
    assert by["frozen"]["remote_bytes_per_step"] == 0
    assert by["sync"]["remote_bytes_per_step"] > 0
    assert by["sync"]["remote_bytes_per_step"] == by["async"]["remote_bytes_per_step"]


def test_pipeline_bench_needs_a_store_below_f_host_1(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=3)
    assert main(["bench", "pipeline", "--model", str(model), "--context", "200", "--f-host",
                 "0.5", "--kv-cache-dir", str(tmp_path / "kv")]) == 2
    assert "f_host=0.5 < 1 needs a remote store" in capsys.readouterr().err
    assert not (tmp_path / "kv").exists()  # before the prefill
