"""`oasiskv eval recall`: how well each predictor names the blocks the next decode step needs.

Along the DENSE greedy trajectory of a prompt (every step attends to the whole context, so the
trajectory is the model's own and every predictor is judged on the same steps), decode step t
processes x_t at position P = prompt + t and computes, per layer l and KV head g:

- the exact set E_t(l, g): the top-K complete blocks by Quest score (`kv.select.block_scores`,
  the query heads of g summed) of x_t's true query, over per-block kmin/kmax summaries of the
  post-RoPE keys. The block holding x_t (the active block) is not ranked;
- `previous`: the top-K of the same query, ranked over the blocks step t+1 ranks (the same
  blocks, plus the one x_t completes every B-th step);
- `lookahead` with drafter d: the draft token x^_{t+1}(d) rides along with x_t in the same
  forward, at position P+1. At each layer it attends ONLY to E_t(l, g) (per KV head) + x_t's
  block + its own K/V (the working set a sparse engine holds at step t; `--draft-context dense`
  lets it see everything instead: the upper bound), never written to the cache. The top-K of
  its query is the prediction. All drafts of a step go in one forward (one draft row per
  (K, drafter), each seeing only itself among the drafts); x_t itself attends densely.

The predictions made at step t are scored at step t+1 against E_{t+1}:
- recall |P ∩ E_{t+1}| / K per layer (mean over KV heads), averaged over layers, steps, prompts;
- mass: the share of x_{t+1}'s true softmax attention over the complete blocks (mean over query
  heads) that falls in P; the `exact` row gives the mass of E_{t+1} itself, the `oracle` row
  that of the true top-K by x_{t+1}'s attention mass (the query heads of g summed: the
  engine's `oracle` predictor), whose recall is its overlap with E_{t+1}: the gap between the
  two rows is what the Quest bound costs, the rest of the missing mass is the budget K;
- with --rerank c, `lookahead rerank=c` rows: each drafter's best c*K blocks by Quest score,
  re-ranked by the draft query's softmax attention over their keys (the engine's `rerank`);
- draft accuracy: the share of steps whose draft was x_{t+1};
- churn (on the `exact` row): |E_{t+1} \\ E_t| / K, mean and p90 over (prompt, step, layer, KV
  head).

Drafters: `self`, `ngram`, `resync` from `spec.drafters` (each gets the logits of its own draft
row of the previous step, and its own previous draft), and `oracle`: the true next token, read
from the greedy trajectory decoded first (the measured steps then follow that trajectory; the
`greedy_mismatches` figure counts steps where the measured forward's argmax differed).
With --steps S the tool runs S+1 decode steps: steps 0..S-1 carry drafts and predict, steps
1..S score. Step 0's drafts have no draft logits yet: by default each drafter makes its own
cold-start guess (`self` falls back to prompt lookup); `--sync-start` makes step 0's drafts the
true x_1 instead, so that the self chain starts in sync. The choice matters for `self`: its
chain is sticky (after a miss it conditions on its own wrong token and takes many steps to
resync), so over a few dozen steps its accuracy depends on how it starts.

Prompts: exactly --context tokens of plain novel text (no BOS), each from the first paragraph
that begins at or after a fixed character offset of an Austen novel.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from dataclasses import dataclass, field
from math import ceil

import torch
from tqdm.auto import tqdm

from oasiskv.bench.common import markdown_table, parse_list, pyplot, save_figure, write_json
from oasiskv.config import CacheConfig, SpecConfig, head_dir
from oasiskv.context import SeqAttention, set_context
from oasiskv.data.austen import austen_text
from oasiskv.engine.sequence import Sequence
from oasiskv.eval.metrics import block_mass, captured_mass, churn, membership, recall
from oasiskv.kv.blocks import is_contiguous
from oasiskv.kv.select import block_scores, rerank_by_mass, top_k_blocks
from oasiskv.kv.summaries import summarize
from oasiskv.sampling_params import SamplingParams
from oasiskv.spec.drafters import Drafter, make_drafter

# (novel, character offset): each prompt starts at the first paragraph at or after the offset.
PROMPTS: tuple[tuple[str, int], ...] = (("prideprejudice", 206_230), ("emma", 265_135),
                                        ("persuasion", 140_517))
PREDICTORS = ("lookahead", "previous")
ORACLE = "oracle"

# ---- prompts ------------------------------------------------------------------------------

_PARAGRAPH = re.compile(r"(?<=\n\n)[^\n]")


def paragraph_start(text: str, offset: int) -> int:
    """Index of the first paragraph start at or after `offset`: a character that is not a
    newline and follows a blank line ("\\n\\n"), or the text's first character."""
    if offset <= 0 and text[:1] not in ("", "\n"):
        return 0
    m = _PARAGRAPH.search(text, max(offset, 0))
    if m is None:
        raise ValueError(f"no paragraph starts at or after character {offset}")
    return m.start()


