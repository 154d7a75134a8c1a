"""The block-head gather into the slab (`layers/block_gather.py`; its Triton kernel
`layers/triton_kernels/gather.py`, compiled on CUDA when OASISKV_TEST_DEVICE is cuda, else run
on the CPU by Triton's interpreter): equal to a slice by slice copy, for fp32 and bf16, odd block
sizes and head dims, several layers; and, called once for every layer, equal to what
`kv/slab_fill._gather_working_set` does layer by layer today. On CUDA the host tier is pinned
memory the kernel reads in place (`kv/transfers.device_view`), as the engine has it."""

import importlib

import pytest
import torch
from triton_interp import triton_device  # noqa: F401 (the fixture)

from oasiskv.kv.transfers import device_view
from oasiskv.layers import block_gather

L, HKV = 3, 2


@pytest.fixture(autouse=True)
def on_device(triton_device, monkeypatch):  # noqa: F811 (the imported fixture)
    """The tests' device (`triton_device`)."""
    monkeypatch.delenv("OASISKV_CUDA_ATTENTION", raising=False)
    return triton_device


def pools(dtype: torch.dtype, block: int, d: int, g: torch.Generator, device: torch.device):
    """A host tier of 9 blocks (random; on CUDA pinned, seen from the device in place) and a
    device pool of 7 (zeros), [L, 2, Hkv, slots, d]."""
    host = torch.randn(L, 2, HKV, 9 * block, d, generator=g).to(dtype)
    if device.type == "cuda":
        host = device_view(host.pin_memory(), device)
    return torch.zeros(L, 2, HKV, 7 * block, d, dtype=dtype, device=device), host


def items(block: int, g: torch.Generator, n: int = 10):
    """n block-heads to move: distinct (layer, head, target block), any source block."""
    picks = torch.randperm(L * HKV * 7, generator=g)[:n]
    layers, heads, dst = picks // (HKV * 7), picks // 7 % HKV, picks % 7 * block
    src = torch.randint(0, 9, (n,), generator=g) * block
    return layers, heads, src, dst


def by_slices(device_kv, host_kv, layers, heads, src, dst, block):
    """The truth: one slice copy per item."""
    for ll, h, s, t in zip(layers.tolist(), heads.tolist(), src.tolist(), dst.tolist(),
                           strict=True):
        device_kv[ll, :, h, t:t + block] = host_kv[ll, :, h, s:s + block]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,d", [(16, 16), (5, 12), (1, 8)])
def test_the_kernel_and_the_reference_equal_slice_copies(dtype, block, d, on_device):
    g = torch.Generator().manual_seed(block * 100 + d)
    device_kv, host_kv = pools(dtype, block, d, g, on_device)
    moves = tuple(x.to(on_device) for x in items(block, g))
    want = device_kv.clone()
    by_slices(want, host_kv, *moves, block)
    ref = device_kv.clone()
    block_gather.gather_block_heads_torch(ref, host_kv, *moves, block)
    assert torch.equal(ref, want)
    gather = importlib.import_module("oasiskv.layers.triton_kernels.gather")
    got = device_kv.clone()
    gather.gather(got, host_kv, torch.stack(moves, 1), block)
    assert torch.equal(got, want)  # a copy: bit for bit
    assert got.abs().sum() > 0


def test_one_call_for_all_layers_equals_slab_fill_layer_by_layer(on_device):
    """The wiring of `kv/slab_fill._gather_working_set`: its loop over layers (below, as it
    is) against one gather_block_heads of every layer's (slot, head)s; on the CPU it takes the
    PyTorch path, on CUDA with a pinned host tier the kernel (triton_serves)."""
    B, K, d, dev = 4, 3, 8, on_device
    g = torch.Generator().manual_seed(7)
    device_kv, host_kv = pools(torch.float32, B, d, g, dev)
    head_map = torch.randint(-1, 6, (L, K, HKV), generator=g).to(dev)  # [L, K, Hkv] blocks
    table = torch.randperm(9, generator=g).to(dev)  # logical block -> host block
    slab = torch.tensor([2, 6, 0, 4], device=dev) * B  # first token slot of each slab slot
    want = device_kv.clone()
    arange_b = torch.arange(B, device=dev)
    for layer, hm in enumerate(head_map):  # slab_fill._gather_working_set today
        slots, heads = (hm >= 0).nonzero(as_tuple=True)
        host = table[hm[slots, heads]]
        src, dst = host[:, None] * B + arange_b, slab[slots, None] + arange_b
        kv = want[layer]
        kv[:, heads[:, None], dst] = host_kv[layer][:, heads[:, None], src]
    layers, slots, heads = (head_map >= 0).nonzero(as_tuple=True)
    host = table[head_map[layers, slots, heads]]
    got = device_kv.clone()
    # the CPU: the PyTorch path; CUDA: the kernel
    assert block_gather.triton_serves(got, host_kv) == (dev.type == "cuda")
    block_gather.gather_block_heads(got, host_kv, layers, heads, host * B, slab[slots], B)
    assert torch.equal(got, want)
    gather = importlib.import_module("oasiskv.layers.triton_kernels.gather")
    kernel = device_kv.clone()
    gather.gather(kernel, host_kv, torch.stack([layers, heads, host * B, slab[slots]], 1), B)
    assert torch.equal(kernel, want)


def test_nothing_to_move_and_a_strided_pool_is_refused(on_device):
    g = torch.Generator().manual_seed(1)
    device_kv, host_kv = pools(torch.float32, 4, 8, g, on_device)
    before = device_kv.clone()
    empty = torch.zeros(0, dtype=torch.long, device=on_device)
    block_gather.gather_block_heads(device_kv, host_kv, empty, empty, empty, empty, 4)
    assert torch.equal(device_kv, before)
    gather = importlib.import_module("oasiskv.layers.triton_kernels.gather")
    with pytest.raises(ValueError, match="last dim must be contiguous"):
        gather.gather(device_kv.transpose(-1, -2), host_kv,
                      torch.zeros(1, 4, dtype=torch.long, device=on_device), 4)
