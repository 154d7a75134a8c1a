"""`oasiskv eval recall`: the draft rows see what they should, the normal token is untouched,
the figures are the ones defined, the CLI writes its files."""

import json

import pytest
import torch
from conftest import KnownAndDecoy

from oasiskv import LLM
from oasiskv.cli import main
from oasiskv.eval import recall as rc
from oasiskv.eval.recall import RecallSpec, decode_step, prefill, run_recall, summarize_totals
from oasiskv.eval.recall_probe import RecallProbe, Totals

CONTEXT = 200  # 12 complete blocks of 16, the 13th partial



@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), kv_mode="dense", device_kv_budget="4MiB")


def prompt_ids(n: int = CONTEXT) -> list[int]:
    return [(i * 7 + i // 5) % 300 + 3 for i in range(n)]


def draft_queries_vs_next(result: dict, key: tuple[int, str]) -> float:
    """Largest |q_draft(step t, layer l) - q_normal(step t+1, layer l)| over steps, layers."""
    steps = result["prompts"][0]["steps"]
    worst = 0.0
    for now, nxt in zip(steps, steps[1:], strict=False):
        row = now["rows"][key]
        for q_now, q_next in zip(now["queries"], nxt["queries"], strict=True):
            worst = max(worst, float((q_now[row] - q_next[0]).abs().max()))
    return worst


# ---- the must-show: an oracle draft's queries are the next step's queries ------------------

def test_oracle_draft_queries_are_the_next_steps_when_k_covers_all_blocks(llm):
    spec = RecallSpec([64], ["lookahead", "previous"], ["oracle", "self"], steps=5)
    result = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False, record=True)
    assert draft_queries_vs_next(result, (64, "oracle")) < 1e-4
    rows = {(r["predictor"], r["drafter"]): r for r in result["rows"]}
    assert rows[("lookahead", "oracle")]["recall"] == 1.0
    assert rows[("lookahead", "oracle")]["draft_accuracy"] == 1.0
    assert result["totals"].greedy_mismatches == 0
    assert result["totals"].scored.tolist() == [5.0, 5.0]


def test_oracle_over_the_whole_context_is_exact_for_small_k(llm):
    """draft-context dense: the oracle's query is the next query, so its top-K is E_{t+1}."""
    spec = RecallSpec([2, 4], ["lookahead"], ["oracle"], steps=5, draft_context="dense")
    result = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False, record=True)
    assert draft_queries_vs_next(result, (2, "oracle")) < 1e-4
    for row in result["rows"]:
        if row["predictor"] == "lookahead":
            assert row["recall"] == 1.0, row


def test_oracle_sets_hold_the_most_attention_mass(llm):
    """The oracle row's sets are the true top-K by attention mass: no other set of K blocks per
    KV head (the Quest-bound exact set, any prediction) holds more of the next token's mass."""
    spec = RecallSpec([2, 4], ["lookahead", "previous"], ["self", "oracle"], steps=4)
    result = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False)
    for k in (2, 4):
        rows = [r for r in result["rows"] if r["top_k"] == k]
        oracle = next(r for r in rows if r["predictor"] == "oracle")
        for r in rows:
            for a, b in zip(oracle["per_layer_mass"], r["per_layer_mass"], strict=True):
                assert a >= b - 1e-9, (r["predictor"], r["drafter"])
        assert 0 < oracle["recall"] <= 1