def paragraph_prompt(tokenizer, text: str, offset: int, length: int) -> tuple[int, list[int]]:
    """(start, ids): exactly `length` tokens of `text` from the paragraph start at or after
    `offset`, encoded as plain text (no special tokens)."""
    start = paragraph_start(text, offset)
    span = length * 6
    while True:
        ids = tokenizer.encode(text[start:start + span], add_special_tokens=False)
        if len(ids) > length + 8:  # the cut at the slice's end cannot reach our tokens
            return start, ids[:length]
        if start + span >= len(text):
            if len(ids) >= length:
                return start, ids[:length]
            raise ValueError(f"the text after character {start} holds only {len(ids)} tokens, "
                             f"{length} wanted")
        span *= 2


# ---- the probe: ctx.sparse stand-in that sees every layer's queries -----------------------

RowKey = tuple[int, str, str]  # (K, predictor, drafter)


def reranked(c: float) -> str:
    """The predictor name of lookahead rows re-ranked over c*K candidates (`kv.select`)."""
    return f"lookahead rerank={c:g}"


@dataclass
class Totals:
    """Sums over (prompt, scored step) per layer, and the samples the percentiles need."""

    num_layers: int
    recall: dict[RowKey, torch.Tensor] = field(default_factory=dict)
    mass: dict[RowKey, torch.Tensor] = field(default_factory=dict)
    scored: torch.Tensor | None = None  # [L] scored steps per layer
    churn: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    draft_hits: dict[tuple[int, str], int] = field(default_factory=dict)
    draft_steps: int = 0
    greedy_mismatches: int = 0

    def __post_init__(self) -> None:
        self.scored = torch.zeros(self.num_layers, dtype=torch.float64)

    def add(self, key: RowKey, layer: int, r: float | torch.Tensor,
            m: float | torch.Tensor) -> None:
        if key not in self.recall:
            self.recall[key] = torch.zeros(self.num_layers, dtype=torch.float64)
            self.mass[key] = torch.zeros(self.num_layers, dtype=torch.float64)
        self.recall[key][layer] += r
        self.mass[key][layer] += m


