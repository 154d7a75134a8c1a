"""The remote tier (`kv/remote_tier.py`) on its own, over an in-process store: one layer, one
KV head, d = 1, blocks of 2 tokens; host key at token slot t is t, value 1000 + t. A request
with a 6-token prompt (P = 3 blocks) and one generated block; f_host = 0.34: its host cache
keeps ceil(0.34 * 3) = 2 prompt blocks."""

import hashlib
from types import SimpleNamespace

import pytest
import torch

from oasiskv.kv.remote_tier import RemoteTier, namespace_for, open_store
from oasiskv.store.remote_store import BlockKey, InProcessStore, RemoteStoreError, StoreFull

SHAPE = (2, 1, 2, 1)  # [K/V, Hkv, B, d] of one block
BLOCK_BYTES = 2 * 2 * 4


def host_kv() -> torch.Tensor:
    t = torch.arange(16.0)
    return torch.stack([t, 1000 + t])[None, :, None, :, None]  # [L, 2, Hkv, 16, d]


def tier_and_seq(prefix_cache_bytes: int = 0, store: InProcessStore | None = None):
    store = store if store is not None else InProcessStore(SHAPE, torch.float32)
    tier = RemoteTier(store, host_kv(), block_size=2,
                      f_host=0.34, working_set=1, tag="e1",
                      prefix_cache_bytes=prefix_cache_bytes)
    return tier, request("r1", list(range(10, 17)))


def request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=6, host_table=[0, 1, 2, 3],
                           token_ids=tokens)


def test_namespaces():
    assert namespace_for("e1", "req-7") == "e1-req-7"
    digest = hashlib.sha1(b"req 7").hexdigest()[:20]  # a space may not be in a store key
    assert namespace_for("e1", "req 7") == f"e1-h{digest}"


def test_open_store():
    assert open_store("none", SHAPE, torch.float32) is None
    assert open_store("inprocess", SHAPE, torch.float32) is not open_store(
        "inprocess", SHAPE, torch.float32)
    shared = open_store("inprocess://t1", SHAPE, torch.float32)
    assert open_store("inprocess://t1", SHAPE, torch.float32) is shared
    with pytest.raises(ValueError, match="holds blocks"):
        open_store("inprocess://t1", (2, 1, 4, 1), torch.float32)


def test_put_prompt_stores_the_prompt_and_keeps_the_latest_blocks():
    tier, seq = tier_and_seq()
    cache = tier.put_prompt(seq)
    assert len(tier.store) == 3 and tier.store.bytes_put == 3 * BLOCK_BYTES
    block0 = tier.store.get_blocks([BlockKey("e1-r1", 0, 0)])[0]  # [2, Hkv, B, d]
    assert block0[:, 0, :, 0].tolist() == [[0, 1], [1000, 1001]]
    assert cache.where.tolist() == [[-1, 1, 2, 3]]  # blocks 1, 2 kept; 3 generated


def test_a_fetch_evicts_the_least_recent_unprotected_block():
    """Block 0 is missing; block 2 is in a working set: block 1 (older of the two held) makes
    room, and block 0 arrives from the store in its host block (1)."""
    tier, seq = tier_and_seq()
    cache = tier.put_prompt(seq)
    tier.host_kv[:, :, :, :6] = 0  # what arrives is the store's copy
    got = tier.fetch([(cache, torch.tensor([0]), torch.tensor([0]), torch.tensor([[2]]))])
    assert (got.blocks, got.bytes, got.evictions) == (1, BLOCK_BYTES, 1)
    assert cache.where.tolist() == [[1, -1, 2, 3]]
    assert tier.host_kv[0, :, 0, 2:4, 0].tolist() == [[0, 1], [1000, 1001]]
    assert tier.fetch([(cache, torch.tensor([0]), torch.tensor([0]), torch.tensor([[2]]))]
                      ).blocks == 0  # resident now: nothing to read