@pytest.mark.parametrize("rerank", [8, float("inf")])
def test_rerank_over_every_block_with_the_true_query_is_the_oracle(llm, rerank):
    """draft-context dense + oracle drafter: the draft query is the next query; re-ranked
    over every block (rerank*K >= blocks, or inf), the sets are the true top-K by its
    attention mass, the oracle row's, computed there by another path."""
    spec = RecallSpec([2, 4], ["lookahead"], ["oracle"], steps=4, draft_context="dense",
                      rerank=rerank)
    rows = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False)["rows"]
    name = f"lookahead rerank={rerank:g}"
    for k in (2, 4):
        by = {r["predictor"]: r for r in rows if r["top_k"] == k}
        assert by[name]["per_layer_mass"] == pytest.approx(by["oracle"]["per_layer_mass"],
                                                           abs=1e-6)
        assert by[name]["recall"] == pytest.approx(by["oracle"]["recall"])
        assert by[name]["draft_accuracy"] == 1.0
        assert by["lookahead"]["recall"] == 1.0  # the Quest top-K of the next query
        assert by["lookahead"]["mass"] < by[name]["mass"]  # can fail
    with pytest.raises(ValueError, match="rerank must be 0"):
        RecallSpec([2], ["lookahead"], ["oracle"], rerank=0.5)


def test_sparse_drafts_see_only_the_exact_set(llm):
    """With K < blocks the oracle draft's layer-0 query (embedding + RoPE only) is the next
    step's, its layer-1 query is not: layer 0's attention was masked to E_t + active block."""
    spec = RecallSpec([2], ["lookahead"], ["oracle"], steps=3)
    result = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False, record=True)
    steps = result["prompts"][0]["steps"]
    row = steps[0]["rows"][(2, "oracle")]
    assert torch.allclose(steps[0]["queries"][0][row], steps[1]["queries"][0][0], atol=1e-5)
    assert not torch.allclose(steps[0]["queries"][1][row], steps[1]["queries"][1][0],
                              atol=1e-3)


def test_draft_mask_is_exact_set_plus_active_block(llm):
    seq = llm.engine.make_sequence(prompt_ids(40))
    probe = RecallProbe(llm.engine.runner.model, llm.engine.runner.device_kv, seq, 16, [2],
                        False, Totals(2))
    probe.pos = 37  # x_t at 37: blocks 0, 1 complete, block 2 (32..37) active
    mask = probe._draft_mask(torch.tensor([[1], [0]]))
    assert mask.shape == (2, 38)
    want = torch.zeros(2, 38, dtype=torch.bool)
    want[0, 16:32] = want[1, 0:16] = True
    want[:, 32:38] = True
    assert torch.equal(mask, want)


def test_sync_start_makes_step_0s_drafts_the_true_next_token(llm):
    spec = RecallSpec([2], ["lookahead"], ["self", "ngram"], steps=3, sync_start=True)
    result = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False)
    p = result["prompts"][0]
    assert p["drafts"]["2/self"][0] == p["drafts"]["2/ngram"][0] == p["output_ids"][1]
    assert result["totals"].greedy_mismatches == 0  # the trajectory was decoded first


def test_a_drafters_chain_goes_on_from_the_draft_that_was_right(llm, monkeypatch):
    """Two drafts per row, a wrong one first: the next step's drafter gets the right row's
    draft and logits, which (drafts over the dense context) are the next step's."""
    ids = prompt_ids()
    oracle = RecallSpec([2], ["lookahead"], ["oracle"], steps=4)
    greedy = run_recall(llm, [{"ids": ids}], oracle, progress=False)["prompts"][0]["output_ids"]
    spy = KnownAndDecoy(len(ids), greedy, next(t for t in range(5, 300) if t not in greedy),
                        decoy_first=True)
    monkeypatch.setattr(rc, "make_drafter", lambda name, **kwargs: spy)
    spec = RecallSpec([2], ["lookahead"], ["known"], steps=4, draft_context="dense",
                      num_drafts=2)
    result = run_recall(llm, [{"ids": ids}], spec, progress=False)
    chained = [c for c in spy.calls[1:] if c[1] is not None]  # calls[0]: the spec's check
    assert len(chained) == spec.steps - 1
    for tokens, logits, prev in chained:
        assert prev == tokens[-1]
        assert int(logits.argmax()) == greedy[len(tokens) - len(ids)]
    row = next(r for r in result["rows"] if r["predictor"] == "lookahead")
    assert row["draft_accuracy"] == 0 and row["any_draft_right"] == 1


# ---- the normal token is not disturbed -----------------------------------------------------

