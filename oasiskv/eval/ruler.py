"""`oasiskv eval ruler`: NVIDIA's RULER tasks, full vs sparse attention on the same prompts.

Prompts: :mod:`oasiskv.eval.ruler_gen` (the package's own generators, with our tokenizer, for
each --context = RULER's max_seq_length: prompt + tokens to generate). All prompts are built
first, then run as `eval all` runs its tasks (:func:`oasiskv.eval.fidelity.run_samples`): each
prompt prefilled once (dense), every setting decodes it greedily for the task's
`tokens_to_generate` (RULER's), capped where the prompt leaves less room in the model's window
(RULER sizes freq_words_extraction's prompt to the whole context).

Scoring, as RULER's eval: the prediction is stripped and control characters become newlines
(its `postprocess_pred`), then the package's own per-sample metric: `string_match_all` (niah,
vt, cwe, fwe: the share of the answers found in it, case-insensitive) or `string_match_part`
(qa: 100 if any answer is found), x100 as RULER reports.

Table: per context and task, n, whether the task counts (dense scores >= 20: SmolLM2-135M is
near the floor on some tasks; those are shown but not averaged), dense's score, and each sparse
setting's score with its difference to dense [95% paired bootstrap interval over the prompts];
then the average over counted tasks. JSON (--out) holds every sample and is rewritten as each
(context, task) cell completes.
"""

from __future__ import annotations

import argparse
import re
import time

import torch
from tqdm.auto import tqdm

from oasiskv.eval.fidelity import run_samples
from oasiskv.eval.metrics import paired_bootstrap_ci
from oasiskv.eval.ruler_gen import (
    SEED,
    RulerSample,
    TaskDoesNotFit,
    build_task,
    release,
    task_names,
)
from oasiskv.eval.settings import add_setting_arguments, setting_engines, settings_from_args
from oasiskv.report import markdown_table, parse_list, write_json
from oasiskv.sampling_params import SamplingParams

__all__ = ["COUNT_AT", "postprocess", "score_prediction", "summarize", "run_ruler_eval"]

COUNT_AT = 20.0  # a task counts where dense scores at least this (x100)


def postprocess(pred: str | None) -> str:
    """RULER's `postprocess_pred` (its evaluate.py, which downloads NLTK data at import)."""
    if pred is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def score_prediction(metric: str, pred: str | None, answers: list[str]) -> float:
    """One sample's RULER score, 0..100, by the package's own per-sample metric."""
    from long_context_eval.eval.synthetic import constants

    fn = {"string_match_all": constants.string_match_all_per_sample,
          "string_match_part": constants.string_match_part_per_sample}[metric]
    return float(fn([postprocess(pred)], [answers])[0])


def _requests(max_len: int):
    def requests(sample: RulerSample, kv, _agree_tokens):
        budget = min(sample.tokens_to_generate, max_len - len(sample.ids))
        return [(sample.ids, SamplingParams(temperature=0, max_tokens=budget), kv)]
    return requests


