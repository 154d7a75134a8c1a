"""Equal requests sit side by side (device slabs, host histories), so a batch's working sets
and summaries are read as one strided view: tokens, selections and traffic equal those of the
same requests placed apart, each read on its own."""

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.config import CacheConfig
from oasiskv.kv import select_jobs
from oasiskv.kv.blocks import BlockPool
from oasiskv.kv.scorers import QuestBound
from oasiskv.kv.summaries import round_outward

PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
COUNTERS = ("sparse_predicted", "sparse_hits", "sparse_wanted", "sparse_admitted",
            "sparse_h2d_bytes")


def run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]], dict]:
    """(tokens, the running requests' block tables after the first step, stats)."""
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, PARAMS)
    engine.step()
    tables = [list(s.block_table) for s in engine.scheduler.running]
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [outs[k] for k in sorted(outs, key=int)], tables, llm.stats()


@pytest.mark.parametrize("predictor", ["lookahead", "exact"])
def test_side_by_side_batch_equals_requests_placed_apart(tiny_llama, monkeypatch, predictor):
    top_k = 3
    # rerank=2: the Quest bound shortlists (rerank=inf, the default, scores no summaries)
    kw = dict(kv_mode="sparse", top_k=top_k, f_hbm=0.34, prefetch="sync", predictor=predictor,
              max_num_seqs=4, max_num_batched_tokens=512, rerank=2)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(100)] for i in range(4)]
    strides = []
    stride_of = QuestBound.stride

    def spy(job, n, num_ids):
        strides.append(stride_of(job, n, num_ids))
        return strides[-1]

    monkeypatch.setattr(QuestBound, "stride", staticmethod(spy))
    tokens, tables, stats = run(LLM(str(tiny_llama), **kw), prompts)
    slabs = sorted(t[0] for t in tables)
    slab = CacheConfig(top_k=top_k).slab_blocks
    assert slabs == [slabs[0] + i * slab for i in range(4)]  # side by side
    assert strides and all(s > 0 for s in strides)  # summaries scored as one view

    # the placement before side-by-side runs: slabs and histories apart
    monkeypatch.setattr(BlockPool, "take_run",
                        lambda self, table, n: self.grow(table, (len(table) + n) * self.block_size))
    strides.clear()
    ref_tokens, ref_tables, ref_stats = run(LLM(str(tiny_llama), **kw), prompts)
    ref_slabs = sorted(t[0] for t in ref_tables)
    assert ref_slabs != [ref_slabs[0] + i * slab for i in range(4)]
    assert strides and not any(strides)
    assert tokens == ref_tokens
    for key in COUNTERS:
        assert stats[key] == ref_stats[key], key