def test_normal_logits_do_not_change_with_draft_rows(llm):
    engine = llm.engine
    seq, _ = prefill(engine, prompt_ids(), 8)
    try:
        probe = RecallProbe(engine.runner.model, engine.runner.device_kv, seq, 16, [2, 4],
                            True, Totals(2))
        probe.prefill_summaries(seq.num_prompt_tokens)
        drafts = {(2, "a"): [5], (2, "b"): [9, 3], (4, "a"): [5], (4, "b"): [17]}
        with_drafts, draft_logits = decode_step(engine, seq, drafts, probe, True, False)
        alone, none = decode_step(engine, seq, {}, None)
        assert none == {} and set(draft_logits) == set(drafts)
        assert [len(draft_logits[key]) for key in drafts] == [1, 2, 1, 1]
        torch.testing.assert_close(with_drafts, alone, atol=1e-5, rtol=1e-5)
        # a draft row sees only itself among the drafts: 9's logits without 3 beside it
        _, nine = decode_step(engine, seq, {(2, "b"): [9]}, probe, True, False)
        torch.testing.assert_close(nine[(2, "b")][0], draft_logits[(2, "b")][0], atol=1e-5,
                                   rtol=1e-5)
        # The same token through the engine's own dense step agrees too.
        engine.step()
        assert seq.token_ids[-1] == int(alone.argmax())
    finally:
        engine.abort(seq.request_id)


def test_exact_sets_with_summary_splits_are_the_top_k_of_the_split_bound(llm):
    """summary_splits=2 (the engine's setting, as `run_recall` passes it): the probe's
    summaries are each 8-token half-block's min/max, and its exact sets the top-K of the
    largest half-block bound per block (the group's Quest bounds summed), by hand."""
    engine = llm.engine
    seq, _ = prefill(engine, prompt_ids(), 8)
    try:
        probe = RecallProbe(engine.runner.model, engine.runner.device_kv, seq, 16, [4], False,
                            Totals(2), summary_splits=2)
        probe.prefill_summaries(seq.num_prompt_tokens)
        n = CONTEXT // 16
        pos = seq.num_computed_tokens  # the first token's K/V is not written: no block fills
        probe.begin_step(pos, {}, {}, {}, predict=False, score=False)
        for layer in range(2):
            keys = probe.keys(layer, 0, n * 16).unflatten(1, (n, 2, 8))  # [Hkv, n, 2, 8, d]
            kmin, kmax = probe.summaries(layer, n)  # [n*2, Hkv, d]
            assert torch.equal(kmin, keys.amin(3).flatten(1, 2).transpose(0, 1))
            assert torch.equal(kmax, keys.amax(3).flatten(1, 2).transpose(0, 1))
            q = torch.randn(1, 4, keys.shape[-1])  # [N, H, d]: 2 query heads per KV head
            probe.prepare_layer(layer, q)
            qg = q[0].view(2, 2, 1, 1, 1, -1)  # [Hkv, G, 1, 1, 1, d]
            bound = torch.maximum(qg * keys.amin(3)[:, None, :, :, None],
                                  qg * keys.amax(3)[:, None, :, :, None]).sum(-1)
            want = bound.squeeze(-1).sum(1).amax(-1).topk(4).indices  # [Hkv, 4]
            got = probe.last_exact[layer][4]
            assert all(set(got[g].tolist()) == set(want[g].tolist()) for g in range(2))
    finally:
        engine.abort(seq.request_id)


# ---- the figures on hand-made sets -----------------------------------------------------------

def test_totals_average_per_layer_and_take_the_churn_percentile():
    spec = RecallSpec([2], ["previous"], [], steps=2)
    totals = Totals(2)
    for step_recall in ((1.0, 0.5), (0.5, 0.0)):  # two scored steps
        totals.scored += 1
        for layer, r in enumerate(step_recall):
            totals.add((2, "previous", ""), layer, r, r / 2)
            totals.add((2, "exact", ""), layer, 1.0, 0.9)
    totals.churn[2] = [torch.arange(10, dtype=torch.float64) / 10]
    rows = {r["predictor"]: r for r in summarize_totals(totals, spec)}
    prev = rows["previous"]
    assert prev["per_layer_recall"] == [0.75, 0.25]
    assert prev["recall"] == 0.5 and prev["recall_worst_layer"] == 0.25
    assert prev["mass"] == pytest.approx(0.25)
    assert rows["exact"]["churn"] == pytest.approx(0.45)
    assert rows["exact"]["churn_p90"] == pytest.approx(0.81)


