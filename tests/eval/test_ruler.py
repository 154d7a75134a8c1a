"""`oasiskv eval ruler` on a tiny tokenizer and model: RULER's generators give prompts of the
asked length that hold their answers; our prompt for a seed is the package's own prepare.py's;
scores equal hand-computed RULER scores; dense and sparse with K covering every block give the
same predictions."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import transformers
from conftest import build_model_dir
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

pytest.importorskip("long_context_eval", reason="RULER's package: scripts/setup.sh installs it")

from oasiskv.cli import main  # noqa: E402
from oasiskv.eval import ruler_gen as G  # noqa: E402
from oasiskv.eval.ruler import postprocess, score_prediction, summarize, wide_table  # noqa: E402


def ruler_text() -> list[str]:
    """What RULER's prompts are made of: essays, templates, noise lines, SQuAD passages."""
    pkg = G.package_dir() / "data" / "synthetic"
    essays = json.loads((pkg / "json" / "PaulGrahamEssays.json").read_text())["text"][:300_000]
    squad = (pkg / "json" / "squad.json").read_text()[:200_000]
    templates = [c["template"] + c.get("answer_prefix", "") for c in G.task_configs().values()]
    noise = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
             "again.")
    return [essays, squad, *templates, noise * 20, "VAR ABCDE = 12345 " * 20]


@pytest.fixture(scope="module")
def tok() -> transformers.PreTrainedTokenizerFast:
    """A small byte-level BPE (~3 characters a token) trained on RULER's own text."""
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(ruler_text(), trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>",
                                                eos_token="</s>")


@pytest.fixture(scope="module")
def tok_dir(tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ruler_tok")
    tok.save_pretrained(path)
    return path


GEN_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multivalue", "niah_multiquery", "vt",
             "cwe", "fwe")


def test_prompts_have_the_asked_length_and_hold_their_answers(tok):
    context = 4096
    for task in GEN_TASKS:
        samples = G.build_task(task, tok, context, 2, chat=False)
        assert [s.index for s in samples] == [0, 1]
        for s in samples:
            ttg = G.task_configs()[task]["tokens_to_generate"]
            # RULER's count is the engine's prompt (vt's counts its few-shot example before the
            # script re-letters its variables)
            assert abs(len(s.ids) - (s.length - ttg)) <= (8 if task == "vt" else 0), task
            # fwe's prompt is sized to the whole context (RULER's), the others leave room for
            # the answer; a haystack step (500 essay words) is under a fifth of this context
            assert 0.8 * context < len(s.ids) + (0 if task == "fwe" else ttg) <= context, task
            assert s.answers and all(a in s.prompt for a in s.answers), task
        s = samples[0]
        if task.startswith("niah"):
            k = 4 if task in ("niah_multivalue", "niah_multiquery") else 1
            assert len(s.answers) == k
            for a in s.answers:
                assert f"is: {a}." in s.prompt  # its needle sentence
        elif task == "vt":
            assert len(s.answers) == 5 and f"VAR {s.answers[0]} = " in s.prompt
        elif task == "cwe":
            listed = Counter(s.prompt.split("\n")[-2].split())  # the asked list
            assert min(listed[a] for a in s.answers) > max(
                n for w, n in listed.items() if w not in s.answers and not w[0].isdigit())
        elif task == "fwe":
            words = Counter(w for w in s.prompt.split() if w.isalpha() and len(w) == 6)
            assert [w for w, _ in words.most_common(3)] == s.answers


def test_prompts_are_fixed_by_the_seed_and_chat_wraps_them(tok):
    a = G.build_task("niah_multikey_2", tok, 1024, 2, seed=1, chat=False)
    b = G.build_task("niah_multikey_2", tok, 1024, 2, seed=1, chat=False)
    c = G.build_task("niah_multikey_2", tok, 1024, 2, seed=2, chat=False)
    assert [s.prompt for s in a] == [s.prompt for s in b] != [s.prompt for s in c]
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }} are\n{{ m['content'] }}</s>"
                         "\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    try:
        chat = G.build_task("niah_single_1", tok, 1024, 1, chat=True)[0]
    finally:
        tok.chat_template = None
    # the template's own words are not niah's to rewrite ('are' -> 'is' for one needle)
    assert chat.prompt.startswith("<s>user are\nA special magic number is hidden")
    assert "?</s>\n<s>assistant\nThe special magic number for" in chat.prompt
    assert len(chat.ids) + 128 == chat.length <= 1024


def test_a_context_too_short_for_a_task_is_said_so(tok):
    with pytest.raises(G.TaskDoesNotFit, match="qa_1"):
        G.build_task("qa_1", tok, 1024, 1, chat=False)
    with pytest.raises(ValueError, match="unknown RULER task"):
        G.build_task("niah", tok, 1024, 1)