class RecallProbe:
    """Set as `ctx.sparse` of a dense decode step (one sequence). Per layer, before attention:
    completes the block summaries, computes the exact sets of the normal query, scores last
    step's predictions against them, predicts with the normal query (`previous`) and masks the
    draft rows to E_t + the active block; after attention: predicts with the draft queries."""

    def __init__(self, model, device_kv: torch.Tensor, seq: Sequence, block_size: int,
                 top_ks: list[int], previous: bool, totals: Totals,
                 draft_context: str = "sparse", record: bool = False,
                 rerank: float = 0.0) -> None:
        self.seq, self.device_kv, self.block = seq, device_kv, block_size
        self.rerank = rerank
        self.top_ks, self.kmax_k = sorted(top_ks), max(top_ks)
        self.previous, self.totals, self.record = previous, totals, record
        self.draft_context = draft_context
        self.scales = [a.scale for a in model.attention_layers()]
        layers, _, hkv, _, d = device_kv.shape
        max_blocks = seq.max_context // block_size + 2
        self.kmin = torch.empty(layers, max_blocks, hkv, d, dtype=torch.float32)
        self.kmax = torch.empty_like(self.kmin)
        self.num_summarized = 0
        self.pending: list[dict[RowKey, torch.Tensor]] = [{} for _ in range(layers)]
        self.last_exact: list[dict[int, torch.Tensor]] = [{} for _ in range(layers)]
        self.queries: list[torch.Tensor] = []  # this step's q per layer (record=True)
        self.step_recall: dict[RowKey, float] = {}  # this step's recall summed over layers

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Post-RoPE keys of token positions [start, end): [Hkv, end-start, d]."""
        pool, table = self.device_kv[layer, 0], self.seq.block_table
        if is_contiguous(table):
            base = table[0] * self.block
            return pool[:, base + start:base + end]
        pos = torch.arange(start, end)
        slots = torch.tensor(table)[pos // self.block] * self.block + pos % self.block
        return pool[:, slots.to(pool.device)]

    def summarize_blocks(self, layer: int, first: int, end: int) -> None:
        if end <= first:
            return
        keys = self.keys(layer, first * self.block, end * self.block)
        hkv, _, d = keys.shape
        kmin, kmax = summarize(keys.reshape(hkv, end - first, self.block, d))
        self.kmin[layer, first:end], self.kmax[layer, first:end] = kmin, kmax

    def prefill_summaries(self, num_tokens: int) -> None:
        n = num_tokens // self.block
        for layer in range(self.kmin.shape[0]):
            self.summarize_blocks(layer, 0, n)
        self.num_summarized = n

    def begin_step(self, pos: int, attns: dict[int, SeqAttention],
                   draft_rows: dict[tuple[int, str], int], predict: bool, score: bool) -> None:
        self.pos, self.attns, self.draft_rows = pos, attns, draft_rows
        self.predict, self.score = predict, score
        self.queries, self.step_recall = [], {}
        if score:
            self.totals.scored += 1

    def _draft_mask(self, sets: torch.Tensor) -> torch.Tensor:
        """E_t (per KV head) + the active block, as token slots of the normal row's view."""
        blocks = membership(sets, self.pos // self.block + 1)
        blocks[:, -1] = True
        return blocks.repeat_interleave(self.block, dim=1)[:, :self.pos + 1]

    def wait_layer(self, layer: int) -> None:
        """Nothing is prefetched here: the probe selects inline."""

    def prepare_layer(self, layer: int, q: torch.Tensor) -> None:
        b = self.block
        n_cur, n_next = self.pos // b, (self.pos + 1) // b
        if n_next > n_cur:  # x_t's K (written just before this call) completes its block
            self.summarize_blocks(layer, n_cur, n_next)
        kmin, kmax = self.kmin[layer, :n_next], self.kmax[layer, :n_next]
        scores = block_scores(q[0], kmin, kmax)  # [Hkv, n_next]
        top = top_k_blocks(scores[:, :n_cur], self.kmax_k)
        exact = {k: top[:, :k] for k in self.top_ks}
        if self.score:
            self._score(layer, q[0], exact, n_cur)
        self.last_exact[layer] = exact
        self.pending[layer] = {}
        if not self.predict:
            return
        if self.previous:
            top_next = top_k_blocks(scores, self.kmax_k)
            for k in self.top_ks:
                self.pending[layer][(k, "previous", "")] = top_next[:, :k]
        for k, attn in self.attns.items():
            attn.draft_valid = (None if self.draft_context == "dense"
                                else self._draft_mask(exact[k]))

    def after_attention(self, layer: int, q: torch.Tensor) -> None:
        if self.record:
            self.queries.append(q.detach().clone())
        if not self.predict or not self.draft_rows:
            return
        n_next = (self.pos + 1) // self.block
        kmin, kmax = self.kmin[layer, :n_next], self.kmax[layer, :n_next]
        if self.rerank:
            keys = self.keys(layer, 0, n_next * self.block).unflatten(1, (n_next, self.block))
            heads = torch.arange(keys.shape[0])[:, None]
        for (k, drafter), row in self.draft_rows.items():
            scores = block_scores(q[row], kmin, kmax)
            self.pending[layer][(k, "lookahead", drafter)] = top_k_blocks(scores, k)
            if self.rerank:  # candidates [Hkv, c] -> their keys [Hkv, c*B, d]
                mass = rerank_by_mass(scores, q[row], lambda c: keys[heads, c].flatten(1, 2),
                                      self.scales[layer], self.block, ceil(self.rerank * k))
                self.pending[layer][(k, reranked(self.rerank), drafter)] = top_k_blocks(mass, k)

    def _score(self, layer: int, q: torch.Tensor, exact: dict[int, torch.Tensor],
               n: int) -> None:
        mass = block_mass(q, self.keys(layer, 0, n * self.block), self.scales[layer], self.block)
        totals = self.totals
        for key, pred in self.pending[layer].items():
            e = exact[key[0]]
            r = recall(pred, e).mean()
            totals.add(key, layer, r, captured_mass(mass, pred).mean())
            self.step_recall[key] = self.step_recall.get(key, 0.0) + float(r)
        group_mass = mass.view(exact[self.kmax_k].shape[0], -1, n).sum(1)  # [Hkv, n]
        for k, e in exact.items():
            totals.add((k, "exact", ""), layer, 1.0, captured_mass(mass, e).mean())
            ideal = top_k_blocks(group_mass, k)  # what the Quest bound misses
            totals.add((k, "oracle", ""), layer, recall(ideal, e).mean(),
                       captured_mass(mass, ideal).mean())
            totals.churn.setdefault(k, []).append(churn(e, self.last_exact[layer][k]))


# ---- driving the model ------------------------------------------------------------------------

@dataclass
class RecallSpec:
    top_ks: list[int]
    predictors: list[str]
    drafters: list[str]
    steps: int = 48
    draft_context: str = "sparse"  # "sparse": E_t + active block; "dense": everything
    sync_start: bool = False  # step 0's drafts are the true x_1 (chains start in sync)
    temperature: float = 0.0  # > 0: the trajectory is sampled (seeded), not greedy
    seed: int = 0
    rerank: float = 0.0  # > 0: lookahead rows re-ranked over rerank*K candidates too

    def __post_init__(self) -> None:
        bad = [p for p in self.predictors if p not in PREDICTORS]
        if bad or not self.predictors:
            raise ValueError(f"predictors must be among {PREDICTORS}, got {self.predictors}")
        for d in self.drafters:
            if head_dir(d) is not None:
                SpecConfig(drafter=d)  # raises when the directory holds no head
            elif d != ORACLE:
                make_drafter(d)  # raises on an unknown name
        if len({head_dir(d) for d in self.drafters} - {None}) > 1:
            raise ValueError("one head directory per run (its features ride on the forward)")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not self.top_ks or min(self.top_ks) <= 0:
            raise ValueError(f"top-K values must be positive, got {self.top_ks}")
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.draft_context not in ("sparse", "dense"):
            raise ValueError(f"draft context must be sparse or dense, got {self.draft_context}")
        CacheConfig(rerank=self.rerank)  # raises on a bad value

    @property
    def lookahead_drafters(self) -> list[str]:
        return self.drafters if "lookahead" in self.predictors else []


def prefill(engine, ids: list[int], max_tokens: int, bar=None, temperature: float = 0.0,
            seed: int = 0) -> tuple[Sequence, float]:
    """Prefills a prompt through the engine (chunked, dense) up to its first token (greedy, or
    sampled at `temperature` with `seed`; later engine steps continue the same way)."""
    seq = engine.make_sequence(ids, SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
        seed=seed if temperature > 0 else None))
    engine.add_sequence(seq)
    t0 = time.perf_counter()
    while seq.num_output_tokens == 0 and not seq.is_finished:
        engine.step()
        if bar is not None:
            bar.set_postfix_str(f"prefill {seq.num_computed_tokens}/{len(ids)}")
    if seq.is_finished:
        raise RuntimeError(f"prefill failed: {seq.error or seq.finish_reason}")
    return seq, time.perf_counter() - t0


