"""device_kv_budget is what the device's KV tensors take: the block pool plus, sparse, the
kmin/kmax summaries, summed from the tensors themselves (not from the engine's accounting),
at most the budget and less than one KV block under it; every pool block a request holds is
one it reads (a sparse request: its K+2-block slab, nothing reserved "for summaries"); and
the engine admits as many requests at once as those tensors and the host tier hold, counted
by hand.

The tiny model (tests/conftest.py): 2 layers, 2 KV heads, head_dim 16, float32, block 16,
context 512. A KV block: 2 (K, V) x 2 x 2 x 16 x 16 tokens x 4 B = 8192 B. A block summary
(kmin and kmax, bfloat16 for float32 K/V): 2 x 2 x 2 x 16 x 2 B = 256 B. top_k 2: a slab of 4
blocks. A request of the whole context: 32 blocks, so its summaries take 32 x 256 = 8192 B.
The sparse cases counted by hand run the Quest bound alone (rerank=0); the default rerank's
int8 key copy (2 x 2 x (16 x 16 + 4) = 1,040 B a block, beside each summary) is in the
`sparse-key-copy` case here and charged by hand in tests/kv/test_scoring.py.
"""

import pytest
import torch

from oasiskv.config import EngineConfig
from oasiskv.engine.engine import LLMEngine
from oasiskv.kv.blocks import BlockPool, KVAllocator
from oasiskv.kv.device_budget import split_sparse
from oasiskv.sampling_params import SamplingParams
from oasiskv.sequence import Sequence

BLOCK, SUMMARY, KiB = 8192, 256, 1024


def engine_for(tiny_llama, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama), max_num_seqs=16,
                                              max_num_batched_tokens=1024, **kw))


def device_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    """The tensors attention and selection read: the pool the runner writes K/V into and,
    sparse, the summaries selection scores."""
    found = [engine.runner.device_kv]
    if engine.sparse is not None:
        found += [engine.sparse.kmin, engine.sparse.kmax]
        if engine.sparse.key_codes is not None:  # the rerank's key copy, as the summaries
            found += [engine.sparse.key_codes, engine.sparse.key_scales]
    for attn in engine.model.attention_layers():  # layers read views of that pool, no copy
        for t in attn.pools["device"]:
            assert t.untyped_storage().data_ptr() == found[0].untyped_storage().data_ptr()
    return found


