"""The selection kernel (`kv/select_kernel.py`, `layers/csrc/select_blocks.cpp`) against the
PyTorch ops it replaces on the CPU: top-k equal to `torch.topk` (padding past a request's
blocks, ties to the lower block), the capped-LRU update equal to `select_capped_lru_batch`
over a run of steps (caps per layer and request, seeding, stale slots, a run of layers in the
middle), on 1 and 2 threads; attention's masks of the working sets; bad input refused by
name; an engine's tokens and counters the same with the kernel and with the ops."""

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.kv import select_kernel
from oasiskv.kv.select import select_capped_lru_batch

FIELDS = ("requests", "slots", "heads", "blocks", "admitted", "predicted", "hits", "wanted")


@pytest.fixture
def ext():
    ext = select_kernel.extension()
    assert ext is not None, "the kernel builds and loads on this machine"
    return ext


def scores_of(g, L, R, H, n, lengths):
    """Distinct random scores, -inf past each request's blocks (as the rerank leaves them)."""
    s = torch.randperm(L * R * H * n, generator=g).float().view(L, R, H, n)
    return s.masked_fill(torch.arange(n) >= lengths[:, None, None], float("-inf"))


def reference_top(scores, lengths, K):
    k = min(K, scores.shape[-1])
    top = torch.topk(scores, k, dim=-1, sorted=True).indices
    return top.masked_fill((torch.arange(k) >= lengths.clamp(max=K)[:, None])[:, None], -2)


