"""`oasiskv bench pd` on a tiny model: partial transfer admits fewer bytes than full and slab
fewer still, the blocks partial sends are at most the working sets' (top_k x KV heads per
layer), slab sends exactly top_k slot blocks per layer, a small f_host
holds less decode-host KV than keeping everything and reads the rest from the store, every
setting gives the same greedy tokens, and the timeline plot is written."""

import json

from conftest import build_model_dir

from oasiskv.cli import main


def test_pd_bench_partial_vs_full(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out, png = tmp_path / "pd.json", tmp_path / "pd.png"
    assert main(["bench", "pd", "--model", str(model), "--context", "400", "--requests", "3",
                 "--top-k", "2", "--f-hbm", "0.5", "--output-len", "12",
                 "--device-kv-budget", "16MiB", "--host-kv-budget", "16MiB",
                 "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "admission MB" in printed and "per setting" in printed
    data = json.loads(out.read_text())
    assert all(r["finish"] == "length" for r in data["rows"])
    settings = {(s["transfer"], s["f_host"]): s for s in data["settings"]}
    assert set(settings) == {(t, f) for t in ("partial", "slab", "full") for f in (0.2, 1.0)}
    assert all(s["agreement"] == 1.0 for s in settings.values())
    full, partial = settings[("full", 1.0)], settings[("partial", 0.2)]
    slab = settings[("slab", 0.2)]
    assert full["admission_x"] == 1.0 and slab["admission_x"] > partial["admission_x"] > 1.5
    blocks = 400 // 16  # complete prompt blocks, in each of 2 layers
    for r in data["rows"]:
        if r["transfer"] == "full":
            assert r["kept_blocks"] == 2 * blocks
        elif r["transfer"] == "slab":
            assert r["kept_blocks"] == 2 * 2  # layers x top_k slot blocks
        else:
            assert 2 * 2 <= r["kept_blocks"] <= 2 * 2 * 2  # layers x top_k (x KV heads)
    assert full["remote_mb"] == 0 and partial["remote_mb"] > 0  # evicted blocks come back
    assert partial["host_x"] > 1.5 and full["host_x"] == 1.0
    assert png.stat().st_size > 0


def test_pd_bench_refuses_an_unknown_transfer(capsys):
    assert main(["bench", "pd", "--model", "x", "--transfer", "partial,some"]) == 2
    assert "--transfer takes partial, slab, full; got some" in capsys.readouterr().err


def test_pd_bench_sparse_options_reach_both_workers(tmp_path, capsys):
    """--sparse rerank=0 makes the hand-over carry summaries; handoff_summaries=int8 then
    makes it smaller by (d + 2) / (2 d) of their bf16 bytes."""
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    admission = {}
    for fmt in ("exact", "int8"):
        out = tmp_path / f"{fmt}.json"
        assert main(["bench", "pd", "--model", str(model), "--context", "400", "--requests",
                     "2", "--transfer", "slab", "--f-host", "1.0", "--top-k", "2",
                     "--output-len", "4", "--summary-dtype", "bfloat16",
                     "--sparse", f"rerank=0,handoff_summaries={fmt}",
                     "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["sparse"] == f"rerank=0,handoff_summaries={fmt}"
        admission[fmt] = data["settings"][0]["admission_mb"] * 2**20
    assert "--sparse rerank=0,handoff_summaries=int8" in capsys.readouterr().out
    d, heads, layers = 16, 2, 2  # the tiny model's head_dim, KV heads and layers
    rows = layers * heads * (400 // 16)  # one summary row per complete block
    assert admission["exact"] - admission["int8"] == rows * (2 * d * 2 - (2 * d + 4))


def test_pd_bench_refuses_f_host_in_sparse(capsys):
    assert main(["bench", "pd", "--model", "x", "--sparse", "f_host=1.0"]) == 2
    assert "f_host is set per setting by --f-host" in capsys.readouterr().err
