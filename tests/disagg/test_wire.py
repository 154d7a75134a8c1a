"""A hand-over published to the store and fetched back (the control message JSON-encoded on the
way) continues on a decode engine exactly as the in-memory one: the single engine's tokens, and
nothing of the request (prompt blocks, slab, blob) left in the store afterwards."""

from __future__ import annotations

import json
import uuid

import pytest
import torch
from conftest import requests_in
from test_host_cache import GREEDY, SPARSE, prompts_of

from oasiskv import LLM, SamplingParams
from oasiskv.config import EngineConfig
from oasiskv.disagg import wire
from oasiskv.disagg.pd import LocalPrefill, PrefillRequest
from oasiskv.engine.engine import LLMEngine


def _engines(tiny_llama):
    store = f"inprocess://wire-{uuid.uuid4().hex[:6]}"
    config = EngineConfig.from_kwargs(model=str(tiny_llama), remote_store=store, **SPARSE)
    return LocalPrefill(config), LLMEngine(config)


@pytest.mark.parametrize("transfer", ["partial", "slab", "full"])
def test_published_hand_over_continues_like_the_single_engine(tiny_llama, transfer):
    prompts = prompts_of([200, 90])
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    ref = LLM(str(tiny_llama), **SPARSE)
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    ref.close()
    prefill, decode = _engines(tiny_llama)
    store = decode.sparse.remote.store
    for i, p in enumerate(prompts):
        assert prefill.submit(PrefillRequest(f"r{i}", p, params, transfer)) is None
    done = {}
    while len(done) < len(prompts):
        for out in prefill.poll():
            assert out.finish_reason == "handoff"
            desc = json.loads(json.dumps(wire.publish(store, out.handoff)))  # over the wire
            assert set(desc["meta"]) == {"namespace", "blocks", "bytes", "tensors"}
            h = wire.fetch(store, desc)
            assert not any(store.contains(_meta_keys(desc)))  # read once
            for name in ("kmin", "kmax", "tail", "head_map", "ages", "key_codes",
                         "key_scales"):  # the key copy: the default rerank's (int8)
                assert torch.equal(getattr(h, name), getattr(out.handoff, name)), name
            assert h.token_ids == out.handoff.token_ids
            assert [k.tolist() for k in h.kept] == [k.tolist() for k in out.handoff.kept]
            decode.add_handoff(h, params)
        for out in decode.step() if decode.has_unfinished() else []:
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done["r0"], done["r1"]] == want  # seeded sampling went on where it stopped
    assert requests_in(store) == set()
    prefill.close()
    decode.close()


def _meta_keys(desc):
    from oasiskv.store.remote_store import BlockKey

    return [BlockKey(desc["meta"]["namespace"], 0, i) for i in range(desc["meta"]["blocks"])]


def test_int8_summaries_cross_with_their_scales(tiny_llama):
    """handoff_summaries=int8: the codes and their scales come back from the store bit for bit."""
    store_name = f"inprocess://wire-{uuid.uuid4().hex[:6]}"
    config = EngineConfig.from_kwargs(model=str(tiny_llama), remote_store=store_name,
                                      **{**SPARSE, "rerank": 0, "handoff_summaries": "int8"})
    prefill = LocalPrefill(config)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert prefill.submit(PrefillRequest("r0", prompts_of([200])[0], params, "slab")) is None
    outs = []
    while not outs:
        outs = prefill.poll()
    sent, store = outs[0].handoff, prefill.engine.sparse.remote.store
    h = wire.fetch(store, json.loads(json.dumps(wire.publish(store, sent))))
    assert sent.kmin.dtype == torch.int8 and sent.summary_scales.dtype == torch.float32
    for name in ("kmin", "kmax", "summary_scales"):
        assert torch.equal(getattr(h, name), getattr(sent, name)), name
    store.remove(sent.namespace)
    store.remove(sent.slab_namespace)
    prefill.close()


def test_outputs_and_metrics_cross_as_ages(tiny_llama):
    llm = LLM(str(tiny_llama), **SPARSE)
    out = llm.generate(prompts_of([40]), GREEDY, use_tqdm=False)[0]
    llm.close()
    back = wire.output_from_json(json.loads(json.dumps(wire.output_to_json(out))))
    assert (back.token_ids, back.text, back.finish_reason) == (out.token_ids, out.text, "length")
    assert back.metrics.ttft == pytest.approx(out.metrics.ttft, abs=1e-3)


def test_malformed_descriptor_is_a_value_error(tiny_llama):
    prefill, decode = _engines(tiny_llama)
    with pytest.raises(ValueError, match="malformed hand-over descriptor"):
        wire.fetch(decode.sparse.remote.store, {"transfer": "partial"})
    prefill.close()
    decode.close()