def greedy_trajectory(engine, seq: Sequence, num: int) -> list[int]:
    """Decodes the first `num` output tokens densely through the engine (greedy, or sampled as
    the sequence's parameters say), then rewinds the sequence to its state after prefill
    (prompt + first token, prompt KV only)."""
    while seq.num_output_tokens < num and not seq.is_finished:
        engine.step()
    if seq.is_finished:
        raise RuntimeError(f"greedy decode failed: {seq.error or seq.finish_reason}")
    out = seq.output_token_ids[:num]
    del seq.token_ids[seq.num_prompt_tokens + 1:]
    seq.num_computed_tokens = seq.num_prompt_tokens
    return out


def decode_step(engine, seq: Sequence, drafts: dict[tuple[int, str], int],
                probe: RecallProbe | None, predict: bool = True, score: bool = True,
                drafter: Drafter | None = None,
                ) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor]]:
    """One dense decode step of `seq` (its last token) with draft rows, outside the scheduler.
    Draft rows of each K get their own SeqAttention (same rows of the normal token, its own
    draft_valid). Returns the normal row's logits [V] and each draft row's logits; the caller
    advances the sequence. A `drafter` reading target features observes the normal row's."""
    runner, model = engine.runner, engine.runner.model
    engine.kv.grow(seq, seq.num_computed_tokens + 1)
    seq.draft_tokens = list(drafts.values())
    try:
        input_ids, positions, ctx = runner.prepare([(seq, 1)])
    finally:
        seq.draft_tokens = []
    base = ctx.seqs[0]
    rows = dict(zip(drafts, base.draft_rows, strict=True))
    attns: dict[int, SeqAttention] = {}
    for k in dict.fromkeys(k for k, _ in drafts):
        attns[k] = dataclasses.replace(base, draft_rows=[r for (kk, _), r in rows.items()
                                                          if kk == k], draft_valid=None)
    ctx.seqs, ctx.sparse = list(attns.values()) or [base], probe
    if probe is not None:
        probe.begin_step(seq.num_computed_tokens, attns, rows, predict, score)
    with torch.inference_mode():
        set_context(ctx)
        try:
            hidden = model(input_ids, positions, drafter.feature_layers if drafter else ())
        finally:
            set_context(None)
        if drafter is not None:
            hidden, features = hidden
            drafter.observe(seq.request_id, seq.num_computed_tokens, features[:1])
        logits = model.compute_logits(hidden[[0, *rows.values()]]).float()
    return logits[0], {key: logits[1 + i] for i, key in enumerate(rows)}


