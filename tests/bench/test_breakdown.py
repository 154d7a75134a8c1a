"""The step-time breakdown (`bench/breakdown.py`, `bench throughput --breakdown`): nested ranges
count once, for the innermost category; the categories add up to the step; a dense engine does
no selection and a sparse one does; the instrumentation is undone afterwards."""

import json

import pytest
import torch
from conftest import build_model_dir
from torch.autograd.profiler_util import FunctionEvent

from oasiskv import LLM, SamplingParams
from oasiskv.bench.breakdown import CATEGORIES, attribute, profile_steps
from oasiskv.cli import main
from oasiskv.kv.residency import SparseKV
from oasiskv.prefetch import executor


def ev(i, name, start, end, thread=1, parent=None):
    e = FunctionEvent(i, name, thread, start, end)
    if parent is not None:
        e.cpu_parent = parent
        parent.append_cpu_child(e)
    return e


def test_nested_ranges_count_for_the_innermost_category():
    """A hand-made step of 100 us: attention 10-60 with selection 20-30 inside (an op in each),
    linear 70-80, an op of its own at 85-90 (other); a worker thread's stage 40-75."""
    step = ev(0, "oasiskv:step", 0, 100)
    att = ev(1, "oasiskv:attention", 10, 60, parent=step)
    sel = ev(2, "oasiskv:selection", 20, 30, parent=att)
    op_sel = ev(3, "aten::topk", 21, 29, parent=sel)
    inner = ev(4, "aten::empty", 22, 23, parent=op_sel)  # inside an op: not counted again
    op_att = ev(5, "aten::mm", 35, 55, parent=att)
    lin = ev(6, "oasiskv:linear", 70, 80, parent=step)
    op_lin = ev(7, "aten::linear", 71, 79, parent=lin)
    op_other = ev(8, "aten::add", 85, 90, parent=step)
    bg = ev(9, "oasiskv:selection", 40, 75, thread=2)
    b = attribute([step, att, sel, op_sel, inner, op_att, lin, op_lin, op_other, bg], 1)
    assert b.steps == 1 and b.step_ms == pytest.approx(0.1)
    assert b.ms == pytest.approx({"attention": 0.04, "linear": 0.01, "selection": 0.01,
                                  "other": 0.04})
    assert b.ops == {"attention": 1, "linear": 1, "selection": 1, "other": 1}
    assert b.background_ms == pytest.approx(0.035)


EXTRA = 2000  # ops the sparse KV's per-layer masks get on top (a marker)


@pytest.mark.parametrize("mode", [{}, {"kv_mode": "sparse", "top_k": 2}])
def test_profiled_steps_add_up_and_leave_the_engine_as_it_was(tiny_llama, mode, monkeypatch):
    prepare = SparseKV.prepare_layer

    def busier(self, layer, q):  # called inside attention, counted as selection
        for _ in range(EXTRA):
            torch.zeros(1)
        return prepare(self, layer, q)

    monkeypatch.setattr(SparseKV, "prepare_layer", busier)
    llm = LLM(str(tiny_llama), device_kv_budget="4MiB", host_kv_budget="4MiB", **mode)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for p in ([3 + i for i in range(90)], [5 + i for i in range(70)]):
        engine.add_request(p, params)
    for _ in range(4):  # prefill and first decodes
        engine.step()
    run = executor._run
    b = profile_steps(engine, 3)
    assert b.steps == 3 and b.step_ms > 0
    assert sum(b.ms.values()) == pytest.approx(b.step_ms)
    assert all(b.ms[c] > 0 for c in ("attention", "linear", "other"))
    assert b.ops["attention"] > 0 and b.ops["linear"] > 0
    if engine.sparse is None:
        assert b.ms["selection"] == 0 and b.ops["selection"] == 0
    else:
        layers = engine.model_config.num_layers
        assert b.ms["selection"] > 0 and b.ops["selection"] >= EXTRA * layers
        assert b.ops["attention"] < EXTRA
        assert not set(vars(engine.sparse)) & {"prepare_layer", "end_step"}  # unwrapped
    assert executor._run is run
    assert all(not m._forward_hooks and not m._forward_pre_hooks
               for m in engine.model.modules())
    outs = [engine.step() for _ in range(2)]  # steps on as before
    assert all(isinstance(o, list) for o in outs)


def test_throughput_breakdown_table(tmp_path, capsys):
    model = build_model_dir(tmp_path / "m", num_hidden_layers=2, max_position_embeddings=1024)
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(model), "--context", "200",
                 "--concurrency", "2", "--output-len", "8", "--device-kv-budget", "1MiB",
                 "--top-k", "2", "--breakdown", "3", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    table = printed.split("### step breakdown")[1]
    assert "roofline ms" in table and "attention ms" in table and "selection ms" in table
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    for r in rows.values():
        parts = sum(r[f"{c}_ms"] for c in CATEGORIES)
        assert parts == pytest.approx(r["profiled_step_ms"]) and r["roofline_ms"] > 0
        assert r["profiled_running"] == 2
    assert rows["sparse"]["selection_ms"] > 0 and rows["dense"]["selection_ms"] == 0


def test_breakdown_steps_must_not_be_negative(tmp_path, capsys):
    assert main(["bench", "throughput", "--model", "smollm2-135m", "--breakdown", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--breakdown" in err
