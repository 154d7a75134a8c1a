"""`eval/recall_report.py`: the recall tool's rows from totals filled by hand, and the
standard error of per-prompt means computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from oasiskv.eval.recall import RecallSpec
from oasiskv.eval.recall_probe import Totals
from oasiskv.eval.recall_report import row_label, standard_error, summarize_totals


def test_standard_error_is_the_sample_sd_over_root_n():
    # mean 0.5, sample variance ((0.1)^2 + 0 + (0.1)^2) / 2 = 0.01, s.d. 0.1
    assert standard_error([0.4, 0.5, 0.6]) == pytest.approx(0.1 / math.sqrt(3))
    assert standard_error([0.7]) is None and standard_error([]) is None


def test_rows_average_layers_and_split_by_the_first_draft():
    spec = RecallSpec([2], ["lookahead", "previous"], ["self"])
    t = Totals(2)
    t.scored += torch.tensor([4.0, 2.0])  # scored steps per layer
    t.add((2, "exact", ""), 0, 4.0, 2.0)
    t.add((2, "exact", ""), 1, 2.0, 1.0)
    t.add((2, "lookahead", "self"), 0, 3.0, 1.0)  # layer 0: 3 of 4 steps' sets
    t.add((2, "lookahead", "self"), 1, 1.0, 0.5)  # layer 1: 1 of 2
    t.churn[2] = [torch.tensor([0.0, 0.5]), torch.tensor([1.0])]
    t.draft_steps, t.draft_hits[(2, "self")] = 4, 3
    t.add_by_draft((2, "lookahead", "self"), True, 0.9)
    t.add_by_draft((2, "lookahead", "self"), True, 0.7)
    t.add_by_draft((2, "lookahead", "self"), False, 0.2)
    t.prompt_recall[(2, "lookahead", "self")] = [0.6, 0.7]
    exact, look = summarize_totals(t, spec)  # no previous row: nothing added for it
    assert exact["recall"] == 1.0 and exact["mass"] == 0.5
    assert exact["churn"] == pytest.approx(0.5)
    assert look["per_layer_recall"] == [0.75, 0.5] and look["recall"] == 0.625
    assert look["recall_worst_layer"] == 0.5 and look["draft_accuracy"] == 0.75
    assert look["recall_draft_right"] == pytest.approx(0.8)
    assert look["recall_draft_wrong"] == pytest.approx(0.2)
    assert look["recall_se"] == pytest.approx(statistics_se(0.6, 0.7))
    assert "any_draft_right" not in look  # one draft per row
    assert row_label(look) == "K=2 lookahead+self" and row_label(exact) == "K=2 exact"


def statistics_se(a: float, b: float) -> float:
    """Two samples: s.d. |a - b| / sqrt(2), over sqrt(2)."""
    return abs(a - b) / math.sqrt(2) / math.sqrt(2)
