"""The command line: one flag per config field, typed the way a user types it, and an
end-to-end `oasiskv generate` whose figures agree with an independent reference."""

import dataclasses
import json
import re

import pytest
import torch
import transformers

from oasiskv.cli import build_parser, main
from oasiskv.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from oasiskv.engine_args import engine_kwargs


def field_names() -> list[str]:
    top = [f.name for f in dataclasses.fields(EngineConfig)
           if f.name not in ("cache", "scheduler", "spec")]
    return (top + [f.name for f in dataclasses.fields(CacheConfig)]
            + [f.name for f in dataclasses.fields(SchedulerConfig)]
            + [f.name for f in dataclasses.fields(SpecConfig)])


@pytest.mark.parametrize("command", [["generate"], ["bench", "decode"], ["serve"]])
def test_help_lists_a_flag_per_config_field(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for name in field_names():
        assert re.search(rf"--{name.replace('_', '-')}\b", text), name
    assert "--max-tokens" in text or command != ["generate"]


# (field, what a user types, the Python value `LLM(...)` would get)
TYPED = [
    ("model", "some/dir", "some/dir"),
    ("dtype", "bfloat16", "bfloat16"),
    ("device", "cpu", "cpu"),
    ("num_threads", "3", 3),
    ("seed", "11", 11),
    ("block_size", "32", 32),
    ("device_kv_budget", "1048576", 1048576),
    ("device_kv_budget", "512MiB", "512MiB"),
    ("kv_mode", "sparse", "sparse"),
    ("top_k", "32", 32),
    ("f_hbm", "0.1", 0.1),
    ("f_hbm", "auto", "auto"),
    ("prefetch", "async", "async"),
    ("prefetch_group", "3", 3),
    ("host_kv_budget", "2GiB", "2GiB"),
    ("predictor", "exact", "exact"),
    ("drafter", "ngram", "ngram"),
    ("num_drafts", "2", 2),
    ("draft_model", "some/dir", "some/dir"),
    ("speculative", "accept", "accept"),
    ("forced_drafts", "guessed", "guessed"),
    ("score_alpha", "0.5", 0.5),
    ("rerank", "1.5", 1.5),
    ("rerank_source", "host", "host"),  # int8 needs rerank
    ("score_aggregation", "softmax-max", "softmax-max"),
    ("summary_splits", "2", 2),
    ("summary_dtype", "float16", "float16"),
    ("handoff_summaries", "int8", "int8"),
    ("prefault_kv", "true", True),
    ("sink_blocks", "2", 2),
    ("recent_blocks", "1", 1),
    ("dense_layers", "1", 1),
    ("remote_store", "none", "none"),  # others need kv_mode=sparse
    ("f_host", "1.0", 1.0),
    ("remote_lend", "0", "0"),
    ("prefix_cache_bytes", "64MiB", "64MiB"),
    ("max_num_seqs", "5", 5),
    ("max_num_batched_tokens", "256", 256),
    ("max_model_len", "1024", 1024),
]


def test_typed_table_covers_every_field():
    covered = {getattr(case, "values", case)[0] for case in TYPED}
    assert covered == set(field_names())


@pytest.mark.parametrize("name, typed, value", TYPED)
def test_each_flag_reaches_the_same_config_as_the_keyword(name, typed, value):
    try:
        args = build_parser().parse_args(
            ["generate", "--prompt", "x", f"--{name.replace('_', '-')}", typed])
    except SystemExit:
        pytest.fail(f"--{name.replace('_', '-')} {typed} was rejected")
    kwargs = engine_kwargs(args)
    # sizes and f_hbm arrive as text (they take units / "auto"); the config parses them
    assert kwargs == {name: value} or (name in ("device_kv_budget", "f_hbm")
                                       and set(kwargs) == {name})
    assert EngineConfig.from_kwargs(**kwargs) == EngineConfig.from_kwargs(**{name: value})


def test_unset_flags_keep_the_dataclass_defaults():
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert engine_kwargs(args) == {}


PROMPT = "It is a truth universally acknowledged, that a single man"


def test_generate_end_to_end(tiny_llama, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    out_json = tmp_path / "out.json"
    rc = main(["generate", "--model", str(tiny_llama), "--prompt-file", str(prompt_file),
               "--max-tokens", "5", "--json", str(out_json), "--device-kv-budget", "1048576",
               "--ignore-eos"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err

    # Independent reference: the same prompt through transformers, greedy.
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama,
                                                           dtype=torch.float32).eval()
    ids = tok.encode(PROMPT)
    ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                      dtype=torch.long),
                      max_new_tokens=5, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()

    data = json.loads(out_json.read_text())
    assert data["token_ids"] == ref
    assert data["text"] == tok.decode(ref, skip_special_tokens=True)
    assert data["finish_reason"] == "length"
    m, s = data["metrics"], data["stats"]
    assert m["prompt_tokens"] == len(ids) and m["generated_tokens"] == 5
    assert m["ttft_s"] >= 0 and m["tpot_s"] >= 0 and m["e2e_s"] >= m["ttft_s"]
    assert s["kv_bytes_per_block"] == 16 * 2 * 2 * 2 * 16 * 4
    assert s["kv_peak_blocks"] == -(-(len(ids) + 4) // 16)  # the last token is never cached
    assert s["kv_peak_bytes"] == s["kv_peak_blocks"] * s["kv_bytes_per_block"]
    assert s["kv_blocks_total"] == 1048576 // s["kv_bytes_per_block"]
    assert s["requests_finished"] == 1 and s["kv_blocks_used"] == 0

    assert data["text"] in captured.out
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("[oasiskv]")]
    assert len(lines) == 1, captured.err
    summary = re.search(
        r"prompt (\d+) tok \| generated (\d+) tok \(length\) \| TTFT ([\d.]+) s \| "
        r"TPOT ([\d.]+) ms \| device KV ([\d.]+) MiB peak \((\d+) blocks\) of ([\d.]+) MiB "
        r"allocated", lines[0])
    assert summary, lines[0]
    prompt_n, gen_n, ttft, tpot, mib, blocks, allocated = summary.groups()
    assert int(prompt_n) == len(ids) and int(gen_n) == 5
    assert float(ttft) == pytest.approx(m["ttft_s"], abs=0.006)
    assert float(tpot) == pytest.approx(m["tpot_s"] * 1e3, abs=0.06)
    assert float(mib) == pytest.approx(s["kv_peak_bytes"] / 2**20, abs=0.06)
    assert int(blocks) == s["kv_peak_blocks"]
    # the pool the runner writes into: every block of the 1 MiB budget
    assert s["device_bytes_allocated"] == 1048576 // s["kv_bytes_per_block"] * s[
        "kv_bytes_per_block"]
    assert float(allocated) == pytest.approx(s["device_bytes_allocated"] / 2**20, abs=0.06)


@pytest.mark.parametrize("argv, match", [
    (["--model", "no-such-model-xyz", "--prompt", "hi"], "unknown model"),
    (["--block-size", "12", "--prompt", "hi"], "power of two"),
    (["--dtype", "float8", "--prompt", "hi"], "dtype"),
    ([], "--prompt"),
])
def test_generate_errors_exit_2_with_message(tiny_llama, capsys, argv, match):
    if "--model" not in argv:
        argv = ["--model", str(tiny_llama), *argv]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"oasiskv: error: .*{match}", err), err


