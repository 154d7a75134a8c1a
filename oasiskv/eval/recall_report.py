"""`oasiskv eval recall`'s results: one row per (K, predictor, drafter) from the totals a run
gathered (`recall_probe.Totals`), the table's columns, and the per-layer recall plot."""

from __future__ import annotations

import math
import statistics
from typing import TYPE_CHECKING

import torch

from oasiskv.eval.recall_probe import Totals, reranked
from oasiskv.report import pyplot, save_figure

if TYPE_CHECKING:
    from oasiskv.eval.recall import RecallSpec


def summarize_totals(totals: Totals, spec: RecallSpec) -> list[dict]:
    """One row per (K, predictor, drafter), in table order."""
    rows = []
    scored = totals.scored.clamp(min=1)
    for k in spec.top_ks:
        keys = [(k, "exact", ""), (k, "oracle", "")]
        keys += [(k, "previous", "")] if "previous" in spec.predictors else []
        keys += [(k, "lookahead", d) for d in spec.lookahead_drafters]
        if spec.rerank:
            keys += [(k, reranked(spec.rerank), d) for d in spec.lookahead_drafters]
        for key in keys:
            if key not in totals.recall:
                continue
            per_layer = (totals.recall[key] / scored).tolist()
            row = {"top_k": k, "predictor": key[1], "drafter": key[2] or None,
                   "recall": sum(per_layer) / len(per_layer), "recall_worst_layer": min(per_layer),
                   "recall_se": standard_error(totals.prompt_recall.get(key, [])),
                   "mass": float((totals.mass[key] / scored).mean()),
                   "per_layer_recall": per_layer,
                   "per_layer_mass": (totals.mass[key] / scored).tolist()}
            if key[1].startswith("lookahead"):
                steps = max(totals.draft_steps, 1)
                row["draft_accuracy"] = totals.draft_hits.get((k, key[2]), 0) / steps
                if spec.num_drafts > 1:
                    row["any_draft_right"] = totals.any_draft_hits.get((k, key[2]), 0) / steps
                for name, split in (("right", totals.when_right), ("wrong", totals.when_wrong)):
                    total, n = split.get(key, (0.0, 0))
                    row[f"recall_draft_{name}"] = total / n if n else None
            if key[1] == "exact" and totals.churn.get(k):
                samples = torch.cat(totals.churn[k])
                row["churn"] = float(samples.mean())
                row["churn_p90"] = float(torch.quantile(samples, 0.9))
            rows.append(row)
    return rows


def standard_error(means: list[float]) -> float | None:
    """The standard error of the mean of per-prompt means (their sample s.d. / sqrt(n)): how far
    the row's recall may move with other passages. None below two prompts."""
    n = len(means)
    return statistics.stdev(means) / math.sqrt(n) if n > 1 else None


COLUMNS = [("top_k", "K"), ("predictor", "predictor"), ("drafter", "drafter"),
           ("recall", "recall"), ("recall_se", "± s.e."), ("recall_worst_layer", "worst layer"),
           ("draft_accuracy", "draft right"), ("recall_draft_right", "recall if right"),
           ("recall_draft_wrong", "recall if wrong"), ("any_draft_right", "any draft right"),
           ("mass", "attn mass"), ("churn", "churn mean"),
           ("churn_p90", "churn p90")]


def row_label(row: dict) -> str:
    name = row["predictor"] + (f"+{row['drafter']}" if row["drafter"] else "")
    return f"K={row['top_k']} {name}"


def plot_recall(rows: list[dict], path: str, title: str = "") -> None:
    """Per-layer recall, one line per row (colour: predictor/drafter, line style: K)."""
    plt = pyplot()

    names = list(dict.fromkeys((r["predictor"], r["drafter"]) for r in rows))
    styles = ["-", "--", ":", "-."]
    ks = list(dict.fromkeys(r["top_k"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 5))
    for r in rows:
        colour = plt.get_cmap("tab10")(names.index((r["predictor"], r["drafter"])) % 10)
        ax.plot(range(len(r["per_layer_recall"])), r["per_layer_recall"], marker=".",
                color=colour, linestyle=styles[ks.index(r["top_k"]) % len(styles)],
                label=row_label(r))
    ax.set_xlabel("layer")
    ax.set_ylabel(r"recall $|P \cap E_{t+1}|\,/\,K$")
    ax.set_title(title or "per-layer recall of the next step's exact top-K blocks")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    save_figure(fig, path)


