"""Prompt storage (`kv/prompt_store.py`) on the hand-checkable SparseKV of `sparse_units`
(host key of head h at token slot t: 100*h + t; blocks of 2 tokens): the summaries of the
blocks a prefill chunk completes, the key copy beside them, the prompt put to a store."""

from types import SimpleNamespace

import pytest
import torch
from sparse_units import make_kv, make_seq

PER_TOKEN = 2 * 2 * 1 * 4  # K and V, 2 heads, d = 1, float32


@pytest.mark.parametrize("host_table, keys", [
    ([0, 1, 2], [[0, 1], [2, 3]]),  # one run of host blocks: read in place
    ([3, 0, 5], [[6, 7], [0, 1]]),  # apart: gathered
])
def test_a_chunk_summarizes_the_blocks_it_completes(host_table, keys):
    kv = make_kv()
    seq = make_seq([], host_table, pos=0, summary_ids=[4, 6, 7])
    kv.summarize_prefill(seq, 0, 5)  # tokens 0-4: blocks 0 and 1 complete
    for block, (lo, hi) in enumerate(keys):
        for head in (0, 1):
            row = seq.summary_ids[block]
            assert kv.kmin[0, row, head, 0] == 100 * head + lo
            assert kv.kmax[0, row, head, 0] == 100 * head + hi
    assert not kv.kmin[0, 7].any()  # block 2: incomplete
    assert kv.tally.take().host_write_bytes == 5 * PER_TOKEN


def test_a_chunk_completing_no_block_only_counts_its_tokens():
    kv = make_kv()
    kv.summarize_prefill(make_seq([], [0, 1, 2], pos=0), 4, 5)
    assert not kv.kmin.any() and not kv.kmax.any()
    assert kv.tally.take().host_write_bytes == PER_TOKEN


def test_the_key_copy_is_made_with_the_summary():
    kv = make_kv(rerank=2, rerank_source="int8")
    kv.key_codes = torch.zeros(1, 8, 2, 1, 2, dtype=torch.int8)  # [L, ids, Hkv, d, B]
    kv.key_scales = torch.zeros(1, 8, 2)
    kv.summarize_prefill(make_seq([], [0, 1, 2], pos=0, summary_ids=[5, 6, 7]), 0, 2)
    # block 0's keys: head 0 [0, 1], head 1 [100, 101]; scale = largest |key| / 127, codes
    # rounded: 100 * 127 / 101 = 125.7 -> 126
    assert kv.key_codes[0, 5, :, 0].tolist() == [[0, 127], [126, 127]]
    torch.testing.assert_close(kv.key_scales[0, 5], torch.tensor([1 / 127, 101 / 127]))
    assert not kv.key_codes[0, 6].any() and not kv.key_scales[0, 6].any()


def test_store_prompt_hands_the_request_its_host_cache_and_counts_the_put():
    kv = make_kv()
    store, prefix = SimpleNamespace(bytes_put=100), SimpleNamespace(bytes_put=10)

    def put_prompt(seq):  # 64 bytes to the request's namespace, 32 to prefix-cache entries
        store.bytes_put += 64 + 32
        prefix.bytes_put += 32
        return "cache"

    kv.remote = SimpleNamespace(store=store, prefix=prefix, put_prompt=put_prompt)
    seq = make_seq([], [0, 1], pos=0)
    kv.store_prompt(seq)
    assert seq.host_cache == "cache"
    counted = kv.tally.take()
    assert (counted.remote_put_bytes, counted.prefix_put_bytes) == (64, 32)