def measure_prompt(engine, ids: list[int], spec: RecallSpec, totals: Totals,
                   bar=None, record: bool = False) -> dict:
    """Prefill + S+1 measured decode steps of one prompt; adds its figures to `totals`.
    Returns timings, the trajectory x_0..x_S (`output_ids`), each (K, drafter)'s drafts
    (`drafts["K/d"][t]` guessed x_{t+1}), each row's recall per scored step, mean over layers
    (`step_recall["K/predictor[/d]"][t]`: step t's prediction of E_{t+1}) and, with record,
    every step's per-layer queries."""
    t_start = time.perf_counter()
    drafters = {d: make_drafter(d, target=engine.model)
                for d in spec.lookahead_drafters if d != ORACLE}
    heads = [d for d in drafters.values() if d.feature_layers]
    eagle = heads[0] if heads else None
    for other in heads[1:]:  # the same head (one directory per run): one state, one observer
        other.head, other.states = eagle.head, eagle.states
    if eagle is not None:  # it reads the prompt's features as the engine prefills
        engine.drafter, engine.runner.aux_layers = eagle, eagle.feature_layers
    try:
        seq, prefill_s = prefill(engine, ids, spec.steps + 8, bar, spec.temperature, spec.seed)
    finally:
        engine.drafter, engine.runner.aux_layers = None, ()
    try:
        p = seq.num_prompt_tokens
        oracle = ORACLE in spec.lookahead_drafters or (spec.sync_start
                                                        and bool(spec.lookahead_drafters))
        follow = oracle or spec.temperature > 0  # measured steps follow a decoded trajectory
        trajectory = greedy_trajectory(engine, seq, spec.steps + 1) if follow else None
        probe = RecallProbe(engine.runner.model, engine.runner.device_kv, seq,
                            engine.config.cache.block_size, spec.top_ks,
                            "previous" in spec.predictors, totals, spec.draft_context, record,
                            spec.rerank)
        probe.prefill_summaries(p)
        keys = [(k, d) for k in spec.top_ks for d in spec.lookahead_drafters]
        last_logits: dict[tuple[int, str], torch.Tensor] = {}
        last_draft: dict[tuple[int, str], int] = {}
        recorded = []
        history: dict[str, list[int]] = {f"{k}/{d}": [] for k, d in keys}
        step_recall: dict[str, list[float]] = {}
        layers = engine.model_config.num_layers
        for t in range(spec.steps + 1):
            predict = t < spec.steps
            drafts = {}
            if predict:
                for k, d in keys:
                    if d == ORACLE or (t == 0 and spec.sync_start):
                        drafts[(k, d)] = trajectory[t + 1]
                    else:
                        drafts[(k, d)] = drafters[d].propose(
                            seq.token_ids, last_logits.get((k, d)), last_draft.get((k, d)), 1,
                            seq.request_id)[0]
            normal, draft_logits = decode_step(engine, seq, drafts, probe, predict, t > 0,
                                               eagle)
            for (k, pred, d), total in probe.step_recall.items():
                step_recall.setdefault(f"{k}/{pred}/{d}".rstrip("/"), []).append(total / layers)
            token = int(normal.argmax())
            if trajectory is not None and t + 1 < len(trajectory):
                totals.greedy_mismatches += spec.temperature == 0 and token != trajectory[t + 1]
                token = trajectory[t + 1]  # follow the dense trajectory the oracle reads
            if predict:
                totals.draft_steps += 1
                for key, draft in drafts.items():
                    totals.draft_hits[key] = totals.draft_hits.get(key, 0) + (draft == token)
                    history[f"{key[0]}/{key[1]}"].append(draft)
            last_logits, last_draft = draft_logits, drafts
            if record:
                recorded.append({"queries": probe.queries, "rows": dict(probe.draft_rows)})
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
            if bar is not None:
                bar.update(1)
    finally:
        engine.abort(seq.request_id)
    out = {"prefill_s": prefill_s, "total_s": time.perf_counter() - t_start,
           "output_ids": seq.output_token_ids[:spec.steps + 1], "drafts": history,
           "step_recall": step_recall}
    if record:
        out["steps"] = recorded
    return out


