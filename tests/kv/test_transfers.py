"""The host <-> device moves of the sparse KV (`kv/transfers.py`) on a CUDA device: the pinned
host pool's device view aliases it (device reads and writes land in host memory), small
uploads arrive. On the CPU each is the identity (the CPU path is the tensors themselves), so
these run only on a GPU (OASISKV_TEST_DEVICE=cuda)."""

import os

import pytest
import torch

from oasiskv.kv.transfers import device_view, download, upload

DEVICE = os.environ.get("OASISKV_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.skipif(DEVICE == "cpu", reason="a GPU run (OASISKV_TEST_DEVICE=cuda)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_view_of_a_pinned_pool_reads_and_writes_it_in_place(dtype):
    dev = torch.device(DEVICE)
    host = torch.randn(2, 3, 64, 8).to(dtype).pin_memory()  # [L, Hkv, slots, d]
    view = device_view(host[1:], dev)  # a slice, as a pool's sparse layers are
    assert view.is_cuda and view.dtype == dtype and view.data_ptr() == host[1:].data_ptr()
    idx = torch.tensor([5, 1, 63], device=dev)
    assert torch.equal(view.index_select(2, idx).cpu(), host[1:].index_select(2, idx.cpu()))
    view[:, :, idx] = torch.full((1, 3, 3, 8), 7.0, dtype=dtype, device=dev)
    torch.cuda.synchronize()
    assert (host[1, :, [5, 1, 63]] == 7).all() and not (host[0] == 7).any()


def test_a_pageable_pool_has_no_device_view():
    with pytest.raises(ValueError, match="pinned"):
        device_view(torch.zeros(4, 4), torch.device(DEVICE))


def test_upload_and_download_arrive():
    dev = torch.device(DEVICE)
    x = torch.arange(7)
    y = upload(x, dev)
    back = torch.zeros(7, dtype=x.dtype).pin_memory()
    download(back, y * 2)
    torch.cuda.synchronize()
    assert y.is_cuda and torch.equal(back, x * 2)