def _judge(sample: RulerSample, outs: list) -> dict:
    out = outs[0]
    if out.finish_reason == "error":
        raise RuntimeError(f"{sample.task} sample {sample.index} failed: {out.error}")
    return {"score": score_prediction(sample.metric, out.text, sample.answers),
            "output": out.text, "tokens": len(out.token_ids)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _delta(per: list[float], dense: list[float]) -> dict:
    lo, hi = paired_bootstrap_ci(per, dense, lambda x, y: x.mean(-1) - y.mean(-1))
    d = _mean(per) - _mean(dense)
    return {"delta": d, "delta_lo": lo, "delta_hi": hi,
            "delta_ci": f"{d:+.1f} [{lo:+.1f}, {hi:+.1f}]"}


def summarize(context: int, task: str, results: dict[str, list[dict]]) -> list[dict]:
    """One row per setting: score (x100), and for sparse its difference to dense."""
    dense = [r["score"] for r in results["dense"]] if "dense" in results else None
    counts = dense is not None and _mean(dense) >= COUNT_AT
    rows = []
    for name, per in results.items():
        scores = [r["score"] for r in per]
        row = {"context": context, "task": task, "setting": name, "samples": len(per),
               "score": _mean(scores), "counts": counts, "scores": scores}
        if all("decode_s" in r for r in per):
            row["decode_s"] = sum(r["decode_s"] for r in per)
        if dense is not None and name != "dense":
            row |= _delta(scores, dense)
        rows.append(row)
    return rows


def wide_table(rows: list[dict], names: list[str]) -> list[dict]:
    """Per (context, task) one row with every setting's score; per context the average over
    counted tasks (Δ's interval: paired bootstrap over the counted tasks' prompts pooled)."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        cell = cells.setdefault((r["context"], r["task"]), {
            "context": r["context"], "task": r["task"], "samples": r["samples"],
            "counts": "yes" if r["counts"] else "no", "_rows": {}})
        cell["_rows"][r["setting"]] = r
        cell[r["setting"]] = r["score"]
        if "delta_ci" in r:
            cell[f"{r['setting']} Δ"] = r["delta_ci"]
    out = []
    for context in dict.fromkeys(c for c, _ in cells):
        mine = [c for (ctx, _), c in cells.items() if ctx == context]
        out += mine
        counted = [c for c in mine if c["counts"] == "yes"]
        avg = {"context": context, "task": f"average ({len(counted)} counted)",
               "samples": sum(c["samples"] for c in counted), "counts": ""}
        for name in names:
            if counted:
                pooled = [s for c in counted for s in c["_rows"][name]["scores"]]
                avg[name] = _mean([c["_rows"][name]["score"] for c in counted])
                if name != "dense" and "dense" in names:
                    dense = [s for c in counted for s in c["_rows"]["dense"]["scores"]]
                    avg[f"{name} Δ"] = _delta(pooled, dense)["delta_ci"]
        out.append(avg)
    return [{k: v for k, v in c.items() if k != "_rows"} for c in out]


def run_ruler_eval(args: argparse.Namespace) -> list[dict]:
    t0 = time.perf_counter()
    contexts = parse_list(args.context)
    tasks = task_names() if args.tasks == "all" else parse_list(args.tasks, str)
    unknown = [t for t in tasks if t not in task_names()]
    if unknown or not tasks:
        raise ValueError(f"unknown RULER task(s) {unknown}; choose from {', '.join(task_names())}")
    if args.samples <= 0:
        raise ValueError(f"--samples must be positive, got {args.samples}")
    settings = settings_from_args(args)
    names, engine_for = setting_engines(args, settings)
    first = engine_for(names[0])
    tokenizer, max_len = first.tokenizer, first.max_model_len
    seed = SEED if args.seed is None else args.seed

    cells, skipped = [], []
    with tqdm(total=len(contexts) * len(tasks), desc="generate", unit="task",
              dynamic_ncols=True) as bar:
        for context in contexts:
            for task in tasks:
                bar.set_description(f"generate {task} {context}")
                try:
                    samples = build_task(task, tokenizer, context, args.samples, seed,
                                         chat=not args.no_chat)
                except TaskDoesNotFit as e:
                    skipped.append({"context": context, "task": task, "reason": str(e)})
                    samples = []
                too_long = [s for s in samples if len(s.ids) >= max_len]
                if too_long:
                    raise ValueError(f"{task} at {context}: a prompt of {len(too_long[0].ids)} "
                                     f"tokens does not fit the model's {max_len}-token window")
                if samples:
                    cells.append((context, task, samples))
                bar.update(1)
    release()  # the generators' word lists and data sets

    rows, per_sample = [], []

    def save(elapsed: float, complete: bool) -> None:
        write_json(args.out, {"eval": "ruler", "model": args.model, "contexts": contexts,
                              "tasks": tasks, "settings": names, "samples": args.samples,
                              "seed": seed, "chat": not args.no_chat, "count_at": COUNT_AT,
                              "threads": torch.get_num_threads(), "time_s": elapsed,
                              "complete": complete, "skipped": skipped, "rows": rows,
                              "table": wide_table(rows, names), "per_sample": per_sample})

    bar = tqdm(total=sum(len(s) for *_, s in cells), desc="eval", unit="prompt",
               dynamic_ncols=True)
    for context, task, samples in cells:
        bar.set_description(f"{task} {context}")
        results = run_samples(engine_for, names, samples, args.group, 0, bar,
                              request_fn=_requests(max_len), judge_fn=_judge)
        rows += summarize(context, task, results)
        per_sample.append({"context": context, "task": task,
                           "samples": [{"index": s.index, "answers": s.answers,
                                        "length": s.length, "prompt_tokens": len(s.ids)}
                                       for s in samples],
                           "results": results})
        save(time.perf_counter() - t0, complete=False)  # a later crash keeps this cell
    bar.close()
    elapsed = time.perf_counter() - t0
    table = wide_table(rows, names)
    columns = [("context", "context"), ("task", "task"), ("samples", "n"),
               ("counts", f"counts (dense ≥ {COUNT_AT:g})")]
    for name in names:
        columns.append((name, name))
        if name != "dense" and "dense" in names:
            columns.append((f"{name} Δ", f"{name} Δ dense [95% CI]"))
    print(f"\n## RULER, {args.model}: {', '.join(names)}; {args.samples} samples per task, "
          f"seed {seed}, {'chat' if not args.no_chat else 'base'} template\n")
    print(markdown_table(table, columns))
    for s in skipped:
        print(f"\nnot run at {s['context']}: {s['reason']}")
    print(f"\nscores x100 as RULER scores them (string_match_all; qa: string_match_part); "
          f"Δ = points vs dense on the same prompts, [95% CI] = paired bootstrap over the "
          f"prompts (an interval that holds 0 is no measured difference); a task counts where "
          f"dense scores ≥ {COUNT_AT:g}; the average is over counted tasks. Every prompt "
          f"prefilled once (dense) and decoded greedily by each setting. {elapsed:.0f} s.")
    save(elapsed, complete=True)
    return rows


COMMANDS = {"ruler": ("NVIDIA's RULER tasks (nvidia-long-context-eval), "
                      "dense vs sparse on the same prompts, scored as RULER scores")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`eval ruler`'s flags: RULER's, and the settings to compare."""
    p.add_argument("--model", default="smollm2-135m",
                   help="model alias, HF directory or .gguf file")
    p.add_argument("--context", default="4096,8192",
                   help="RULER's max_seq_length: prompt + tokens to generate")
    p.add_argument("--tasks", default="all",
                   help="comma-separated RULER tasks (niah_single_1, ..., vt, cwe, fwe, "
                   "qa_1, qa_2) or all")
    p.add_argument("--samples", type=int, default=20, help="prompts per task and context")
    p.add_argument("--seed", type=int, default=42, help="RULER's random_seed (its default)")
    p.add_argument("--out", "--json", dest="out", help="write the figures to this file")
    add_setting_arguments(p)


def run(args: argparse.Namespace) -> int:
    run_ruler_eval(args)
    return 0
