"""`oasiskv bench throughput` on a tiny model: under a budget for about two dense requests,
dense runs fewer at a time than sparse, nothing fails, both produce every token."""

import json

from conftest import build_model_dir

from oasiskv.cli import main


def test_throughput_bench_dense_vs_sparse(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    # 256 B per token: a dense request (308 tokens) needs 20 blocks of 4 KiB, 2 fit in 42
    assert main(["bench", "throughput", "--model", str(model), "--context", "300",
                 "--concurrency", "1,6", "--output-len", "8", "--device-kv-budget", "170KiB",
                 "--top-k", "2", "--json", str(out), "--plot", str(png)]) == 0
    assert "TPS sparse/dense" in capsys.readouterr().out
    rows = {(r["concurrency"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(1, "dense"), (1, "sparse"), (6, "dense"), (6, "sparse")}
    assert all(r["failed"] == 0 for r in rows.values())
    assert rows[(6, "sparse")]["running"] > 2 * rows[(6, "dense")]["running"]
    assert rows[(6, "dense")]["running"] <= 2.0
    assert rows[(6, "dense")]["ttft_s"] > rows[(1, "dense")]["ttft_s"]  # later ones waited
    assert "tps_ratio" in rows[(6, "sparse")] and rows[(1, "dense")]["roofline_ms"] > 0
    assert png.stat().st_size > 0
