"""The int8 key copy's CPU kernel (`kv/summaries.quantize_into`, `layers/csrc/quantize_keys.cpp`)
writes the codes and scales that `quantize_keys` computes, bit for bit, into the copy's rows:
bf16 and fp32 keys read where they lie (a view of a pool), a run of layers, permuted ids, an
all-zero block, B other than 16, on 1 and 2 threads; 4-bit copies and keys whose blocks are not
contiguous take `quantize_keys`; bad ids are refused by name."""

import pytest
import torch

from oasiskv.kv import summaries
from oasiskv.kv.summaries import _quantize, quantize_into, quantize_keys


def case(dtype, B=16, d=64, L=3, H=3, n=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(L, 2, H, n * B + 2 * B, d, generator=g) * 4).to(dtype)
    pool[1, 0, 2, B:2 * B] = 0  # an all-zero block (scale 0, codes 0)
    keys = pool[:, 0, :, B:B + n * B].unflatten(2, (n, B))  # [L, H, n, B, d], a view
    ids = torch.randperm(n + 5, generator=g)[:n]
    return keys, ids


def by_indexing(keys, ids, layers, bits, ref=quantize_keys):
    codes, scales = ref(keys, bits)
    out_c = torch.zeros(keys.shape[0] + 2, len(ids) + 5, *codes.shape[2:], dtype=codes.dtype)
    out_s = torch.zeros(keys.shape[0] + 2, len(ids) + 5, keys.shape[1])
    out_c[layers, ids], out_s[layers, ids] = codes, scales
    return out_c, out_s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B", [16, 8])
def test_the_kernel_writes_the_reference_codes(dtype, B, threads):
    assert summaries.extension() is not None, "the kernel builds and loads on this machine"
    keys, ids = case(dtype, B=B)
    layers = slice(1, 1 + keys.shape[0])
    want_c, want_s = by_indexing(keys, ids, layers, 8, ref=_quantize)
    got_c, got_s = torch.zeros_like(want_c), torch.zeros_like(want_s)
    with torch.inference_mode():
        quantize_into(keys, got_c, got_s, ids, layers, 8)
    assert torch.equal(got_c, want_c) and torch.equal(got_s, want_s)
    assert want_c.abs().max() == 127 and (want_s[2, ids[0], 2] == 0)  # the zero block


@pytest.mark.parametrize("bits,strided", [(4, False), (8, True)])
def test_four_bits_and_scattered_tokens_take_quantize_keys(bits, strided, monkeypatch):
    keys, ids = case(torch.bfloat16)
    if strided:  # [.., B, d] with d not contiguous: the kernel does not read it
        keys = keys.transpose(-1, -2).contiguous().transpose(-1, -2)
    calls = []
    monkeypatch.setattr(summaries, "extension", lambda: calls.append(1))
    want_c, want_s = by_indexing(keys, ids, slice(0, 3), bits)
    got_c, got_s = torch.zeros_like(want_c), torch.zeros_like(want_s)
    quantize_into(keys, got_c, got_s, ids, slice(0, 3), bits)
    assert torch.equal(got_c, want_c) and torch.equal(got_s, want_s) and not calls


def test_bad_ids_are_refused_by_name():
    keys, ids = case(torch.float32)
    codes = torch.zeros(3, len(ids), 3, 64, 16, dtype=torch.int8)
    scales = torch.zeros(3, len(ids), 3)
    bad = torch.arange(len(ids))
    bad[3] = len(ids) + 2
    with pytest.raises(RuntimeError, match=f"id {len(ids) + 2} of {len(ids)}"):
        summaries.extension().quantize_into(keys, codes, scales, bad, 0)
    assert not codes.any()  # checked before anything is written
