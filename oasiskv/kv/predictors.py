"""Predictors: which query chooses a sparse request's working set, when, and how its blocks
are scored (CacheConfig.predictor names one; `make_predictor` maps the name to its class).

- `Lookahead`: after a layer's attention, the step's drafts' query (their mean weighted by
  each one's chance of being taken) predicts the next step's blocks, fetched in the
  background (paper §3.3);
- `Previous`: the same with the step's own query;
- `Exact`: the step's own query selects for the step itself, before attention (the critical
  path);
- `Oracle`: as exact, ranked by the true attention mass over every key (an upper bound).

The summary predictors score with the Quest bound, then the rerank when it is on
(`kv/scorers.py`); the oracle by attention mass. On a request's first step (no earlier step
chose its blocks) every predictor selects on the critical path.
"""

from __future__ import annotations

from typing import ClassVar

from oasiskv.config import CacheConfig
from oasiskv.context import SeqAttention
from oasiskv.kv.scorers import AttentionMass, BlockScorer, QuestBound, Rerank, rerank_candidates


class Predictor:
    name: ClassVar[str]
    critical_path: ClassVar[bool] = False  # selects for the step itself, before attention
    uses_drafts: ClassVar[bool] = False  # predicts with drafts (the engine needs a drafter)

    def __init__(self, scorers: tuple[BlockScorer, ...]) -> None:
        self.scorers = scorers  # applied in order; the top-K of the last stage's scores

    @classmethod
    def from_config(cls, cfg: CacheConfig) -> Predictor:
        if not cfg.reranks:
            return cls((QuestBound(),))
        c = rerank_candidates(cfg.rerank, cfg.top_k)
        if c is None:  # every block re-scored: no shortlist to bound
            return cls((Rerank(None),))
        return cls((QuestBound(), Rerank(c)))

    def query_rows(self, attns: list[SeqAttention]) -> list[list[int]]:
        """Per request, the rows of the step's batch whose queries predict its next blocks
        (after the layer's attention; a critical-path predictor selects with the step's row
        before it instead). One call a layer for the batch."""
        return [[a.q_start] for a in attns]


class Lookahead(Predictor):
    name = "lookahead"
    uses_drafts = True

    def query_rows(self, attns: list[SeqAttention]) -> list[list[int]]:
        # every draft's row (mixed by their weights: `select.mixed_queries`); a step without
        # drafts predicts as previous does
        return [a.draft_rows or [a.q_start] for a in attns]


class Previous(Predictor):
    name = "previous"


class Exact(Predictor):
    name = "exact"
    critical_path = True


class Oracle(Predictor):
    name = "oracle"
    critical_path = True

    @classmethod
    def from_config(cls, cfg: CacheConfig) -> Predictor:
        return cls((AttentionMass(),))  # no summaries to bound or rerank


PREDICTORS: dict[str, type[Predictor]] = {
    cls.name: cls for cls in (Lookahead, Previous, Exact, Oracle)}


def make_predictor(cfg: CacheConfig) -> Predictor:
    """CacheConfig.predictor -> its predictor (ValueError naming the choices otherwise)."""
    cls = PREDICTORS.get(cfg.predictor)
    if cls is None:
        raise ValueError(f"predictor must be one of {tuple(PREDICTORS)}, got {cfg.predictor!r}")
    return cls.from_config(cfg)