CASES = {
    "dense": dict(kv_mode="dense", device_kv_budget=100 * KiB),
    "sparse": dict(kv_mode="sparse", top_k=2, device_kv_budget=256 * KiB,
                   host_kv_budget=1024 * KiB, rerank=0),
    # the default 8 GiB host tier: capped to the summaries the device holds
    "sparse-big-host": dict(kv_mode="sparse", top_k=2, device_kv_budget=256 * KiB, rerank=0),
    "sparse-remote": dict(kv_mode="sparse", top_k=2, device_kv_budget=256 * KiB,
                          host_kv_budget=1024 * KiB, remote_store="inprocess", f_host=0.5,
                          rerank=0),
    "sparse-fp32-summaries": dict(kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
                                  host_kv_budget=1024 * KiB, summary_dtype="float32",
                                  rerank=0),
    # rerank=inf (the default): the key copy only, no kmin/kmax (no selection reads them)
    "sparse-key-copy": dict(kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
                            host_kv_budget=1024 * KiB),
    "sparse-key-copy-bounds": dict(kv_mode="sparse", top_k=2, device_kv_budget=300 * KiB,
                                   host_kv_budget=1024 * KiB, rerank=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_device_tensors_add_up_to_the_budget(tiny_llama, case):
    kw = CASES[case]
    engine = engine_for(tiny_llama, **kw)
    budget = kw["device_kv_budget"]
    total = sum(t.numel() * t.element_size() for t in device_tensors(engine))
    assert budget - BLOCK < total <= budget
    stats = engine.stats()
    assert stats["device_bytes_allocated"] == total
    assert stats["device_kv_budget"] == budget and stats["device_bytes_used"] == 0
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(list(range(10 + i, 50 + i)), params)
    engine.step()
    running = engine.scheduler.running
    assert len(running) == 3
    # every pool block in use is a running request's, and (sparse) its slab is all it holds
    assert engine.pool.num_used == sum(len(s.block_table) for s in running)
    ids = engine.device_split.summary_ids
    if engine.sparse is not None:  # kmin/kmax: a row per summary id, or none at all
        bounds = kw.get("rerank", float("inf")) != float("inf")
        assert engine.sparse.kmin.shape[1] == (ids if bounds else 0)
        if engine.sparse.key_codes is not None:
            assert engine.sparse.key_codes.shape[1] == ids
    for s in running:
        if engine.sparse is not None:
            assert len(s.block_table) == 2 + 2  # top_k + 2
            assert len(s.summary_ids) == 3 and max(s.summary_ids) < ids
    used = engine.stats()["device_bytes_used"]
    per_summary = 0 if engine.sparse is None else engine.stats()["summary_bytes_per_block"]
    assert used == engine.pool.num_used * BLOCK + 3 * 3 * per_summary
    while engine.has_unfinished():
        engine.step()
    engine.close()


def first_step_running(engine: LLMEngine, requests: int) -> int:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(requests):
        engine.add_request(list(range(10 + i, 50 + i)), params)  # 40 + 8 tokens: 3 blocks
    engine.step()
    n = len(engine.scheduler.running)
    engine.close()
    return n


def test_dense_admits_what_its_blocks_hold(tiny_llama):
    # 100 KiB: 12 blocks; each prompt takes 3 (40 tokens): 4 at once
    engine = engine_for(tiny_llama, **CASES["dense"])
    assert first_step_running(engine, 6) == 4


def test_sparse_admits_what_its_slabs_hold(tiny_llama):
    # 256 KiB split as a whole-context request: slab 4 x 8192 + summaries 32 x 256 = 40960 B.
    # KV blocks 262144 * 4 // 40960 = 25, room for (262144 - 25 x 8192) / 256 = 224
    # summaries, more than the host tier's 1 MiB / 8192 = 128 blocks use: 128 summaries
    # (32768 B) and (262144 - 32768) / 8192 = 28 KV blocks, 7 slabs. The host holds 42
    # histories of 3 blocks: 7 requests at once. (Before: 32 blocks, of which each request
    # took 4 for its slab and 1 "for its summaries", 6 at once, and the summaries of all 128
    # host blocks on top.)
    engine = engine_for(tiny_llama, **CASES["sparse"])
    assert engine.sparse.kmin.shape[1] == 128 and engine.pool.num_blocks == 28
    assert first_step_running(engine, 10) == 7


def test_sparse_admits_what_its_host_tier_holds(tiny_llama):
    # host 64 KiB: 8 blocks, so 8 summaries (2048 B) and (262144 - 2048) // 8192 = 31 KV
    # blocks (7 slabs); the host holds 2 histories of 3 blocks
    engine = engine_for(tiny_llama, **CASES["sparse"] | {"host_kv_budget": 64 * KiB})
    assert engine.sparse.kmin.shape[1] == 8 and engine.pool.num_blocks == 31
    assert first_step_running(engine, 5) == 2


def test_big_host_tier_is_capped_to_the_summaries_the_device_holds(tiny_llama):
    # 256 KiB as above: 25 KV blocks and 224 summaries; the 8 GiB host tier would need
    # 1048576 of them: it gets 224 blocks, a summary each
    engine = engine_for(tiny_llama, **CASES["sparse-big-host"])
    assert engine.sparse.kmin.shape[1] == engine.host_pool.num_blocks == 224
    assert engine.pool.num_blocks == 25
    assert first_step_running(engine, 8) == 6  # 25 // 4 slabs


def test_a_slab_that_does_not_fit_is_refused_at_the_boundary(tiny_llama):
    # 36 KiB: 36864 * 4 // 40960 = 3 KV blocks, less than one slab of 4
    engine = engine_for(tiny_llama, kv_mode="sparse", top_k=2, device_kv_budget=36 * KiB,
                        host_kv_budget=1024 * KiB)
    with pytest.raises(ValueError, match="needs 4 device KV blocks for its slab"):
        engine.add_request(list(range(10, 50)), SamplingParams(max_tokens=8))
    engine.close()


def test_budget_without_room_for_a_block_and_a_summary_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="no room for one KV block"):
        engine_for(tiny_llama, kv_mode="sparse", top_k=2, device_kv_budget=BLOCK + SUMMARY - 1,
                   rerank=0)


def request(rid: str, tokens: int) -> Sequence:
    return Sequence(rid, list(range(tokens)), tokens, SamplingParams(max_tokens=1),
                    max_context=tokens)


def test_allocator_refuses_a_request_whose_summaries_do_not_fit():
    # plenty of slabs and host blocks, 7 summary ids: requests of 3 blocks, 2 at once
    kv = KVAllocator(BlockPool(100, 16), BlockPool(100, 16), slab_blocks=4,
                     summaries=BlockPool(7, 16), summary_room=7)
    seqs = [request(str(i), 48) for i in range(3)]
    for s in seqs[:2]:
        assert kv.can_grow(s, 48)
        kv.grow(s, 48)
    assert not kv.can_grow(seqs[2], 48)
    kv.free(seqs[0])
    assert kv.can_grow(seqs[2], 48)
    assert "needs the summaries of 8 blocks on the device" in kv.fits_alone(128)
    assert kv.fits_alone(112) is None


def test_summaries_that_hold_no_device_bytes_leave_the_budget_to_the_slabs():
    """The oracle's and rerank=inf-from-host-keys' summary ids cost the device nothing: every
    whole block of the budget is a KV block, and the ids are what the host tier can use; with
    bytes per summary, slabs and summaries share the budget (by hand: 10 slab blocks of 100 B
    and 50 summaries of 4 B per request, 1,200 B a request: 10 requests in 12,000 B)."""
    split = split_sparse(10_050, 100, 0, slab_blocks=10, request_blocks=50, summary_cap=77)
    assert (split.kv_blocks, split.summary_ids, split.allocated) == (100, 77, 10_000)
    split = split_sparse(12_000, 100, 4, slab_blocks=10, request_blocks=50, summary_cap=10**6)
    assert (split.kv_blocks, split.summary_ids) == (100, 500)