def test_recall_apart_by_whether_the_first_draft_was_right(llm):
    """recall if right and if wrong: the mean step recall over the steps whose first draft did
    or did not guess the next token, worked out again from the per-step figures; together,
    weighted by the draft accuracy, they make the row's recall."""
    spec = RecallSpec([2, 4], ["lookahead"], ["self", "ngram"], steps=12)
    result = run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False)
    p = result["prompts"][0]
    both = 0
    for row in result["rows"]:
        if row["predictor"] != "lookahead":
            continue
        k, d = row["top_k"], row["drafter"]
        drafts, recall = p["drafts"][f"{k}/{d}"], p["step_recall"][f"{k}/lookahead/{d}"]
        right = [r for j, r in enumerate(recall) if drafts[j] == p["output_ids"][j + 1]]
        wrong = [r for j, r in enumerate(recall) if drafts[j] != p["output_ids"][j + 1]]
        assert len(right) + len(wrong) == spec.steps
        for name, steps in (("right", right), ("wrong", wrong)):
            want = sum(steps) / len(steps) if steps else None
            assert row[f"recall_draft_{name}"] == pytest.approx(want), (row, name)
        a = len(right) / spec.steps
        assert row["draft_accuracy"] == pytest.approx(a)
        assert row["recall"] == pytest.approx(a * (row["recall_draft_right"] or 0)
                                              + (1 - a) * (row["recall_draft_wrong"] or 0))
        both += bool(right and wrong)
    assert both  # some row has steps of each kind


# ---- the command ---------------------------------------------------------------------------

def test_cli_end_to_end_writes_json_and_plot(tiny_llama, tmp_path, monkeypatch, capsys):
    paragraphs = [f"Chapter {i}. It is a truth universally acknowledged, that a single man "
                  f"in possession of a good fortune, must be in want of a wife.\nLine {i}."
                  for i in range(3000)]
    monkeypatch.setattr(rc, "austen_text", lambda novel: "\n\n".join(paragraphs))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc_ = main(["eval", "recall", "--model", str(tiny_llama), "--context", "120", "--prompts",
                "2", "--steps", "4", "--top-k", "2,4", "--predictor", "lookahead,previous",
                "--drafter", "self,ngram,resync,oracle", "--json", str(out_json), "--plot",
                str(out_png), "--num-threads", "1"])
    out = capsys.readouterr()
    assert rc_ == 0, out.err
    data = json.loads(out_json.read_text())
    assert data["eval"] == "recall" and data["steps"] == 4 and data["top_k"] == [2, 4]
    assert [p["name"] for p in data["prompts"]] == ["prideprejudice", "emma"]
    assert all(p["tokens"] == 120 and p["start"] >= p["offset"] for p in data["prompts"])
    labels = [(r["top_k"], r["predictor"], r["drafter"]) for r in data["rows"]]
    assert labels == [(k, p, d) for k in (2, 4) for p, d in
                      [("exact", None), ("oracle", None), ("previous", None),
                       ("lookahead", "self"),
                       ("lookahead", "ngram"), ("lookahead", "resync"),
                       ("lookahead", "oracle")]]
    for row in data["rows"]:
        assert 0 <= row["recall"] <= 1 and len(row["per_layer_recall"]) == 2
        assert 0 <= row["mass"] <= 1 + 1e-6
        if row["predictor"] in ("exact", "oracle"):
            continue
        key = "/".join(str(x) for x in (row["top_k"], row["predictor"], row["drafter"]) if x)
        per_step = [v for p in data["prompts"] for v in p["step_recall"][key]]
        assert len(per_step) == 2 * 4 and sum(per_step) / 8 == pytest.approx(row["recall"])
        # two prompts' means a and b: s.d. |a - b| / sqrt(2), over sqrt(2) -> |a - b| / 2
        a, b = (sum(p["step_recall"][key]) / 4 for p in data["prompts"])
        assert row["recall_se"] == pytest.approx(abs(a - b) / 2)
    for p in data["prompts"]:
        assert len(p["output_ids"]) == 5 and all(len(d) == 4 for d in p["drafts"].values())
        assert p["drafts"]["2/oracle"] == p["output_ids"][1:]
    assert all(r["draft_accuracy"] == 1.0 for r in data["rows"] if r["drafter"] == "oracle")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| K | predictor | drafter | recall | ± s.e. |" in out.out