def test_a_failed_fetch_names_the_layer_and_leaves_the_block_off_the_host(monkeypatch):
    tier, seq = tier_and_seq()
    cache = tier.put_prompt(seq)

    def fail(keys):
        raise RemoteStoreError("lost", keys)

    monkeypatch.setattr(tier.store, "get_blocks", fail)
    got = tier.fetch([(cache, torch.tensor([0]), torch.tensor([0]), torch.tensor([[2]]))])
    assert got.blocks == 0
    assert cache.error.startswith("remote tier: fetching blocks of layer 0 failed")
    assert int(cache.where[0, 0]) == -1


def test_a_stored_prompt_prefix_is_reused_after_its_request_left():
    tier, seq = tier_and_seq(prefix_cache_bytes=3 * BLOCK_BYTES)
    tier.put_prompt(seq)
    tier.remove("e1-r1")  # the request ends; its prefix-cache entries stay
    assert len(tier.store) == 3 and tier.store.bytes_put == 6 * BLOCK_BYTES
    prompt = seq.token_ids[:4] + [99, 98, 97]  # the first 2 blocks shared
    kv = tier.reusable_prefix(prompt)  # [L, 2, Hkv, 4, d]
    assert kv[0, :, 0, :, 0].tolist() == [[0, 1, 2, 3], [1000, 1001, 1002, 1003]]
    assert tier.reusable_prefix([10, 99, 98]) is None  # no first block in common


def test_without_a_prefix_cache_nothing_outlives_its_request():
    tier, seq = tier_and_seq()
    tier.put_prompt(seq)
    tier.remove("e1-r1")
    assert len(tier.store) == 0 and tier.reusable_prefix(seq.token_ids) is None


def test_a_full_store_evicts_prefix_entries_first_then_refuses_leaving_nothing():
    """Room for 6 blocks; a request's prompt is 3 blocks, its cached copy 3 more."""
    store = InProcessStore(SHAPE, torch.float32, capacity_bytes=6 * BLOCK_BYTES)
    tier, r1 = tier_and_seq(prefix_cache_bytes=3 * BLOCK_BYTES, store=store)
    tier.put_prompt(r1)
    tier.remove("e1-r1")
    r1_entries = set(tier.prefix.lru)
    assert store.namespaces() == r1_entries  # 3 blocks free
    tier.put_prompt(request("r2", list(range(20, 27))))  # its entries replace r1's
    assert store.namespaces() == {"e1-r2"} | set(tier.prefix.lru)
    assert not r1_entries & set(tier.prefix.lru) and tier.prefix.evictions == 3
    # the store is full: r2's entries make way for r3's prompt (and r3's own are not cached)
    tier.put_prompt(request("r3", list(range(30, 37))))
    assert store.namespaces() == {"e1-r2", "e1-r3"} and not tier.prefix.lru
    assert tier.prefix.evictions == 6
    # nothing left to evict: r4 is refused, and none of its blocks stays behind
    with pytest.raises(StoreFull, match=f"capacity {6 * BLOCK_BYTES} bytes"):
        tier.put_prompt(request("r4", list(range(40, 47))))
    assert store.namespaces() == {"e1-r2", "e1-r3"}


class HalfFull(InProcessStore):
    """A store whose put lands its first block, then finds no room (as a Mooncake batch put
    can: each key's allocation succeeds or fails on its own)."""

    def _put(self, keys, blocks):
        super()._put(keys[:1], blocks[:1])
        if len(keys) > 1:
            raise StoreFull("remote store is full: injected", keys[1:], [-200] * (len(keys) - 1))


def test_a_put_that_finds_no_room_midway_leaves_nothing_of_the_prompt():
    tier, seq = tier_and_seq(store=HalfFull(SHAPE, torch.float32))
    with pytest.raises(StoreFull):
        tier.put_prompt(seq)
    assert len(tier.store) == 0
