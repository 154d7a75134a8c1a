"""The prefix cache (`kv/prefix_cache.py`) on its own, over an in-process store: one layer, one
KV head, d = 1, blocks of 2 tokens, so an entry (one prompt block, all layers) is one 16-byte
store block. The LRU's order and evictions are checked against a sequence worked out by hand."""

import hashlib
import struct

import pytest
import torch

from oasiskv.kv.prefix_cache import PrefixCache, model_fingerprint, prefix_hashes
from oasiskv.models.llama import LlamaForCausalLM
from oasiskv.store.remote_store import BlockKey, InProcessStore

SHAPE = (2, 1, 2, 1)  # [K/V, Hkv, B, d] of one block
ENTRY = 2 * 2 * 4  # bytes of one entry (1 layer)


def blocks_of(tokens: list[int], layers: int = 1) -> torch.Tensor:
    """[L, P, 2, Hkv, B, d]: token t's key is t + 1000*layer, its value -key."""
    P = len(tokens) // 2
    k = torch.tensor(tokens[:2 * P], dtype=torch.float32).view(P, 1, 2, 1)  # [P, Hkv, B, d]
    per_layer = [torch.stack([k + 1000 * layer, -(k + 1000 * layer)], 1)
                 for layer in range(layers)]
    return torch.stack(per_layer)


def cache(capacity_entries: int, layers: int = 1, store=None) -> PrefixCache:
    store = store if store is not None else InProcessStore(SHAPE, torch.float32)
    return PrefixCache(store, layers, 2, capacity_entries * layers * ENTRY)


def name(c: PrefixCache, tokens: list[int], b: int) -> str:
    return c.entries(tokens, b + 1)[b]


def test_entries_are_running_digests_of_whole_blocks_keyed_by_the_seed():
    tokens = [5, 6, 7, 8, 9]
    want = [hashlib.sha256(struct.pack("<2q", 5, 6)).hexdigest()[:32],
            hashlib.sha256(struct.pack("<4q", 5, 6, 7, 8)).hexdigest()[:32]]
    assert prefix_hashes(tokens, 2, 2) == want
    seeded = hashlib.sha256(b"model" + struct.pack("<2q", 5, 6)).hexdigest()[:32]
    assert prefix_hashes(tokens, 2, 1, seed=b"model") == [seeded]
    c = cache(4)
    assert c.entries(tokens, 2) == ["pc:" + h for h in want]


def test_lru_order_and_capacity_follow_the_hand_computed_sequence():
    c = cache(3)
    A, Bp, C = [1, 2, 3, 4], [5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]
    a0, a1, b0, b1 = name(c, A, 0), name(c, A, 1), name(c, Bp, 0), name(c, Bp, 1)
    # A: both blocks cached, the deeper one older
    assert c.add(A, blocks_of(A)) == 2
    assert list(c.lru) == [a1, a0]
    # B: room for one more entry: a1, the least recent, makes way
    assert c.add(Bp, blocks_of(Bp)) == 2
    assert list(c.lru) == [a0, b1, b0] and c.evictions == 1
    assert c.store.namespaces() == {a0, b0, b1}
    # a prompt of A's first block and more: a0 is found (a1 is gone) and read, so it is the
    # most recent now
    assert c.find(A[:2] + [3, 4, 9]) == [a0]
    kv = c.read([a0])  # [L, 2, Hkv, 2, d]
    assert kv[0, :, 0, :, 0].tolist() == [[1, 2], [-1, -2]]
    assert list(c.lru) == [b1, b0, a0]
    # A again: a1 is put again, and b1 (now the least recent) makes way
    assert c.add(A, blocks_of(A)) == 1
    assert list(c.lru) == [b0, a1, a0] and c.evictions == 2
    # C has 4 blocks: only its first 3 fit, and everything else makes way
    assert c.add(C, blocks_of(C)) == 3
    assert list(c.lru) == [name(c, C, 2), name(c, C, 1), name(c, C, 0)]
    assert c.evictions == 5 and c.bytes_held == 3 * ENTRY
    assert len(c.store) == 3 and c.store.namespaces() == set(c.lru)
    assert c.find(C + [0]) == c.entries(C, 3)
    kv = c.read(c.find(C + [0]))
    assert kv[0, 0, 0, :, 0].tolist() == C[:6]