# ---- results ----------------------------------------------------------------------------------

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
                   "mass": float((totals.mass[key] / scored).mean()),
                   "per_layer_recall": per_layer,
                   "per_layer_mass": (totals.mass[key] / scored).tolist()}
            if key[1].startswith("lookahead"):
                row["draft_accuracy"] = totals.draft_hits.get((k, key[2]), 0) / max(
                    totals.draft_steps, 1)
            if key[1] == "exact" and totals.churn.get(k):
                samples = torch.cat(totals.churn[k])
                row["churn"] = float(samples.mean())
                row["churn_p90"] = float(torch.quantile(samples, 0.9))
            rows.append(row)
    return rows


COLUMNS = [("top_k", "K"), ("predictor", "predictor"), ("drafter", "drafter"),
           ("recall", "recall"), ("recall_worst_layer", "worst layer"),
           ("draft_accuracy", "draft right"), ("mass", "attn mass"), ("churn", "churn mean"),
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


def run_recall(llm, prompts: list[dict], spec: RecallSpec, progress: bool | None = None,
               record: bool = False) -> dict:
    """Measures every prompt ({"ids": [...], ...}); returns {"rows", "prompts", "totals"}."""
    engine = llm.engine
    cfg = engine.model_config
    need = max(len(p["ids"]) for p in prompts) + spec.steps + 2
    if need > engine.max_model_len:
        raise ValueError(f"context + steps needs {need} positions, the model has "
                         f"{engine.max_model_len}")
    totals = Totals(cfg.num_layers)
    bar = tqdm(total=len(prompts) * (spec.steps + 1), desc="recall", unit="step",
               disable=None if progress is None else not progress, dynamic_ncols=True)
    done = []
    for p in prompts:
        bar.set_description(p.get("name", "prompt"))
        done.append({**{k: v for k, v in p.items() if k != "ids"}, "tokens": len(p["ids"]),
                     **measure_prompt(engine, p["ids"], spec, totals, bar, record)})
    bar.close()
    return {"rows": summarize_totals(totals, spec), "prompts": done, "totals": totals}


def austen_prompts(tokenizer, count: int, length: int) -> list[dict]:
    if not 0 < count <= len(PROMPTS):
        raise ValueError(f"--prompts must be in 1..{len(PROMPTS)}, got {count}")
    out = []
    for novel, offset in PROMPTS[:count]:
        start, ids = paragraph_prompt(tokenizer, austen_text(novel), offset, length)
        out.append({"name": novel, "offset": offset, "start": start, "ids": ids})
    return out


def run_recall_eval(args: argparse.Namespace) -> list[dict]:
    from oasiskv.llm import LLM

    t0 = time.perf_counter()
    spec = RecallSpec(top_ks=parse_list(args.top_k), predictors=parse_list(args.predictor, str),
                      drafters=parse_list(args.drafter, str), steps=args.steps,
                      draft_context=args.draft_context, sync_start=args.sync_start,
                      temperature=args.temperature, seed=args.seed, rerank=args.rerank)
    kwargs = {"model": args.model, "dtype": args.dtype, "kv_mode": "dense",
              "block_size": args.block_size}
    if args.num_threads:
        kwargs["num_threads"] = args.num_threads
    llm = LLM(**kwargs)
    prompts = austen_prompts(llm.tokenizer, args.prompts, args.context)
    result = run_recall(llm, prompts, spec)
    rows = result["rows"]
    elapsed = time.perf_counter() - t0
    totals = result["totals"]
    cfg = llm.engine.model_config
    trajectory = (f"sampled at T={spec.temperature} (seed {spec.seed})" if spec.temperature
                  else "greedy")
    print(f"\n## next-step block recall, {args.model} ({cfg.num_layers} layers, "
          f"{cfg.num_kv_heads} KV heads), {len(prompts)} prompts x {args.context} tokens, "
          f"{spec.steps} scored steps, B={args.block_size}, drafts over the "
          f"{spec.draft_context} set, draft chains started "
          f"{'in sync (step 0: true x_1)' if spec.sync_start else 'cold'}, "
          f"trajectory {trajectory}\n")
    print(markdown_table(rows, COLUMNS))
    print(f"\nrecall = |predicted ∩ exact next-step top-K| / K (mean over layers, KV heads, "
          f"steps, prompts); attn mass = share of the next token's attention over complete "
          f"blocks inside the predicted blocks; churn = |E_t+1 \\ E_t| / K. Greedy "
          f"mismatches: {totals.greedy_mismatches}. {elapsed:.0f} s.")
    payload = {"eval": "recall", "model": args.model, "dtype": args.dtype,
               "context": args.context, "steps": spec.steps, "block_size": args.block_size,
               "top_k": spec.top_ks, "predictors": spec.predictors, "drafters": spec.drafters,
               "draft_context": spec.draft_context, "sync_start": spec.sync_start,
               "temperature": spec.temperature, "seed": spec.seed, "rerank": spec.rerank,
               "num_layers": cfg.num_layers,
               "threads": torch.get_num_threads(), "greedy_mismatches": totals.greedy_mismatches,
               "time_s": elapsed, "prompts": result["prompts"], "rows": rows}
    write_json(args.json, payload)
    if args.plot:
        plot_recall(rows, args.plot, f"{args.model}: next-step top-K recall per layer "
                    f"({len(prompts)}x{args.context} tok, {spec.steps} steps)")
    return rows


__all__ = ["PROMPTS", "RecallProbe", "RecallSpec", "Totals", "block_mass", "captured_mass",
           "churn", "decode_step", "measure_prompt", "paragraph_prompt", "paragraph_start",
           "plot_recall", "recall", "run_recall", "run_recall_eval"]
