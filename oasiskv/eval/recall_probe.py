"""The probe of `oasiskv eval recall` (`eval/recall.py`): set as `ctx.sparse` of a dense decode
step, it sees every layer's queries and computes the figures.

Along the DENSE greedy trajectory of a prompt (every step attends to the whole context, so the
trajectory is the model's own and every predictor is judged on the same steps), decode step t
processes x_t at position P = prompt + t and computes, per layer l and KV head g:

- the exact set E_t(l, g): the top-K complete blocks by Quest score (`kv.select.block_scores`,
  the query heads of g summed) of x_t's true query, over per-block kmin/kmax summaries of the
  post-RoPE keys (with the engine's summary_splits S, of each B/S-token sub-block, a block
  scoring its sub-blocks' largest, as the sparse engine scores). The block holding x_t (the
  active block) is not ranked;
- `previous`: the top-K of the same query, ranked over the blocks step t+1 ranks (the same
  blocks, plus the one x_t completes every B-th step);
- `lookahead` with drafter d: the draft token x^_{t+1}(d) rides along with x_t in the same
  forward, at position P+1. At each layer it attends ONLY to E_t(l, g) (per KV head) + x_t's
  block + its own K/V (the working set a sparse engine holds at step t; `--draft-context dense`
  lets it see everything instead: the upper bound), never written to the cache. The top-K of
  its query is the prediction (with several drafts per (K, drafter), their mean weighted as
  the engine weighs them: `spec.drafters.sampling_weights`, `kv.select.mixed_queries`). All
  drafts of a step go in one forward, each seeing only itself among the drafts; x_t itself
  attends densely.

The predictions made at step t are scored at step t+1 against E_{t+1}:
- recall |P ∩ E_{t+1}| / K per layer (mean over KV heads), averaged over layers, steps, prompts;
- mass: the share of x_{t+1}'s true softmax attention over the complete blocks (mean over query
  heads) that falls in P; the `exact` row gives the mass of E_{t+1} itself, the `oracle` row
  that of the true top-K by x_{t+1}'s attention mass (the query heads of g summed: the
  engine's `oracle` predictor), whose recall is its overlap with E_{t+1}: the gap between the
  two rows is what the Quest bound costs, the rest of the missing mass is the budget K;
- with --rerank c, `lookahead rerank=c` rows: each drafter's best c*K blocks by Quest score,
  re-ranked by the draft query's softmax attention over their keys (the engine's `rerank`);
- draft accuracy: the share of steps whose (first) draft was x_{t+1}; with several drafts per
  row (`--num-drafts`), `any draft right` counts steps where one of them was;
- churn (on the `exact` row): |E_{t+1} \\ E_t| / K, mean and p90 over (prompt, step, layer, KV
  head).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from oasiskv.context import SeqAttention
from oasiskv.eval.metrics import block_mass, captured_mass, churn, membership, recall
from oasiskv.kv.blocks import is_contiguous
from oasiskv.kv.scorers import rerank_candidates
from oasiskv.kv.select import block_scores, mixed_queries, rerank_by_mass, top_k_blocks
from oasiskv.kv.summaries import summarize
from oasiskv.sequence import Sequence

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
    any_draft_hits: dict[tuple[int, str], int] = field(default_factory=dict)
    # lookahead rows: (recall sum, steps) of the steps whose first draft was right / wrong
    when_right: dict[RowKey, list[float]] = field(default_factory=dict)
    when_wrong: dict[RowKey, list[float]] = field(default_factory=dict)
    prompt_recall: dict[RowKey, list[float]] = field(default_factory=dict)  # per prompt: mean
    draft_steps: int = 0
    greedy_mismatches: int = 0

    def __post_init__(self) -> None:
        self.scored = torch.zeros(self.num_layers, dtype=torch.float64)

    def add_by_draft(self, key: RowKey, right: bool, step_recall: float) -> None:
        """One scored step of a lookahead row, apart by whether its first draft was right."""
        split = (self.when_right if right else self.when_wrong).setdefault(key, [0.0, 0])
        split[0] += step_recall
        split[1] += 1

    def add(self, key: RowKey, layer: int, r: float | torch.Tensor,
            m: float | torch.Tensor) -> None:
        if key not in self.recall:
            self.recall[key] = torch.zeros(self.num_layers, dtype=torch.float64)
            self.mass[key] = torch.zeros(self.num_layers, dtype=torch.float64)
        self.recall[key][layer] += r
        self.mass[key][layer] += m


class RecallProbe:
    """Set as `ctx.sparse` of a dense decode step (one sequence), a `context.LayerHooks`. Per
    layer, before attention: completes the block summaries, computes the exact sets of the
    normal query, scores last step's predictions against them, predicts with the normal query
    (`previous`) and masks the draft rows to E_t + the active block; after attention: predicts
    with the draft queries."""

    def __init__(self, model, device_kv: torch.Tensor, seq: Sequence, block_size: int,
                 top_ks: list[int], previous: bool, totals: Totals,
                 draft_context: str = "sparse", record: bool = False,
                 rerank: float = 0.0, summary_splits: int = 1) -> None:
        self.seq, self.device_kv, self.block = seq, device_kv, block_size
        self.rerank, self.splits = rerank, summary_splits
        self.top_ks, self.kmax_k = sorted(top_ks), max(top_ks)
        self.previous, self.totals, self.record = previous, totals, record
        self.draft_context = draft_context
        self.scales = [a.scale for a in model.attention_layers()]
        layers, _, hkv, _, d = device_kv.shape
        max_blocks = seq.max_context // block_size + 2
        # [L, blocks * S, Hkv, d]: S summary rows per block (`kv.summaries.summarize`)
        self.kmin = torch.empty(layers, max_blocks * summary_splits, hkv, d, dtype=torch.float32)
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
        kmin, kmax = summarize(keys.reshape(hkv, end - first, self.block, d), self.splits)
        rows = slice(first * self.splits, end * self.splits)
        self.kmin[layer, rows], self.kmax[layer, rows] = kmin, kmax

    def summaries(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kmin, kmax of the first n blocks: [n * S, Hkv, d] each."""
        return self.kmin[layer, :n * self.splits], self.kmax[layer, :n * self.splits]

    def prefill_summaries(self, num_tokens: int) -> None:
        n = num_tokens // self.block
        for layer in range(self.kmin.shape[0]):
            self.summarize_blocks(layer, 0, n)
        self.num_summarized = n

    def begin_step(self, pos: int, attns: dict[int, SeqAttention],
                   draft_rows: dict[tuple[int, str], list[int]],
                   draft_weights: dict[tuple[int, str], list[float] | None],
                   predict: bool, score: bool) -> None:
        self.pos, self.attns = pos, attns
        self.draft_rows, self.draft_weights = draft_rows, draft_weights
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
        kmin, kmax = self.summaries(layer, n_next)
        scores = block_scores(q[0], kmin, kmax, splits=self.splits)  # [Hkv, n_next]
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
        kmin, kmax = self.summaries(layer, n_next)
        if self.rerank:
            keys = self.keys(layer, 0, n_next * self.block).unflatten(1, (n_next, self.block))
            heads = torch.arange(keys.shape[0])[:, None]
        for (k, drafter), rows in self.draft_rows.items():
            # [H, d], mixed as the engine mixes them
            query = mixed_queries(q[rows][None], [self.draft_weights.get((k, drafter))])[0]
            scores = block_scores(query, kmin, kmax, splits=self.splits)
            self.pending[layer][(k, "lookahead", drafter)] = top_k_blocks(scores, k)
            if self.rerank:  # candidates [Hkv, c] -> their keys [Hkv, c*B, d]
                c = rerank_candidates(self.rerank, k) or n_next  # inf: every block
                mass = rerank_by_mass(scores, query, lambda c: keys[heads, c].flatten(1, 2),
                                      self.scales[layer], self.block, c)
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
