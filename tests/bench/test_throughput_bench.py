"""`oasiskv bench throughput` on a tiny model: under a budget for one dense request at a time,
dense runs fewer at a time than sparse, nothing fails, every mode produces every token; the
HF peer decodes from the same prompt K/V and agrees with dense; several f_hbm values give an
ablation whose fetch traffic grows with the cap; repeated rounds report the median run."""

import json

from conftest import build_model_dir

from oasiskv.cli import main


def test_throughput_bench_dense_vs_sparse(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    # 512 B per token: a dense request (308 tokens) needs 20 blocks of 8 KiB; 21 fit: one at a
    # time. Sparse without the rerank's key copy (which, beside the summaries of the 120 host
    # blocks the six requests hold, would take most of this budget: 1,296 B a block)
    assert main(["bench", "throughput", "--model", str(model), "--context", "300",
                 "--concurrency", "1,6", "--output-len", "8", "--device-kv-budget", "170KiB",
                 "--top-k", "2", "--f-hbm", "0.5,1.0", "--peer", "hf", "--repeats", "3",
                 "--rerank", "0", "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "TPS / dense" in printed and "f_hbm ablation" in printed
    all_rows = json.loads(out.read_text())["rows"]
    for r in all_rows:  # the median of three runs, with every run's figure beside it
        assert r["repeats"] == 3 and sorted(r["tps_runs"])[1] == r["tps"]
        assert r["tps_range"] == f"{min(r['tps_runs']):.3g}-{max(r['tps_runs']):.3g}"
    rows = {(r["concurrency"], r["mode"], r.get("f_hbm")): r for r in all_rows}
    assert set(rows) == {(c, m, f) for c in (1, 6) for m, f in
                         (("dense", None), ("sparse", "0.5"), ("sparse", "1.0"), ("hf", None))}
    for c in (1, 6):
        hf = rows[(c, "hf", None)]
        assert hf["agreement"] == 1.0 and hf["running"] == c  # same tokens as dense
        capped, free = rows[(c, "sparse", "0.5")], rows[(c, "sparse", "1.0")]
        assert capped["fetch_cap"] == 1 and free["fetch_cap"] == 2
        assert capped["bytes_per_step"] <= free["bytes_per_step"]
        assert free["kept"] == 1.0 and free["vs_hf"] == free["tps"] / hf["tps"]
        rounds = zip(free["tps_runs"], hf["tps_runs"], strict=True)
        assert free["vs_hf_rounds"] == [a / b for a, b in rounds]
        for sparse in (capped, free):  # a speed-up is shown beside its agreement with dense
            assert 0 <= sparse["agreement"] <= 1 and "tps_ratio" in sparse
    head, _, *body = printed.split("## throughput")[1].split("\n\n")[1].splitlines()
    agree = [c.strip() for c in head.split("|")].index("agree")
    for line in body:
        if "| sparse |" in line:
            assert line.split("|")[agree].strip(), line
    for r in all_rows:  # our engines' device tensors stay within the budget
        if r["mode"] in ("dense", "sparse"):
            assert 0 < r["device_peak_bytes"] <= r["device_bytes_allocated"] <= 170 * 1024
    rows = {(c, m): r for (c, m, f), r in rows.items() if f in (None, "0.5")}
    assert all(r["failed"] == 0 for r in rows.values())
    assert rows[(6, "sparse")]["running"] > 2 * rows[(6, "dense")]["running"]
    assert rows[(6, "dense")]["running"] <= 2.0
    assert rows[(6, "dense")]["ttft_s"] > rows[(1, "dense")]["ttft_s"]  # later ones waited
    assert "tps_ratio" in rows[(6, "sparse")] and rows[(1, "dense")]["roofline_ms"] > 0
    assert png.stat().st_size > 0


def test_dense_max_is_the_most_requests_dense_holds(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out = tmp_path / "t.json"
    # 512 B per token, blocks of 16 tokens (8 KiB): 40 blocks; a request of 300 + 4 tokens
    # needs 19, so 2 fit and a third does not
    assert main(["bench", "throughput", "--model", str(model), "--context", "300",
                 "--concurrency", "dense-max,3,1", "--output-len", "4", "--device-kv-budget",
                 "320KiB", "--top-k", "2", "--repeats", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["dense_capacity"] == {"300": 2}
    rows = {(r["concurrency"], r["mode"]): r for r in result["rows"]}
    assert sorted({c for c, _ in rows}) == [1, 2, 3]
    at_max, over = rows[(2, "dense")], rows[(3, "dense")]
    assert at_max["running"] == 2.0 and at_max["preemptions"] == 0  # all held at once
    assert over["running"] < 3  # one more than it holds: the third waits
    sparse = rows[(2, "sparse")]
    assert sparse["tps_ratio_rounds"] == [a / b for a, b in zip(
        sparse["tps_runs"], at_max["tps_runs"], strict=True)]
    assert (f"300: dense holds 2 requests of 304 tokens under 320KiB; at 2 requests "
            f"sparse/dense TPS {sparse['tps_ratio']:.2f} (each round {sparse['ratio_rounds']}; "
            f"greedy agreement with dense {sparse['agreement']:.2f})" in printed)


def test_bad_concurrency_levels_fail_first(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    capsys.readouterr()  # (the model's saving progress)
    for bad in ("2,0", "0x", "dense-max,x2"):
        assert main(["bench", "throughput", "--model", str(model), "--concurrency", bad]) == 2
        err = capsys.readouterr().err
        assert (f"--concurrency takes positive integers, dense-max and multiples of it such as "
                f"2x, got {bad!r}" in err and err.count("\n") == 1)  # one line, no traceback
    for levels in ("dense-max", "2x"):  # a multiple of nothing is refused as dense-max is
        assert main(["bench", "throughput", "--model", str(model), "--context", "300",
                     "--concurrency", levels, "--device-kv-budget", "128KiB"]) == 2
        err = capsys.readouterr().err
        assert "--device-kv-budget 128KiB holds no dense request of 300 + 64 tokens" in err
        assert err.count("\n") == 1


def test_multiples_of_dense_max_are_levels_labelled_in_the_rows_and_table(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out = tmp_path / "t.json"
    # as above: dense holds 2 requests of 300 + 4 tokens under 320KiB, so 2x is 4 requests
    assert main(["bench", "throughput", "--model", str(model), "--context", "300",
                 "--concurrency", "dense-max,2x", "--output-len", "4", "--device-kv-budget",
                 "320KiB", "--top-k", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["concurrency"], r["level"], r["mode"]) for r in rows] == [
        (2, "dense-max", "dense"), (2, "dense-max", "sparse"), (4, "2x", "dense"),
        (4, "2x", "sparse")]
    for r in rows:  # every request of the level ran: its 4 tokens each
        assert round(r["tps"] * r["wall_s"]) == 4 * r["concurrency"] and r["failed"] == 0
    by = {(r["level"], r["mode"]): r for r in rows}
    assert by["2x", "dense"]["running_max"] == 2  # dense holds dense-max at once, no more
    assert by["2x", "sparse"]["running_max"] == 4  # sparse's slabs hold all four
    assert "| level |" in printed and "| 4 | 2x | dense |" in printed


def test_prompt_kv_is_cached_across_runs(tmp_path):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    runs = []
    for c in ("2", "1"):  # the second run's prompt is the first run's first: reused
        out = tmp_path / f"{c}.json"
        assert main(["bench", "throughput", "--model", str(model), "--context", "100",
                     "--concurrency", c, "--output-len", "4", "--kv-mode", "dense",
                     "--kv-cache-dir", str(tmp_path / "kv"), "--json", str(out)]) == 0
        runs.append(json.loads(out.read_text()))
    assert runs[0]["prefill_s"]["100"] > 0 and runs[1]["prefill_s"]["100"] == 0
    assert len(list((tmp_path / "kv").glob("*.safetensors"))) == 2


def test_sparse_against_a_peer_needs_dense_beside_it(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m")
    assert main(["bench", "throughput", "--model", str(model), "--kv-mode", "sparse",
                 "--peer", "hf"]) == 2
    assert "add dense to --kv-mode" in capsys.readouterr().err


def test_repeats_below_one_fail_first(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m")
    assert main(["bench", "throughput", "--model", str(model), "--repeats", "0"]) == 2
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err