def test_a_prompt_keeps_its_last_token_to_compute():
    c = cache(4)
    c.add([1, 2, 3, 4], blocks_of([1, 2, 3, 4]))
    assert len(c.find([1, 2, 3, 4])) == 1  # the last token's block stays to be computed
    assert len(c.find([1, 2, 3, 4, 5])) == 2
    assert c.find([1, 9, 3, 4, 5]) == []


def test_entries_of_another_engine_are_found_read_and_left_to_their_owner():
    store = InProcessStore(SHAPE, torch.float32)
    mine, theirs = cache(4, store=store), cache(0, store=store)  # capacity 0: puts nothing
    P = [1, 2, 3, 4, 5, 6]
    assert theirs.add(P, blocks_of(P)) == 0 and len(store) == 0
    mine.add(P, blocks_of(P))
    found = theirs.find(P + [7])
    assert len(found) == 3 and torch.equal(theirs.read(found), mine.read(found))
    assert not theirs.lru and theirs.evictions == 0
    # an entry already in the store is not put again, nor counted by the second engine
    other = cache(4, store=store)
    assert other.add(P, blocks_of(P)) == 0 and not other.lru


def test_a_read_that_misses_drops_the_broken_entry_and_fails_soft():
    """Another engine evicted an entry, or the store lost one layer's block of it, between
    find and read: the read is None (the prompt is computed), the entry leaves the store."""
    c = cache(4, layers=2)
    P = [1, 2, 3, 4]
    c.add(P, blocks_of(P, layers=2))
    found = c.find(P + [5])
    assert len(found) == 2
    del c.store._blocks[BlockKey(found[1], 1, 0)]  # layer 1 of the second entry is lost
    assert c.read(found) is None
    assert c.store.namespaces() == {found[0]} and list(c.lru) == [found[0]]
    assert c.find(P + [5]) == [found[0]]
    assert c.add(P, blocks_of(P, layers=2)) == 1  # put again whole
    assert c.read(c.find(P + [5]))[1, 0, 0, :, 0].tolist() == [1001, 1002, 1003, 1004]


def test_a_cache_put_that_finds_the_store_full_leaves_nothing():
    store = InProcessStore(SHAPE, torch.float32, capacity_bytes=3 * 4 * 2 * 2)  # 3 blocks
    c = cache(8, layers=2, store=store)
    P = [1, 2, 3, 4]  # 2 entries x 2 layers = 4 blocks: no room
    assert c.add(P, blocks_of(P, layers=2)) == 0
    assert len(store) == 0 and not c.lru and c.bytes_put == 0
    assert c.add(P[:2], blocks_of(P[:2], layers=2)) == 1 and len(store) == 2


def test_evict_frees_at_least_what_is_asked_least_recent_first():
    c = cache(4)
    c.add([1, 2], blocks_of([1, 2]))
    c.add([3, 4], blocks_of([3, 4]))
    c.add([5, 6], blocks_of([5, 6]))
    assert c.evict(ENTRY + 1) == 2 * ENTRY
    assert list(c.lru) == [name(c, [5, 6], 0)] and len(c.store) == 1
    assert c.evict(10 * ENTRY) == ENTRY and c.evict(1) == 0


def test_the_fingerprint_tells_models_apart():
    from oasiskv.config import ModelConfig

    mc = ModelConfig("LlamaForCausalLM", 32, 8, 16, 1, 2, 1, 4, 1e-6, 1e4, None, 64, False,
                     False, False, False)
    torch.manual_seed(0)
    one, two = LlamaForCausalLM(mc), LlamaForCausalLM(mc)
    with torch.no_grad():
        for p in one.parameters():
            p.normal_()
    two.load_state_dict(one.state_dict())
    assert model_fingerprint(one, torch.float32) == model_fingerprint(two, torch.float32)
    assert model_fingerprint(one, torch.float32) != model_fingerprint(one, torch.bfloat16)
    with torch.no_grad():
        two.model.layers[0].self_attn.qkv_proj.weight[-1, -1] += 1
    assert model_fingerprint(one, torch.float32) != model_fingerprint(two, torch.float32)


@pytest.mark.parametrize("capacity", [0, ENTRY - 1])
def test_a_capacity_under_one_entry_caches_nothing(capacity):
    c = PrefixCache(InProcessStore(SHAPE, torch.float32), 1, 2, capacity)
    assert c.add([1, 2, 3, 4], blocks_of([1, 2, 3, 4])) == 0 and len(c.store) == 0