def test_eagle_drafter_reads_the_prompt_and_each_steps_features(llm, tiny_eagle):
    """The eagle row's drafts are the head's batch forward over the measured trajectory, so
    the prompt's features (from the engine's prefill) and every step's reach it."""
    from oasiskv.spec.drafters import make_drafter
    from oasiskv.train.features import target_features

    head_dir, _ = tiny_eagle
    spec = RecallSpec([2], ["lookahead"], [f"eagle:{head_dir}"], steps=6)
    ids = prompt_ids(100)
    result = run_recall(llm, [{"ids": ids}], spec, progress=False)
    out = result["prompts"][0]
    drafts = out["drafts"][f"2/eagle:{head_dir}"]
    tokens = ids + out["output_ids"]
    head = make_drafter(f"eagle:{head_dir}", target=llm.engine.model).head
    feats = target_features(llm.engine, tokens, tuple(head.config.aux_layers), False)["features"]
    p = len(ids)
    hidden, _ = head(torch.tensor(tokens[1:])[None], feats[None, :-1].float(),
                     torch.arange(1, len(tokens)))
    batch = head.d2t[head.logits(hidden[0]).argmax(-1)].tolist()  # batch[q-1] guesses x_{q+1}
    assert drafts == batch[p - 1:p - 1 + len(drafts)]


def test_resync_eagle_beside_eagle_shares_its_head_state(llm, tiny_eagle):
    """Both head drafters in one run: one head state, so after each miss resync-eagle's
    draft is eagle's (the chain branch is checked in tests/spec/test_eagle.py)."""
    head_dir, _ = tiny_eagle
    names = [f"eagle:{head_dir}", f"resync-eagle:{head_dir}", "self"]
    out = run_recall(llm, [{"ids": prompt_ids(100)}], RecallSpec([2], ["lookahead"], names,
                                                                 steps=16),
                     progress=False)["prompts"][0]
    eagle, mixed, chain = (out["drafts"][f"2/{n}"] for n in names)
    x = out["output_ids"]  # drafts[t] guessed x[t + 1]
    assert mixed[0] == eagle[0]
    branches = set()
    for t in range(1, len(mixed)):
        if mixed[t - 1] != x[t]:  # a miss: the head's guess
            branches.add("head")
            assert mixed[t] == eagle[t], t
        elif chain[t - 1] == x[t]:  # both chains right: the same draft row, the same guess
            branches.add("chain")
            assert mixed[t] == chain[t], t
    assert "head" in branches, (mixed, x)


def test_sampled_trajectory_is_seeded(llm):
    def trajectory(seed):
        spec = RecallSpec([2], ["previous"], [], steps=8, temperature=1.5, seed=seed)
        return run_recall(llm, [{"ids": prompt_ids()}], spec, progress=False)[
            "prompts"][0]["output_ids"]

    greedy = run_recall(llm, [{"ids": prompt_ids()}], RecallSpec([2], ["previous"], [], steps=8),
                        progress=False)["prompts"][0]["output_ids"]
    assert trajectory(1) == trajectory(1)
    assert trajectory(1) != trajectory(2) or trajectory(1) != greedy