def test_bad_flag_value_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", "x", "--max-num-seqs", "many"])
    assert exit_.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err


def test_generate_sparse_prints_per_step_figures(tiny_llama, tmp_path, capsys):
    prompt = tmp_path / "p.txt"
    prompt.write_text(PROMPT * 3)
    out_json = tmp_path / "out.json"
    rc = main(["generate", "--model", str(tiny_llama), "--prompt-file", str(prompt),
               "--max-tokens", "20", "--ignore-eos", "--kv-mode", "sparse", "--top-k", "2",
               "--f-hbm", "0.5", "--step-stats", "--json", str(out_json), "--prefetch", "async",
               "--trace", str(tmp_path / "trace.json")])
    err = capsys.readouterr().err
    assert rc == 0, err
    data = json.loads(out_json.read_text())
    decodes = [s for s in data["steps"] if s["decode_tokens"]]
    assert len(decodes) == 19  # the first token comes from the prefill step
    line = next(ln for ln in err.splitlines() if "per decode step" in ln)
    figures = re.search(r"predicted (\d+) block-heads, hits (\d+), wanted ([\d.]+), admitted "
                        r"([\d.]+) \| host->device ([\d.]+) KiB, device->host ([\d.]+) KiB", line)
    assert figures, line
    for value, key in zip(figures.groups(), ("predicted", "hits", "wanted", "admitted",
                                             "h2d_bytes", "d2h_bytes"), strict=True):
        mean = sum(s[key] for s in decodes) / len(decodes)
        scale = 1024 if key.endswith("bytes") else 1
        assert float(value) == pytest.approx(mean / scale, abs=0.51)
    s = data["stats"]
    assert s["sparse_admitted"] <= s["sparse_wanted"] and s["sparse_hits"] > 0
    assert s["slab_bytes"] == 4 * s["kv_bytes_per_block"]  # K=2: working set, active, drafts
    # one request: its slab and a summary (and key copy) for each block of its history
    assert s["kv_peak_blocks"] == 4
    assert s["device_peak_bytes"] == (s["slab_bytes"] + s["summary_ids_peak"]
                                      * s["summary_bytes_per_block"])
    assert s["summary_ids_peak"] == -(-(data["metrics"]["prompt_tokens"] + 20) // 16)
    head = next(ln for ln in err.splitlines() if ln.startswith("[oasiskv] prompt"))
    assert "key_copy_bytes_per_block" in s  # the default rerank's int8 copy, named
    assert (f"({s['kv_peak_blocks']} blocks + {s['summary_ids_peak']} block summaries and key "
            f"copies) of "
            f"{s['device_bytes_allocated'] / 2**20:.1f} MiB allocated") in head
    assert "| step | seqs |" in err  # the --step-stats table
    assert "prefetch stall" in line
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"].startswith("L0 step") for e in events)


def test_train_drafter_flags_reach_the_spec(monkeypatch, tiny_llama, tmp_path):
    import oasiskv.train.drafter as train

    seen = {}

    def fake_run(engine, spec, aux):
        seen.update(spec=spec, aux=aux)
        raise KeyboardInterrupt  # stop before training

    monkeypatch.setattr(train, "run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        main(["train-drafter", "--model", str(tiny_llama), "--out", str(tmp_path), "--epochs",
              "3", "--soft-weight", "0.5", "--feature-weight", "2", "--weight-decay", "0.1",
              "--feature-noise", "0.2", "--aux-layers", "0,1"])
    spec = seen["spec"]
    assert (spec.epochs, spec.soft_weight, spec.feature_weight, spec.weight_decay,
            spec.feature_noise) == (3, 0.5, 2.0, 0.1, 0.2)
    assert seen["aux"] == [0, 1]


def test_train_drafter_prints_the_held_out_figures(monkeypatch, tiny_llama, tiny_eagle, tmp_path,
                                                   capsys):
    import oasiskv.train.drafter as train

    out, result = tiny_eagle
    monkeypatch.setattr(train, "run", lambda engine, spec, aux: result)
    main(["train-drafter", "--model", str(tiny_llama), "--out", str(out), "--json",
          str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert f"draft accuracy greedy {result['heldout']['greedy_accuracy']:.3f}" in printed
    rows = [line for line in printed.splitlines() if line.startswith("| [")]
    assert len(rows) == 5 and rows[-1].startswith("| [0.9, 1.0] |")
    assert json.loads((tmp_path / "r.json").read_text())["heldout"] == result["heldout"]