@pytest.mark.parametrize("n,K", [(40, 16), (16, 16), (10, 16), (448, 128)])
def test_top_blocks_equal_topk(ext, threads, n, K):
    g = torch.Generator().manual_seed(n)
    L, R, H = 3, 4, 3
    lengths = torch.tensor([n, n // 2, 1, max(n - 3, 1)])
    scores = scores_of(g, L, R, H, n, lengths)
    k = min(K, n)
    got = ext.top_blocks(scores.flatten(0, -2).contiguous(), lengths.clamp(max=K), H, k)
    assert torch.equal(got.view(L, R, H, k), reference_top(scores, lengths, K))


def test_top_blocks_rank_equal_scores_lower_block_first(ext):
    scores = torch.tensor([[1.0, float("inf"), 3.0, float("inf"), 3.0, float("-inf")]])
    got = ext.top_blocks(scores, torch.tensor([5]), 1, 5)
    assert got.tolist() == [[1, 3, 2, 4, 0]]
    assert set(got[0].tolist()) == set(torch.topk(scores, 5).indices[0].tolist())


def run_steps(ext, g, L, R, H, n, K, l0, steps, lengths):
    """The same selections through the kernel (working sets in place) and the reference
    (stacked, written back as SelectJob does); every output compared at each step."""
    total = l0 + L + 1  # the working sets hold more layers than the run
    hm = [torch.full((total, K, H), -1, dtype=torch.long) for _ in range(R)]
    hm[0][l0, 0, 0] = n + 5  # a stale slot: a block past num_blocks is never a hit
    lu = [torch.zeros(total, K, H, dtype=torch.long) for _ in range(R)]
    ref_hm, ref_lu = [t.clone() for t in hm], [t.clone() for t in lu]
    run = slice(l0, l0 + L)
    for step in range(1, steps + 1):
        predicted = reference_top(scores_of(g, L, R, H, n, lengths), lengths, K)
        k = predicted.shape[-1]
        caps = torch.randint(1, k + 1, (L, R), generator=g)
        caps[0] = k if step == 1 else caps[0]  # seeding: uncapped
        max_cap = int(caps.max())
        got = ext.select_lru(hm, lu, l0, predicted, caps, step, n, max_cap)
        head_map = torch.stack([t[run] for t in ref_hm], 1).flatten(0, 1)
        last_used = torch.stack([t[run] for t in ref_lu], 1).flatten(0, 1)
        want = select_capped_lru_batch(head_map, last_used, predicted.flatten(0, 1),
                                       caps.flatten(), step, n, max_cap)
        for i in range(R):
            ref_hm[i][run] = head_map.view(L, R, K, H)[:, i]
            ref_lu[i][run] = last_used.view(L, R, K, H)[:, i]
        for name, value in zip(FIELDS, got, strict=True):
            assert torch.equal(value, getattr(want, name)), (step, name)
        assert all(torch.equal(a, b) for a, b in zip(hm, ref_hm, strict=True)), step
        assert all(torch.equal(a, b) for a, b in zip(lu, ref_lu, strict=True)), step
    return int(got[4].sum())  # the last step's admissions


@pytest.mark.parametrize("seed", range(3))
def test_select_lru_equals_the_batched_ops(ext, threads, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([60, 30, 9, 60, 45])
    admitted = run_steps(ext, g, L=4, R=5, H=3, n=60, K=16, l0=2, steps=6, lengths=lengths)
    assert admitted > 0  # the later steps still admit (caps below the misses)


def test_select_lru_at_the_engine_shape(ext):
    g = torch.Generator().manual_seed(7)
    run_steps(ext, g, L=3, R=6, H=3, n=448, K=128, l0=0, steps=4,
              lengths=torch.tensor([448, 448, 300, 100, 448, 12]))


def test_resident_masks_equal_the_expanded_comparison(ext):
    g = torch.Generator().manual_seed(3)
    L, K, H, B, R = 4, 6, 3, 4, 3
    maps = [torch.randint(-1, 9, (L, K, H), generator=g) for _ in range(R)]
    masks = torch.ones(R, H, (K + 1) * B, dtype=torch.bool)  # the active block's part stays
    ext.resident_masks(maps, 2, masks, B)
    want = (torch.stack([m[2] for m in maps]) >= 0).transpose(1, 2).repeat_interleave(B, -1)
    assert torch.equal(masks[..., :K * B], want)
    assert masks[..., K * B:].all()
    with pytest.raises(RuntimeError, match="with layer 4"):
        ext.resident_masks(maps, 4, masks, B)


def test_bad_input_is_refused_by_name(ext):
    hm = [torch.full((2, 4, 1), -1, dtype=torch.long)]
    lu = [torch.zeros(2, 4, 1, dtype=torch.long)]
    predicted = torch.tensor([[[[0, 5]]]])
    caps = torch.tensor([[2]])
    with pytest.raises(RuntimeError, match=r"predicted block past num_blocks \(5\)"):
        ext.select_lru(hm, lu, 0, predicted, caps, 1, 5, 2)
    with pytest.raises(RuntimeError, match="covering layers 1..1"):
        ext.select_lru([hm[0][:1].contiguous()], lu, 1, predicted.clamp(max=3), caps, 1, 5, 2)
    with pytest.raises(RuntimeError, match="contiguous"):
        ext.select_lru([hm[0].transpose(0, 1)], lu, 0, predicted.clamp(max=3), caps, 1, 5, 2)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, 3\]"):
        ext.top_blocks(torch.zeros(2, 3), torch.tensor([3]), 2, 4)
    assert torch.equal(hm[0], torch.full((2, 4, 1), -1))  # nothing written


def test_an_engine_selects_the_same_with_the_kernel_and_the_ops(tiny_llama, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(90 + 13 * i)] for i in range(3)]
    counters = ("sparse_predicted", "sparse_hits", "sparse_wanted", "sparse_admitted",
                "sparse_h2d_bytes")
    served, serves = [], select_kernel.serves
    monkeypatch.setattr(select_kernel, "serves", lambda *t: served.append(serves(*t)) or served[-1])
    runs = []
    for choice in ("kernel", "torch"):
        monkeypatch.setenv(select_kernel.ENV, choice)
        served.clear()
        llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=3, f_hbm=0.34, prefetch="sync",
                  max_num_seqs=4, max_num_batched_tokens=512)
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.stats()
        runs.append((tokens, {c: stats[c] for c in counters},
                     sum(e is not None for e in served)))
    (tokens, stats, calls), (ref_tokens, ref_stats, ref_calls) = runs
    assert calls > 0 and ref_calls == 0
    assert tokens == ref_tokens
    assert stats == ref_stats and stats["sparse_admitted"] > 0
