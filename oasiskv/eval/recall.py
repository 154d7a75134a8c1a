"""`oasiskv eval recall`: how well each predictor names the blocks the next decode step needs.

Along the DENSE greedy trajectory of each prompt, every decode step runs with a
`RecallProbe` (`eval/recall_probe.py`, which defines the figures: the exact sets, each
predictor's prediction, recall, attention mass, churn) and one draft row per (K, drafter)
(--num-drafts N: N rows, the drafter's best guesses, mixed as the engine mixes them);
the predictions of step t are scored at step t+1.

Drafters: `self`, `ngram`, `resync` from `spec.drafters` (each gets the logits of its own draft
row of the previous step, and its own previous draft: with several rows, the row that was
right if one was, else the first, as in the engine), and `oracle`: the true next token, read
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
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from oasiskv.config import CacheConfig, SpecConfig, head_dir
from oasiskv.context import SeqAttention, StepContext
from oasiskv.data.austen import austen_text
from oasiskv.data.passages import paragraph_prompt
from oasiskv.eval.recall_probe import RecallProbe, RowKey, Totals
from oasiskv.eval.recall_report import COLUMNS, plot_recall, summarize_totals
from oasiskv.models.random_model import refuse_random
from oasiskv.report import markdown_table, parse_list, write_json
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence
from oasiskv.spec.drafters import Drafter, chained_draft, make_drafter, sampling_weights

# (novel, character offset): each prompt starts at the first paragraph at or after the offset.
# The first three are the study protocol (the default); the rest cover all six novels,
# Persuasion (the drafter's held-out novel) among them, for `--prompts` up to 12.
PROMPTS: tuple[tuple[str, int], ...] = (
    ("prideprejudice", 206_230), ("emma", 265_135), ("persuasion", 140_517),
    ("sensesensibility", 300_000), ("mansfieldpark", 400_000), ("northangerabbey", 200_000),
    ("persuasion", 320_000), ("prideprejudice", 450_000), ("emma", 600_000),
    ("sensesensibility", 520_000), ("mansfieldpark", 700_000), ("northangerabbey", 40_000))
PREDICTORS = ("lookahead", "previous")
ORACLE = "oracle"

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
    num_drafts: int = 1  # draft rows per (K, drafter), mixed as the engine mixes them

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
        if self.num_drafts <= 0:
            raise ValueError(f"num_drafts must be positive, got {self.num_drafts}")
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


def decode_step(engine, seq: Sequence, drafts: dict[tuple[int, str], list[int]],
                probe: RecallProbe | None, predict: bool = True, score: bool = True,
                drafter: Drafter | None = None,
                weights: dict[tuple[int, str], list[float] | None] | None = None,
                ) -> tuple[torch.Tensor, dict[tuple[int, str], torch.Tensor]]:
    """One dense decode step of `seq` (its last token) with draft rows (each (K, drafter) its
    drafts, best first, with the drafter's `weights`), outside the scheduler
    (`LLMEngine.forward`). Draft rows of each K get their own SeqAttention (same rows of the
    normal token, its own draft_valid). Returns the normal row's logits [V] and each key's
    draft rows' logits [n, V]; the caller advances the sequence. A `drafter` reading target
    features observes the normal row's."""
    views: dict[int, SeqAttention] = {}

    def split_drafts(ctx: StepContext) -> None:
        """One view per K, the probe as the layers' hooks."""
        base = ctx.seqs[0]
        free = iter(base.draft_rows)
        rows = {key: [next(free) for _ in tokens] for key, tokens in drafts.items()}
        for k in dict.fromkeys(k for k, _ in drafts):
            views[k] = dataclasses.replace(base, draft_rows=[r for (kk, _), rs in rows.items()
                                                             if kk == k for r in rs],
                                           draft_valid=None)
        ctx.seqs, ctx.sparse = list(views.values()) or [base], probe
        if probe is not None:
            probe.begin_step(seq.num_computed_tokens, views, rows, weights or {}, predict,
                             score)

    seq.draft_tokens = [t for tokens in drafts.values() for t in tokens]
    try:
        out = engine.forward(seq, 1, aux_layers=drafter.feature_layers if drafter else (),
                             edit_context=split_drafts)
    finally:
        seq.draft_tokens = []
    if drafter is not None:
        drafter.observe(seq.request_id, seq.num_computed_tokens, out.features[0][:1])
    # a view's draft rows: those of its K's keys, in order (None: none)
    per_view = dict(zip(views, out.draft_logits, strict=True)) if views else {}
    at, by_key = dict.fromkeys(views, 0), {}
    for (k, d), tokens in drafts.items():
        logits = per_view[k] if per_view[k] is not None else out.logits[:0]
        by_key[(k, d)], at[k] = logits[at[k]:at[k] + len(tokens)], at[k] + len(tokens)
    return out.logits[0], by_key


def measure_prompt(engine, ids: list[int], spec: RecallSpec, totals: Totals,
                   bar=None, record: bool = False) -> dict:
    """Prefill + S+1 measured decode steps of one prompt; adds its figures to `totals`.
    Returns timings, the trajectory x_0..x_S (`output_ids`), each (K, drafter)'s first drafts
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
        engine.attach_drafter(eagle)
    try:
        seq, prefill_s = prefill(engine, ids, spec.steps + 8, bar, spec.temperature, spec.seed)
    finally:
        engine.attach_drafter(None)
    try:
        p = seq.num_prompt_tokens
        oracle = ORACLE in spec.lookahead_drafters or (spec.sync_start
                                                        and bool(spec.lookahead_drafters))
        follow = oracle or spec.temperature > 0  # measured steps follow a decoded trajectory
        trajectory = greedy_trajectory(engine, seq, spec.steps + 1) if follow else None
        probe = RecallProbe(engine.model, engine.device_kv, seq,
                            engine.config.cache.block_size, spec.top_ks,
                            "previous" in spec.predictors, totals, spec.draft_context, record,
                            spec.rerank, engine.config.cache.summary_splits)
        probe.prefill_summaries(p)
        keys = [(k, d) for k in spec.top_ks for d in spec.lookahead_drafters]
        last_logits: dict[tuple[int, str], torch.Tensor] = {}
        last_draft: dict[tuple[int, str], int] = {}
        recorded = []
        history: dict[str, list[int]] = {f"{k}/{d}": [] for k, d in keys}
        step_recall: dict[RowKey, list[float]] = {}
        was_right: dict[tuple[int, str], bool] = {}  # the last step's first drafts
        layers = engine.model_config.num_layers
        for t in range(spec.steps + 1):
            predict = t < spec.steps
            drafts, weights = {}, {}
            if predict:
                for k, d in keys:
                    if d == ORACLE or (t == 0 and spec.sync_start):
                        drafts[(k, d)] = [trajectory[t + 1]]
                    else:
                        drafts[(k, d)], probs = drafters[d].propose_weighted(
                            seq.token_ids, last_logits.get((k, d)), last_draft.get((k, d)),
                            spec.num_drafts, seq.request_id)
                        weights[(k, d)] = sampling_weights(probs, len(drafts[(k, d)]),
                                                           spec.temperature)
            normal, draft_logits = decode_step(engine, seq, drafts, probe, predict, t > 0,
                                               eagle, weights)
            for (k, pred, d), total in probe.step_recall.items():  # the last step's predictions
                step_recall.setdefault((k, pred, d), []).append(total / layers)
                if (k, d) in was_right:
                    totals.add_by_draft((k, pred, d), was_right[(k, d)], total / layers)
            token = int(normal.argmax())
            if trajectory is not None and t + 1 < len(trajectory):
                totals.greedy_mismatches += spec.temperature == 0 and token != trajectory[t + 1]
                token = trajectory[t + 1]  # follow the dense trajectory the oracle reads
            if predict:
                totals.draft_steps += 1
                for key, tokens in drafts.items():
                    was_right[key] = tokens[0] == token
                    totals.draft_hits[key] = totals.draft_hits.get(key, 0) + was_right[key]
                    totals.any_draft_hits[key] = (totals.any_draft_hits.get(key, 0)
                                                  + (token in tokens))
                    history[f"{key[0]}/{key[1]}"].append(tokens[0])
                    right = chained_draft(tokens, token)  # the engine's rule
                    last_logits[key], last_draft[key] = draft_logits[key][right], tokens[right]
            if record:
                recorded.append({"queries": probe.queries,
                                 "rows": {key: rs[0] for key, rs in probe.draft_rows.items()}})
            seq.num_computed_tokens += 1
            seq.token_ids.append(token)
            if bar is not None:
                bar.update(1)
    finally:
        engine.abort(seq.request_id)
    for key, steps in step_recall.items():
        totals.prompt_recall.setdefault(key, []).append(sum(steps) / len(steps))
    out = {"prefill_s": prefill_s, "total_s": time.perf_counter() - t_start,
           "output_ids": seq.output_token_ids[:spec.steps + 1], "drafts": history,
           "step_recall": {f"{k}/{pred}/{d}".rstrip("/"): steps
                           for (k, pred, d), steps in step_recall.items()}}
    if record:
        out["steps"] = recorded
    return out


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
                      temperature=args.temperature, seed=args.seed, rerank=args.rerank,
                      num_drafts=args.num_drafts)
    refuse_random(args.model, "eval recall")
    kwargs = {"model": args.model, "dtype": args.dtype, "kv_mode": "dense",
              "block_size": args.block_size, "device": args.device}
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
    print(markdown_table(rows, [c for c in COLUMNS if any(c[0] in r for r in rows)]))
    print(f"\nrecall = |predicted ∩ exact next-step top-K| / K (mean over layers, KV heads, "
          f"steps, prompts); ± s.e. = standard error over the prompts' means; recall if "
          f"right / wrong = the same over the steps whose first draft was right / wrong "
          f"(recall = draft right x the one + the rest x the other); attn mass = share of the "
          f"next token's attention over complete blocks inside the predicted blocks; churn = "
          f"|E_t+1 \\ E_t| / K. Greedy mismatches: {totals.greedy_mismatches}. {elapsed:.0f} s.")
    payload = {"eval": "recall", "model": args.model, "dtype": args.dtype,
               "context": args.context, "steps": spec.steps, "block_size": args.block_size,
               "top_k": spec.top_ks, "predictors": spec.predictors, "drafters": spec.drafters,
               "draft_context": spec.draft_context, "sync_start": spec.sync_start,
               "temperature": spec.temperature, "seed": spec.seed, "rerank": spec.rerank,
               "num_drafts": spec.num_drafts, "num_layers": cfg.num_layers,
               "threads": torch.get_num_threads(), "greedy_mismatches": totals.greedy_mismatches,
               "time_s": elapsed, "prompts": result["prompts"], "rows": rows}
    write_json(args.json, payload)
    if args.plot:
        plot_recall(rows, args.plot, f"{args.model}: next-step top-K recall per layer "
                    f"({len(prompts)}x{args.context} tok, {spec.steps} steps)")
    return rows


__all__ = ["PROMPTS", "RecallSpec", "decode_step", "measure_prompt", "plot_recall",
           "run_recall", "run_recall_eval", "summarize_totals"]