def test_prompts_equal_the_packages_own_generation(tok, tok_dir, tmp_path):
    """prepare.py (RULER's entry point) runs the task's script with the same tokenizer (its
    `hf` type), length and seed 42; our prompts and answers are the same."""
    prepare = G.package_dir() / "data" / "prepare.py"
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for task, context in (("niah_single_1", 2048), ("niah_multikey_3", 2048), ("vt", 2048),
                          ("cwe", 2048), ("fwe", 2048), ("qa_1", 4096)):
        subprocess.run([sys.executable, str(prepare), "--save_dir", str(tmp_path),
                        "--task", task, "--tokenizer_path", str(tok_dir),
                        "--tokenizer_type", "hf", "--max_seq_length", str(context),
                        "--model_template_type", "base", "--num_samples", "2"],
                       cwd=prepare.parent, env=env, check=True, capture_output=True)
        theirs = [json.loads(line) for line in
                  (tmp_path / task / "validation.jsonl").read_text().splitlines()]
        ours = G.build_task(task, tok, context, 2, seed=42, chat=False)
        assert len(theirs) == 2, task
        for t, o in zip(theirs, ours, strict=True):
            assert o.prompt == t["input"], task
            assert o.answers == t["outputs"] and o.length == t["length"], task


def test_scores_are_rulers_on_hand_made_predictions():
    refs = ["4417001", "Alpha", "9000"]
    assert score_prediction("string_match_all", " 4417001, alpha and 90", refs) == \
        pytest.approx(200 / 3)
    assert score_prediction("string_match_all", "none", refs) == 0
    assert score_prediction("string_match_part", "it was ALPHA", refs) == 100
    assert score_prediction("string_match_part", None, refs) == 0
    assert postprocess("  a\x00b\tc \n") == "a\nb\nc"
    # control characters become newlines before matching: "ab" is not found in "a\tb"
    assert score_prediction("string_match_all", "a\tb", ["a\nb", "ab"]) == 50

    def res(*scores):
        return [{"score": s, "decode_s": 0.1} for s in scores]

    rows = summarize(4096, "vt", {"dense": res(100, 0, 50), "sparse K=2 exact": res(100, 0, 0)})
    rows += summarize(4096, "cwe", {"dense": res(10, 20, 0), "sparse K=2 exact": res(0, 0, 0)})
    by = {(r["task"], r["setting"]): r for r in rows}
    assert by[("vt", "dense")]["score"] == 50 and by[("vt", "dense")]["counts"]
    assert by[("vt", "sparse K=2 exact")]["delta"] == pytest.approx(-50 / 3)
    assert not by[("cwe", "dense")]["counts"]  # 10 < 20: shown, not averaged
    table = wide_table(rows, ["dense", "sparse K=2 exact"])
    avg = table[-1]
    assert avg["task"] == "average (1 counted)" and avg["dense"] == 50
    assert avg["sparse K=2 exact"] == pytest.approx(100 / 3)
    assert avg["sparse K=2 exact Δ"].startswith("-16.7 [")


def test_eval_ruler_end_to_end_full_k_sparse_equals_dense(tok, tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", max_position_embeddings=1024,
                            vocab_size=len(tok))
    tok.save_pretrained(model)  # the RULER-trained tokenizer in place of the default one
    out = tmp_path / "ruler.json"
    assert main(["eval", "ruler", "--model", str(model), "--context", "1024",
                 "--tasks", "niah_single_1,niah_multikey_2,fwe,qa_1", "--samples", "2",
                 "--predictor", "exact", "--top-k", "2,64", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "sparse K=64 exact Δ dense" in text and "not run at 1024: qa_1: the smallest" in text
    data = json.loads(out.read_text())
    assert data["complete"] and data["settings"] == ["dense", "sparse K=2 exact",
                                                     "sparse K=64 exact"]
    assert [c["task"] for c in data["per_sample"]] == ["niah_single_1", "niah_multikey_2", "fwe"]
    differs = 0
    for cell in data["per_sample"]:
        res = cell["results"]
        assert len(res["dense"]) == 2
        # 1024 tokens = 64 blocks of 16: K=64 keeps every block, so it decodes as dense
        assert [r["output"] for r in res["sparse K=64 exact"]] == \
            [r["output"] for r in res["dense"]]
        assert all(0 <= r["score"] <= 100 for r in res["dense"])
        differs += [r["output"] for r in res["sparse K=2 exact"]] != \
            [r["output"] for r in res["dense"]]
    assert differs  # K=2 of ~50 blocks is live: it changes what the model says
    rows = {(r["task"], r["setting"]): r for r in data["rows"]}
    assert rows[("fwe", "sparse K=64 exact")]["delta"] == 0
    assert data["table"][-1]["task"].startswith("average (")
