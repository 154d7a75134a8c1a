"""Each block scorer (`kv/scorers.py`) on a case small enough to compute by hand (eager, so the
values are exact up to float rounding): the Quest bound, the oracle's attention mass and the
rerank over a previous stage's candidates."""

import math
from types import SimpleNamespace

import pytest
import torch

from oasiskv.kv import rerank, select
from oasiskv.kv.scorers import AttentionMass, BlockScorer, QuestBound, Rerank

INF = float("inf")


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    for fn in (select.weighted_scores, rerank.candidate_mass):
        monkeypatch.setattr(fn, "_run", fn.eager)


def job(kv, picks, lengths) -> SimpleNamespace:
    """What a scorer reads of a selection job: one layer (0), the requests' picks
    (decode, queries [1, H, d]), their complete blocks."""
    n = max(lengths)
    ids = torch.stack([torch.nn.functional.pad(d.summary_ids, (0, n - len(d.summary_ids)))
                       for d, _ in picks])
    return SimpleNamespace(kv=kv, layers=[0], run=slice(0, 1), picks=picks,
                           lengths=torch.tensor(lengths), ids=ids, scales=torch.tensor([1.0]))


def decode(ids: list[int], start: int | None) -> SimpleNamespace:
    return SimpleNamespace(summary_ids=torch.tensor(ids), summary_start=start)


def test_every_scorer_is_a_block_scorer():
    assert all(issubclass(c, BlockScorer) for c in (QuestBound, Rerank, AttentionMass))


@pytest.mark.parametrize("side_by_side", [True, False])
def test_quest_bound_by_hand(side_by_side):
    """One KV head, one query head, d = 2. Request 0: blocks 0, 1; request 1: block 2.
    Quest's bound sum_d max(q*kmin, q*kmax):
      q0 = [1, -2]: block 0 (kmin [0, -1], kmax [1, 1])   -> 1 + 2 = 3
                    block 1 (kmin [-2, 0], kmax [-1, .5]) -> -1 + 0 = -1
      q1 = [-1, 1]: block 2 (kmin [1, 1], kmax [2, 3])    -> -1 + 3 = 2"""
    kmin = torch.tensor([[0, -1], [-2, 0], [1, 1], [0, 0]], dtype=torch.float32)
    kmax = torch.tensor([[1, 1], [-1, .5], [2, 3], [0, 0]], dtype=torch.float32)
    kv = SimpleNamespace(kmin=kmin[None, :, None], kmax=kmax[None, :, None], scales=[1.0],
                         cfg=SimpleNamespace(summary_splits=1, score_alpha=1.0,
                                             score_aggregation="sum"))
    starts = (0, 2) if side_by_side else (None, None)  # one strided view / one by one
    picks = [(decode([0, 1], starts[0]), torch.tensor([[[1.0, -2.0]]])),
             (decode([2], starts[1]), torch.tensor([[[-1.0, 1.0]]]))]
    j = job(kv, picks, [2, 1])
    assert QuestBound.stride(j, 2, 4) == (2 if side_by_side else 0)
    got = QuestBound().score(j, None)  # [layers, R, Hkv, n]
    assert got.tolist() == [[[[3.0, -1.0]], [[2.0, -INF]]]]


def host_kv() -> torch.Tensor:
    """[L=1, 2, Hkv=1, 4 slots, d=1]: blocks of B = 2 keys, block 0 keys 0, 0, block 1 keys
    ln 2, ln 2 (values unused)."""
    keys = torch.tensor([0.0, 0.0, math.log(2), math.log(2)])
    return torch.stack([keys, torch.zeros(4)])[None, :, None, :, None]


def test_attention_mass_by_hand():
    """q = 1, scale 1: softmax weights 1, 1, 2, 2 over 6 -> block masses 1/3, 2/3."""
    kv = SimpleNamespace(host_view=host_kv(), scales=[1.0], cfg=SimpleNamespace(block_size=2))
    got = AttentionMass().score(job(kv, [(decode([0, 1], 0), torch.ones(1, 1, 1))], [2]),
                                None)
    torch.testing.assert_close(got, torch.tensor([[[[1 / 3, 2 / 3]]]]))


@pytest.mark.parametrize("candidates, want", [(1, [1.0, -INF]), (2, [1 / 3, 2 / 3]),
                                               (None, [1 / 3, 2 / 3])])
def test_rerank_by_hand(candidates, want):
    """The previous stage ranks block 0 first (5 > 1). One candidate: block 0 takes all of
    the mass among the candidates; both, or every block (None: rerank=inf, the first stage,
    no previous scores): the attention masses above."""
    kv = SimpleNamespace(host_view=host_kv(), scales=[1.0], key_codes=None,
                         cfg=SimpleNamespace(block_size=2))
    prior = None if candidates is None else torch.tensor([[[[5.0, 1.0]]]])
    got = Rerank(candidates).score(job(kv, [(decode([0, 1], 0), torch.ones(1, 1, 1))], [2]),
                                   prior)
    torch.testing.assert_close(got, torch.tensor([[[want]]]))
