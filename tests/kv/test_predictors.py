"""One class per predictor (`kv/predictors.py`): CacheConfig.predictor's string maps to it;
each says whether it selects on the critical path, whether it needs drafts, which rows'
queries predict the next step, and which block scorers rank (hand-computed cases)."""

from types import SimpleNamespace

import pytest

from oasiskv.config import CacheConfig
from oasiskv.config_checks import PREDICTORS as NAMES
from oasiskv.context import SeqAttention
from oasiskv.kv.predictors import (
    PREDICTORS,
    Exact,
    Lookahead,
    Oracle,
    Previous,
    make_predictor,
)
from oasiskv.kv.scorers import AttentionMass, QuestBound, Rerank

WITH_DRAFTS = SeqAttention(4, 5, 48, 0, None, draft_rows=[9, 10])
NO_DRAFTS = SeqAttention(4, 5, 48, 0, None)


def test_every_configurable_name_has_its_class():
    assert tuple(PREDICTORS) == NAMES
    for name, cls in (("lookahead", Lookahead), ("previous", Previous), ("exact", Exact),
                      ("oracle", Oracle)):
        assert type(make_predictor(CacheConfig(kv_mode="sparse", predictor=name))) is cls


def test_an_unknown_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"predictor must be one of .*'lookahead'.*got 'x'"):
        make_predictor(SimpleNamespace(predictor="x"))


def stages(predictor) -> list:
    return [(type(s), getattr(s, "candidates", None)) for s in predictor.scorers]


def test_lookahead():
    p = make_predictor(CacheConfig(kv_mode="sparse", predictor="lookahead", rerank=0))
    assert (p.critical_path, p.uses_drafts) == (False, True)
    # the drafts' (mixed by their weights); no drafts this step: the step's own
    assert p.query_rows([WITH_DRAFTS, NO_DRAFTS]) == [[9, 10], [4]]
    assert stages(p) == [(QuestBound, None)]


def test_previous():
    p = make_predictor(CacheConfig(kv_mode="sparse", predictor="previous", rerank=0))
    assert (p.critical_path, p.uses_drafts) == (False, False)
    assert p.query_rows([WITH_DRAFTS, NO_DRAFTS]) == [[4], [4]]
    assert stages(p) == [(QuestBound, None)]


def test_exact_with_rerank():
    """rerank 1.5 at K = 3: ceil(4.5) = 5 candidates per KV head."""
    p = make_predictor(CacheConfig(kv_mode="sparse", predictor="exact", top_k=3, rerank=1.5))
    assert (p.critical_path, p.uses_drafts) == (True, False)
    assert stages(p) == [(QuestBound, None), (Rerank, 5)]


def test_rerank_of_every_block_needs_no_first_stage():
    """rerank=inf: every block re-scored, so no summary bound shortlists them."""
    p = make_predictor(CacheConfig(kv_mode="sparse", top_k=3, rerank=float("inf")))
    assert stages(p) == [(Rerank, None)]


def test_oracle_ranks_by_attention_mass_alone():
    """No summaries to bound, nothing to rerank (its rerank setting is ignored)."""
    p = make_predictor(CacheConfig(kv_mode="sparse", predictor="oracle", rerank=2))
    assert (p.critical_path, p.uses_drafts) == (True, False)
    assert stages(p) == [(AttentionMass, None)]
