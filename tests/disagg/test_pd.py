"""Prefill-decode disaggregation: a decode worker continuing hand-overs gives the tokens of a
single engine, reads exactly its transfer's share of the first step's working sets at admission
(partial: the union of their blocks; slab: their per-head slices), keeps its host budget, and,
over Mooncake with the prefill worker in its own process, fails only the requests that need a
dead prefill host's blocks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import needs_mooncake, requests_in
from test_host_cache import GREEDY, SPARSE, Recording, check_host_caches, prompts_of

from oasiskv import LLM, SamplingParams
from oasiskv.disagg.pd import DisaggregatedLLM
from oasiskv.kv.handoff import TRANSFERS
from oasiskv.kv.summaries import dequantize_bounds
from oasiskv.store.remote_store import BlockKey

B = 16


def single_node(tiny_llama, prompts, params=GREEDY, **kwargs):
    llm = LLM(str(tiny_llama), **{**SPARSE, **kwargs})
    outs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    return outs


@pytest.mark.parametrize("prefetch", ["sync", "async"])
@pytest.mark.parametrize("transfer, f_host", [("partial", 1.0), ("partial", 0.25),
                                              ("slab", 1.0), ("slab", 0.25),
                                              ("full", 1.0), ("full", 0.25)])
def test_pd_gives_the_tokens_of_one_engine(tiny_llama, transfer, f_host, prefetch):
    prompts = prompts_of([200, 170, 90, 250])
    want = single_node(tiny_llama, prompts)
    pd = DisaggregatedLLM(str(tiny_llama), transfer=transfer, decode={"f_host": f_host},
                          prefetch=prefetch, **SPARSE)
    got = pd.generate(prompts, GREEDY, use_tqdm=False,
                      on_step=lambda engine: check_host_caches(engine, f_host))
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" for o in got)
    assert requests_in(pd.decode.sparse.remote.store) == set()  # finished requests left it
    pd.close()


BOUNDS = {**SPARSE, "rerank": 0}  # selections by the summaries' bound: they cross


def test_half_summaries_halve_their_share_of_the_hand_over(tiny_llama):
    prompts = prompts_of([230, 180], seed=4)
    want = single_node(tiny_llama, prompts, summary_dtype="float16", rerank=0)
    metadata = {}
    for dtype in ("float32", "float16"):
        pd = DisaggregatedLLM(str(tiny_llama), transfer="slab", summary_dtype=dtype, **BOUNDS)
        got = pd.generate(prompts, GREEDY, use_tqdm=False)
        if dtype == "float16":
            assert [o.token_ids for o in got] == want
        h = next(iter(pd.handoffs.values()))
        metadata[dtype] = h.kmin.numel() * h.kmin.element_size(), h.kmin.dtype
        pd.close()
    assert metadata["float16"] == (metadata["float32"][0] // 2, torch.float16)


def test_int8_summaries_cross_as_outward_bounds_in_about_half_the_bytes(tiny_llama):
    """handoff_summaries=int8: the decode worker's summaries bound the prefill worker's (within
    two codes), the hand-over's summary bytes are (d + 2) / (2 d) of bf16's, and the requests
    run to the end (selections may differ from one engine's: the bounds are looser)."""
    prompts = prompts_of([230, 180], seed=4)
    got, sent = {}, {}
    for fmt in ("exact", "int8"):
        pd = DisaggregatedLLM(str(tiny_llama), transfer="slab", handoff_summaries=fmt,
                              summary_dtype="bfloat16", **BOUNDS)
        got[fmt] = pd.generate(prompts, GREEDY, use_tqdm=False)
        sent[fmt] = {rid.rsplit("-", 1)[1]: h for rid, h in pd.handoffs.items()}  # by index
        pd.close()
    assert all(o.finish_reason == "length" for o in got["int8"])
    assert sent["exact"].keys() == sent["int8"].keys()
    for rid, exact in sent["exact"].items():
        h = sent["int8"][rid]
        assert h.kmin.dtype == torch.int8 and h.summary_scales is not None
        lo, hi = dequantize_bounds(h.kmin, h.kmax, h.summary_scales)
        s = h.summary_scales[..., None]
        assert (lo <= exact.kmin.float()).all() and (hi >= exact.kmax.float()).all()
        assert (exact.kmin.float() - lo <= 2 * s).all() and (hi - exact.kmax.float() <= 2 * s).all()
        d = exact.kmin.shape[-1]
        saved = (exact.metadata_bytes - h.metadata_bytes) / (2 * exact.kmin.numel() * 2)
        assert saved == pytest.approx(1 - (d + 2) / (2 * d))
        assert exact.admission_bytes - h.admission_bytes == exact.metadata_bytes - h.metadata_bytes


def test_split_summaries_travel_with_the_hand_over(tiny_llama):
    """summary_splits=2: the hand-over carries both sub-block summaries of every complete
    block (twice the rows of one summary per block) and the decode worker continues as one
    engine with the same setting would; workers that disagree are refused at construction."""
    prompts = prompts_of([230, 180], seed=4)
    want = single_node(tiny_llama, prompts, summary_splits=2, rerank=0)
    rows = {}
    for splits in (1, 2):
        pd = DisaggregatedLLM(str(tiny_llama), transfer="partial", summary_splits=splits,
                              **BOUNDS)
        got = pd.generate(prompts, GREEDY, use_tqdm=False)
        if splits == 2:
            assert [o.token_ids for o in got] == want
        h = next(iter(pd.handoffs.values()))
        assert h.summary_splits == splits
        rows[splits] = h.kmin.shape[1], h.num_computed_tokens // B
        pd.close()
    assert rows[2] == (2 * rows[1][0], rows[1][1]) and rows[1][0] == rows[1][1]
    with pytest.raises(ValueError, match="summary_splits must be the same on both workers, "
                                         "got prefill 1, decode 2"):
        DisaggregatedLLM(str(tiny_llama), decode={"summary_splits": 2}, **BOUNDS)
    other = LLM(str(tiny_llama), **BOUNDS, remote_store="inprocess", summary_splits=4)
    with pytest.raises(ValueError, match="has summary_splits 2, this engine's is 4"):
        other.engine.add_handoff(h, GREEDY)  # the last hand-over: splits 2
    assert not other.engine.has_unfinished()
    other.close()


@pytest.mark.parametrize("source", ["int8", "int4"])
def test_the_key_copy_travels_with_the_hand_over(tiny_llama, source):
    """The rerank's device key copy (indexed like the summaries) crosses with them: the
    decode worker continues as one engine with the same setting, the hand-over holds every
    complete block's codes; workers that disagree are refused."""
    prompts = prompts_of([230, 180], seed=4)
    kw = {**SPARSE, "rerank": 2, "rerank_source": source}
    want = single_node(tiny_llama, prompts, **kw)
    pd = DisaggregatedLLM(str(tiny_llama), transfer="partial", **kw)
    got = pd.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    h = next(iter(pd.handoffs.values()))
    bits = int(source[3:])
    n_full = h.num_computed_tokens // B
    assert h.key_codes.shape[1:] == (n_full, h.tail.shape[2], h.tail.shape[4], B * bits // 8)
    assert h.key_scales.shape[1:] == (n_full, h.tail.shape[2])
    assert h.metadata_bytes >= h.key_codes.numel() + 4 * h.key_scales.numel()
    pd.close()
    with pytest.raises(ValueError, match=f"key copy must be the same on both workers, got "
                                         f"prefill {source}, decode none"):
        DisaggregatedLLM(str(tiny_llama), decode={"rerank": 0}, **kw)
    other = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess", rerank=0)
    with pytest.raises(ValueError, match=f"has an {source} key copy, this engine reranks "
                                         "from no key copy"):
        other.engine.add_handoff(h, GREEDY)
    other.close()


def test_a_hand_over_that_reranks_every_block_carries_no_summaries(tiny_llama):
    """rerank=inf (the default) reads no summary: the hand-over carries the key copy without
    them, smaller than rerank=2's by exactly their bytes; a decode worker whose selection
    bounds blocks by summaries refuses it, naming the setting."""
    prompts = prompts_of([230, 180], seed=4)
    handoffs = {}
    for rerank in (float("inf"), 2):
        pd = DisaggregatedLLM(str(tiny_llama), transfer="partial", **{**SPARSE, "rerank": rerank})
        pd.generate(prompts, GREEDY, use_tqdm=False)
        handoffs[rerank] = next(iter(pd.handoffs.values()))
        pd.close()
    every, bounds = handoffs[float("inf")], handoffs[2]
    n_full = every.num_computed_tokens // B
    assert every.kmin.shape[1] == every.kmax.shape[1] == 0
    assert bounds.kmin.shape[1] == n_full and every.key_codes.shape[1] == n_full
    summaries = 2 * bounds.kmin.numel() * bounds.kmin.element_size()
    assert bounds.metadata_bytes - every.metadata_bytes == summaries > 0
    other = LLM(str(tiny_llama), **SPARSE, remote_store="inprocess", rerank=2)
    with pytest.raises(ValueError, match="has no block summaries .* set rerank alike"):
        other.engine.add_handoff(every, GREEDY)
    assert not other.engine.has_unfinished()
    other.close()


def record_admissions(pd: DisaggregatedLLM) -> list[tuple]:
    """Per admission of the decode worker: (namespace, keys it read, prompt blocks on its
    host, each working-set (layer, slot, head) of its slab [n, 2, B, d], the same blocks'
    heads as the store holds them)."""
    sparse = pd.decode.sparse
    store = sparse.remote.store = Recording(sparse.remote.store)
    admissions, marks = [], []

    def receive(seq, namespace, blocks, keep, original=sparse.remote.receive):
        marks.append(len(store.gets))
        return original(seq, namespace, blocks, keep)

    def load_slab(seq, pos, slots=None, original=sparse.load_slab):
        original(seq, pos, slots)
        heads = seq.working_set.head_map  # [L, K, Hkv]
        P = seq.num_prompt_tokens // B
        layer, slot, head = ((heads >= 0) & (heads < P)).nonzero(as_tuple=True)
        keys = [BlockKey(seq.host_cache.namespace, int(la), int(heads[la, s, g]))
                for la, s, g in zip(layer, slot, head, strict=True)]
        distinct = sorted(set(keys))
        blocks = store.inner.get_blocks(distinct)  # [n, 2, Hkv, B, d]
        blocks = blocks[torch.tensor([distinct.index(k) for k in keys])]
        admissions.append((seq.host_cache.namespace,
                           [k for keys in store.gets[marks[-1]:] for k in keys],
                           int((seq.host_cache.holder >= 0).sum()),
                           sparse.slab_kv(seq)[layer, slot, :, head],
                           blocks[torch.arange(len(keys)), :, head]))

    sparse.remote.receive, sparse.load_slab = receive, load_slab
    return admissions


def test_each_transfer_reads_exactly_its_share_of_the_first_working_sets(tiny_llama):
    prompts = prompts_of([240, 200, 120], seed=1)
    admitted = {}
    for transfer in TRANSFERS:
        pd = DisaggregatedLLM(str(tiny_llama), transfer=transfer, **SPARSE)
        admissions = record_admissions(pd)
        outs = pd.generate(prompts, GREEDY, use_tqdm=False)
        assert all(o.finish_reason == "length" for o in outs)
        handoffs = {h.namespace: h for h in pd.handoffs.values()}
        assert len(admissions) == len(prompts)
        for namespace, keys, prompt_on_host, installed, stored in admissions:
            h = handoffs[namespace]
            L, K, _ = h.head_map.shape
            P = h.num_prompt_tokens // B
            if transfer == "partial":  # per layer: the prompt blocks its working set holds
                union = {(layer, int(b)) for layer, m in enumerate(h.head_map)
                         for b in m.flatten() if 0 <= b < P}
                assert {(k.layer, k.block) for k in keys} == union and len(keys) == len(union)
                assert prompt_on_host == len(union)
            elif transfer == "slab":  # K slot blocks per layer, no prompt block
                assert sorted(keys) == [BlockKey(h.slab_namespace, layer, s)
                                        for layer in range(L) for s in range(K)]
                assert h.kept_blocks == L * K and prompt_on_host == 0
            else:
                assert {(k.layer, k.block) for k in keys} == {
                    (layer, b) for layer in range(L) for b in range(P)}
                assert prompt_on_host == L * P  # f_host = 1: every prompt block
            # every (layer, slot, head) of the slab holds its block as the store has it
            assert len(installed) > 0 and torch.equal(installed, stored)
        admitted[transfer] = pd.decode.stats()["sparse_handoff_bytes"]
        assert admitted[transfer] == sum(h.admission_bytes for h in handoffs.values())
        assert requests_in(pd.decode.sparse.remote.store.inner) == set()  # all left
        pd.close()
    assert admitted["slab"] < admitted["partial"] < admitted["full"]


def test_refused_and_early_finished_requests_do_not_stop_the_others(tiny_llama):
    prompts = prompts_of([200, 120], seed=2)
    want = single_node(tiny_llama, prompts)
    pd = DisaggregatedLLM(str(tiny_llama), **SPARSE)
    short = SamplingParams(temperature=0, max_tokens=1)  # done on the prefill worker
    outs = pd.generate(prompts + [[999999], prompts[1]], [GREEDY, GREEDY, GREEDY, short],
                       use_tqdm=False)
    assert [o.token_ids for o in outs[:2]] == want
    assert outs[2].finish_reason == "error" and "outside the vocabulary" in outs[2].error
    assert outs[3].finish_reason == "length" and outs[3].token_ids == want[1][:1]
    pd.close()


@needs_mooncake
def test_pd_over_mooncake_in_two_processes(tiny_llama, master):
    """The prefill worker in its own process lends the store its memory; the decode worker
    lends none, so it reads every prompt block from the prefill host. Killing the prefill
    worker mid-decode fails (within the store's deadline) the request that still needs its
    blocks; the one whose working sets hold its whole prompt finishes."""
    long, short = prompts_of([250, 40], seed=3)  # 40 tokens: 2 blocks, inside top_k=2
    want = single_node(tiny_llama, [long, short])
    pd = DisaggregatedLLM(str(tiny_llama), remote_store=f"mooncake://{master.address}",
                          decode={"f_host": 0.25}, **SPARSE)
    try:
        for transfer in ("slab", "partial"):  # the slab crosses the store too
            pd.transfer = transfer
            got = pd.generate([long, short], GREEDY, use_tqdm=False)
            assert [o.token_ids for o in got] == want
        assert pd.decode.stats()["remote_bytes"] > 0
        killed = {}

        def kill_after_a_few_steps(engine):
            # both requests decoding a few steps (a loaded machine may still be prefilling one)
            running = engine.scheduler.running
            if not killed and len(running) == 2 and min(s.num_output_tokens
                                                         for s in running) >= 4:
                os.kill(pd.prefill.pid, signal.SIGKILL)
                killed["at"] = time.perf_counter()

        params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        got = pd.generate([long, short], params, use_tqdm=False,
                          on_step=kill_after_a_few_steps)
        assert killed
        assert got[0].finish_reason == "error" and "remote tier" in got[0].error
        assert got[0].metrics.finish_time - killed["at"] < 30  # bounded retries, no hang
        assert got[1].finish_reason == "length" and got[1].error is None, got[1].error
        assert len(got[1].token_ids) == 60
        again = pd.decode.stats()  # the decode worker is still there, counting
        assert again["requests_failed"] >= 1
    finally:
        pd.close()


def test_pd_command_prints_the_answer_and_the_transfer(tiny_llama, capsys):
    from oasiskv.cli import main

    prompt = " ".join(["Elizabeth walked to the house"] * 12)
    args = ["pd", "--model", str(tiny_llama), "--prompt", prompt, "--max-tokens", "12",
            "--top-k", "2", "--f-host", "0.25", "--device-kv-budget", "16MiB",
            "--host-kv-budget", "16MiB"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    want = LLM(str(tiny_llama), kv_mode="sparse", top_k=2).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].text
    assert out.strip() == want.strip()
    assert "partial transfer" in err and "prompt blocks (all layers)" in err
    assert main(args + ["--transfer", "slab"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == want.strip()
    L, K = 2, 2  # the tiny model's layers, top_k
    assert f"slab transfer: {L * K} slot blocks (the slab) of" in err
    assert main(args[:-4] + ["--prompt", "x" * 5000]) == 1  # too long: a clear error
    assert "model context is" in capsys.readouterr().err
