"""`oasiskv eval passkey|needle|ppl|all` on a tiny model: every setting decodes the same
prompts; sparse with K covering every block is dense exactly (Δ 0, ppl ratio 1, agreement 1);
samples are fixed by the seed; the judge scores hand-made answers."""

import json
from types import SimpleNamespace

import pytest
from conftest import build_model_dir

from oasiskv.cli import main
from oasiskv.eval.fidelity import Sample, judge, make_samples, summarize
from oasiskv.eval.settings import settings_from
from oasiskv.eval.tasks import make_task
from oasiskv.models.loader import load_checkpoint
from oasiskv.sequence import RequestMetrics


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """tiny_llama's shape with room for prompts of the tiny tokenizer's 720 tokens."""
    return build_model_dir(tmp_path_factory.mktemp("tiny_long"), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_checkpoint(str(model)).tokenizer


def test_all_tasks_in_one_run_and_full_k_sparse_equals_dense(model, tmp_path, capsys):
    out = tmp_path / "fid.json"
    assert main(["eval", "all", "--model", str(model), "--context", "720",
                 "--top-k", "2,64", "--predictor", "previous,exact", "--samples", "3",
                 "--ppl-tokens", "16", "--agree-tokens", "8", "--group", "2",
                 "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "sparse K=64 exact" in table and "ppl ratio" in table
    data = json.loads(out.read_text())
    assert data["complete"] is True
    assert data["settings"] == ["dense", "sparse K=2 previous", "sparse K=2 exact",
                                "sparse K=64 previous", "sparse K=64 exact"]
    rows = {(r["task"], r["setting"]): r for r in data["rows"]}
    assert len(rows) == 3 * 5
    assert all(r["decode_s"] > 0 for r in rows.values())
    for task in ("passkey", "needle"):
        for k in ("previous", "exact"):
            assert rows[(task, f"sparse K=64 {k}")]["delta"] == 0
        assert rows[(task, "dense")]["samples"] == 3
    for k in ("previous", "exact"):
        ppl = rows[("ppl", f"sparse K=64 {k}")]
        assert ppl["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
        assert ppl["agreement"] == 1.0
    assert rows[("ppl", "dense")]["ppl"] > 1
    assert rows[("ppl", "sparse K=2 exact")]["ppl_ratio"] != pytest.approx(1.0, abs=1e-6)


def test_samples_are_fixed_by_the_seed(tokenizer):
    for task in ("passkey", "needle", "ppl"):
        a = make_samples(task, tokenizer, 720, 3, seed=1, ppl_tokens=8)
        b = make_samples(task, tokenizer, 720, 3, seed=1, ppl_tokens=8)
        c = make_samples(task, tokenizer, 720, 3, seed=2, ppl_tokens=8)
        assert [s.ids for s in a] == [s.ids for s in b]
        assert [s.ids for s in a] != [s.ids for s in c]
    needles = make_samples("needle", tokenizer, 720, 3, seed=1)
    assert [s.kind for s in needles] == ["single", "multikey", "multivalue"]
    assert [s.depth for s in needles] == [0.0, 0.5, 1.0]
    ppl = make_samples("ppl", tokenizer, 720, 2, seed=1, ppl_tokens=8)
    assert all(len(s.ids) + len(s.forced) == 720 and len(s.forced) == 8 for s in ppl)


def test_judge_scores_hand_made_answers(tokenizer):
    task = make_task("multivalue", tokenizer, 720, 0.5, seed=3, chat=False)
    sample = Sample("needle", "multivalue", task.input_ids, 3, 0.5, list(task.answers),
                    task_obj=task)
    a, b, c, d = task.answers

    def out(text, drafts=0, right=0):
        metrics = RequestMetrics(0.0, num_drafts=drafts, num_drafts_right=right)
        return SimpleNamespace(text=text, finish_reason="length", error=None, metrics=metrics)

    assert judge(sample, [out(f"{a}, {b}, {c} and {d}.")])["score"] == 1.0
    assert judge(sample, [out(f"They are {a} and {int(b):,}")])["score"] == 0.5
    assert judge(sample, [out("none")])["score"] == 0.0
    sparse = [judge(sample, [out(f"{a} {b}", 4, 3)]), judge(sample, [out("none", 6, 1)])]
    rows = summarize("needle", [sample] * 2, {"dense": [{"score": 1.0}] * 2, "sparse": sparse})
    assert rows[1]["accuracy"] == 25.0 and rows[1]["delta"] == -75.0
    assert rows[1]["draft_right"] == 4 / 10 and "draft_right" not in rows[0]


def test_block_sizes_are_their_own_columns_and_take_the_dense_prefill(model, tmp_path):
    settings = settings_from(["sparse"], ["exact"], [64], block_sizes=[16, 8])
    assert [s.name for s in settings] == ["sparse K=64 exact", "sparse K=64 B=8 exact"]
    assert settings[-1].engine_kwargs()["block_size"] == 8
    settings = settings_from(["sparse"], ["exact"], [64], block_sizes=[16, 8, 4],
                             token_budgets=[512, 2048])
    assert [(s.block_size, s.top_k) for s in settings] == [
        (16, 32), (16, 128), (8, 64), (8, 256), (4, 128), (4, 512)]
    with pytest.raises(ValueError, match="--token-budget 100 is not a whole number of blocks"):
        settings_from(["sparse"], ["exact"], [64], block_sizes=[8], token_budgets=[100])
    # K*B covers the whole context: B=8 blocks built from the dense (B=16) prefill's K/V
    # decode exactly like dense; at K=4 they select, and differ
    out = tmp_path / "fid.json"
    assert main(["eval", "ppl", "--model", str(model), "--context", "400", "--top-k", "4,64",
                 "--block-size", "8", "--predictor", "exact", "--samples", "2",
                 "--ppl-tokens", "16", "--agree-tokens", "8", "--out", str(out)]) == 0
    rows = {r["setting"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["sparse K=64 B=8 exact"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert rows["sparse K=64 B=8 exact"]["agreement"] == 1.0
    assert rows["sparse K=4 B=8 exact"]["ppl_ratio"] != pytest.approx(1.0, abs=1e-6)


def test_a_long_run_saves_each_group_as_it_goes(model, tmp_path, monkeypatch):
    # every group of prompts lands in the JSON before the task ends (a crash keeps them)
    import oasiskv.eval.fidelity as fidelity

    saved = []
    monkeypatch.setattr(fidelity, "write_json", lambda path, data: saved.append(data))
    assert main(["eval", "passkey", "--model", str(model), "--context", "300", "--top-k", "4",
                 "--predictor", "exact", "--samples", "3", "--group", "1",
                 "--out", str(tmp_path / "f.json")]) == 0
    partial = [[r["samples"] for r in d["partial_rows"]] for d in saved if "partial_rows" in d]
    assert partial == [[1, 1], [2, 2], [3, 3]]  # dense and sparse, after each prompt
    assert saved[-1]["complete"] and [r["samples"] for r in saved[-1]["rows"]] == [3, 3]