def checked_selections(llm: LLM, monkeypatch, verify) -> list[list]:
    """Decodes two requests with a critical-path predictor; after each layer's selection,
    verify(held [K, Hkv], q [H, d], keys [Hkv, n*B, d], scale) compares every KV head's working
    set with a hand-computed one. Returns [per-head results..., n] per (step, layer, request)."""
    B = llm.engine.config.cache.block_size
    sparse = llm.engine.sparse
    prepare = type(sparse).prepare_layer
    checked = []

    def check(self, layer, q):
        prepare(self, layer, q)  # selects for this step, on the critical path
        for d in self._decodes:
            n = d.pos // B  # complete blocks
            slots = torch.tensor([b * B + i for b in d.seq.host_table[:n] for i in range(B)])
            keys = self.host_kv[layer, 0][:, slots]  # [Hkv, n*B, d]
            # recorded, not asserted here: the engine turns an exception into a failed request
            checked.append(verify(d.seq.working_set.head_map[layer], q[d.attn.q_start], keys,
                                  self.scales[layer]) + [n])

    monkeypatch.setattr(type(sparse), "prepare_layer", check)
    prompts = [[(5 * i + 11 * j) % 250 + 3 for j in range(190 + 7 * i)] for i in range(2)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    return checked


def held_blocks(held: torch.Tensor, g: int) -> list[int]:
    return sorted(b for b in held[:, g].tolist() if b >= 0)


def test_oracle_working_sets_are_the_true_top_k_by_attention_mass(tiny_llama, monkeypatch):
    top_k, B = 3, 16
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=top_k, f_hbm=1.0, prefetch="sync",
              predictor="oracle", max_num_seqs=2)

    def verify(held, q, keys, scale):
        hkv, t, _ = keys.shape
        qg = q.view(hkv, -1, keys.shape[-1])  # [Hkv, G, d]
        probs = torch.softmax(qg @ keys.transpose(1, 2) * scale, dim=-1)
        mass = probs.view(hkv, qg.shape[1], t // B, B).sum((1, 3))  # [Hkv, n]
        want = mass.topk(min(top_k, t // B), dim=-1).indices
        return [held_blocks(held, g) == sorted(want[g].tolist()) for g in range(hkv)]

    checked = checked_selections(llm, monkeypatch, verify)
    assert all(all(c[:-1]) for c in checked)
    assert max(c[-1] for c in checked) > top_k  # selection had a choice to make


def quest_order(q: torch.Tensor, keys: torch.Tensor, B: int,
                summary_dtype: torch.dtype) -> torch.Tensor:
    """Hand-computed Quest ranking: per KV head, blocks by the sum over the group's query
    heads of sum_d max(q*kmin, q*kmax) (the summaries rounded outward to the engine's
    dtype), best first. [Hkv, n]."""
    hkv, t, d = keys.shape
    blocks = keys.view(hkv, t // B, B, d)
    kmin, kmax = (s.float() for s in round_outward(blocks.amin(2), blocks.amax(2),
                                                   summary_dtype))  # [Hkv, n, d]
    qg = q.view(hkv, -1, 1, d)  # [Hkv, G, 1, d]
    score = torch.maximum(qg * kmin[:, None], qg * kmax[:, None]).sum((1, 3))  # [Hkv, n]
    return score.argsort(dim=-1, descending=True)


@pytest.mark.parametrize("rerank, sink", [(2, 0), (1.5, 1)])
def test_rerank_keeps_the_candidates_with_the_most_attention_mass(tiny_llama, monkeypatch,
                                                                  rerank, sink):
    """exact + rerank: each head's working set is the top-K by the step's attention mass
    among Quest's best rerank*K blocks (a pinned sink block always stays)."""
    top_k, B = 3, 16
    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=top_k, f_hbm=1.0, prefetch="sync",
              predictor="exact", rerank=rerank, sink_blocks=sink, max_num_seqs=2)
    c = int(rerank * top_k + 0.999)

    def verify(held, q, keys, scale):
        hkv, t, d = keys.shape
        n = t // B
        order = quest_order(q, keys, B, llm.engine.sparse.kmin.dtype).tolist()
        pins = list(range(min(sink, n)))
        ok = []
        for g in range(hkv):  # pinned blocks take candidate places first
            cand = pins + [b for b in order[g] if b not in pins][:c - len(pins)]
            tok = torch.tensor([b * B + i for b in cand for i in range(B)])
            qg = q.view(hkv, -1, d)[g]  # [G, d]
            probs = torch.softmax(qg @ keys[g, tok].T * scale, dim=-1)
            mass = probs.view(len(qg), len(cand), B).sum((0, 2))
            ranked = [cand[i] for i in mass.argsort(descending=True).tolist()]
            want = pins + [b for b in ranked if b not in pins][:min(top_k, n) - len(pins)]
            ok.append(held_blocks(held, g) == sorted(want))
        return ok

    checked = checked_selections(llm, monkeypatch, verify)
    assert all(all(ch[:-1]) for ch in checked)
    assert max(ch[-1] for ch in checked) > c  # more blocks than candidates: a real filter


def test_rerank_over_every_block_selects_like_the_oracle(tiny_llama):
    """With rerank*K at least the number of blocks, every block is a candidate: exact +
    rerank ranks by the same attention mass as the oracle predictor, so tokens are equal."""
    prompts = [[(3 * i + 7 * j) % 250 + 3 for j in range(150 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(kv_mode="sparse", top_k=2, f_hbm=1.0, prefetch="sync", max_num_seqs=3,
              rerank_source="host")
    oracle = LLM(str(tiny_llama), predictor="oracle", **kw).generate(prompts, params,
                                                                     use_tqdm=False)
    rerank = LLM(str(tiny_llama), predictor="exact", rerank=8, **kw).generate(prompts, params,
                                                                             use_tqdm=False)
    exact = LLM(str(tiny_llama), predictor="exact", rerank=0, **kw).generate(
        prompts, params, use_tqdm=False)
    assert [o.token_ids for o in rerank] == [o.token_ids for o in oracle]
    assert [o.token_ids for o in exact] != [o.token_ids for o in oracle]  # the test can fail


@pytest.mark.parametrize("kwargs, match", [
    (dict(rerank=0.5), "rerank must be 0"), (dict(rerank=-1), "rerank must be 0"),
])
def test_bad_rerank_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(kv_mode="sparse", **kwargs)


@pytest.mark.parametrize("rerank", [2, float("inf")])
@pytest.mark.parametrize("prefetch", ["sync", "async"])
def test_the_engine_compiles_the_scoring_before_its_first_step(tiny_llama, prefetch, rerank):
    """Every shape a selection scores with (a first step's one layer, a step end's run of
    layers, a batch as one view, a request alone) is compiled when the engine is built: no
    request's step waits for torch.compile. rerank=2 scores with the summaries' bound first;
    rerank=inf (the default) never does, and its engine compiles none of it."""
    from torch._dynamo.utils import counters

    llm = LLM(str(tiny_llama), kv_mode="sparse", top_k=2, max_num_seqs=3, prefetch=prefetch,
              rerank=rerank)
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist()
               for n in (70, 70, 70, 53, 90, 40, 75)]
    run(llm, prompts[:3])  # side by side: one strided view
    run(llm, prompts[3:4])  # alone
    run(llm, prompts[4:])  # unequal: each request's summaries on their own
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_compacted_copy_fills_the_slabs_as_the_fixed_size_copy(tiny_llama, monkeypatch):
    """The local stage on the CPU copies only the admitted block-heads; on CUDA every
    candidate, the others writing their slot's own rows back. Same tokens, same slabs, same
    traffic (K = 3 with a cap of 1: misses held back, so candidates are left out)."""
    kw = dict(kv_mode="sparse", top_k=3, f_hbm=0.34, prefetch="sync", max_num_seqs=4)
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(90 + 20 * i)] for i in range(4)]
    results = []
    for compact in (True, False):
        monkeypatch.setattr(select_jobs, "compacts", lambda device, c=compact: c)
        llm = LLM(str(tiny_llama), **kw)
        tokens, _, stats = run(llm, prompts)
        results.append((tokens, llm.engine.sparse.device_kv.clone(),
                        {k: stats[k] for k in COUNTERS}))
    (tokens, slabs, counts), (ref_tokens, ref_slabs, ref_counts) = results
    assert counts["sparse_wanted"] > counts["sparse_admitted"] > 0  # some were left out
    assert tokens == ref_tokens and counts == ref_counts
    assert torch.equal(slabs, ref_slabs)
