"""The Triton decode-attention kernel (`layers/triton_kernels/decode.py`, planned by
`layers/triton_attention.py`, through `Attention.forward` as on CUDA), compiled on CUDA tensors
when OASISKV_TEST_DEVICE is cuda, else run on the CPU by Triton's interpreter, equals the
previous implementation (`layers/attention_ref.py`) and a brute-force float64 attention over
expanded K/V: dense (one run, runs out of order), sparse masks, draft rows (masks shared or
their own), sparse slabs with their drafts in the draft slots, GQA groups of 1, 3 and 7, odd
lengths, fp32 and bf16, whole and split over the sequence (log-sum-exp merge); and the
dispatch: CUDA only, OASISKV_CUDA_ATTENTION, no triton."""

import sys
import warnings

import pytest
import torch
from test_decode_kernel import (
    SLAB_LAYOUTS,
    check_decodes,
    check_slabs,
    close_to_reference,
    close_to_truth,
    drafts_case,
    layers,
    run,
)
from triton_interp import triton_device  # noqa: F401 (the fixture)

from oasiskv.context import SeqAttention
from oasiskv.layers import decode_kernel, triton_attention, triton_kernels
from oasiskv.layers.attention import Attention, GqaAttention

D = 16


class TritonAttention(Attention):
    """`Attention` as it is on CUDA, its decodes through the Triton kernel (on CPU tensors:
    interpreted)."""

    def _triton(self, q: torch.Tensor):
        return triton_kernels.load("decode")


@pytest.fixture(autouse=True)
def on_device(triton_device, monkeypatch):  # noqa: F811 (the imported fixture)
    """The tests' device (`triton_device`)."""
    monkeypatch.delenv(triton_kernels.ENV, raising=False)
    return triton_device


def close_to_truth_here(got: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype,
                        values: list[torch.Tensor]) -> None:
    """`close_to_truth`, but for bf16 compiled on CUDA: there the kernel multiplies bf16 as the
    GPU does (decode.py's DOT): the scores exactly (bf16 products, fp32 sums), but each
    probability rounded to bf16 (relative error at most 2^-9) before it weighs its value, and
    the sum of weights taken unrounded, so the output may be off by 2^-9 x the largest |value|
    it weighs, beside its own rounding to bf16 (half an ulp: rtol 2^-8 covers it). Under the
    interpreter (the CPU) the products are fp32 and the bound of `close_to_truth` holds."""
    if got.is_cuda and dtype == torch.bfloat16:
        vmax = max(float(x.abs().max()) for x in values)
        torch.testing.assert_close(got.double(), truth, atol=2**-9 * vmax + 1e-5, rtol=2**-8)
    else:
        close_to_truth(got, truth, dtype)


@pytest.fixture(params=[None, 11], ids=["whole", "split"])
def chunk(request, monkeypatch):
    """Each request in one unit, or cut into units of 11 slots (merged by log-sum-exp)."""
    size = request.param or 4096
    monkeypatch.setattr(triton_attention, "chunk_for", lambda seqs, hkv: size)
    return size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,group", [(2, 1), (3, 3), (1, 7)])
@pytest.mark.parametrize("kind", ["one run", "runs"])
@pytest.mark.parametrize("masked", [False, True])
def test_decode_equals_reference_and_brute_force(dtype, hkv, group, kind, masked, chunk,
                                                 on_device):
    g = torch.Generator().manual_seed(hkv * 10 + group)
    new, ref = layers(hkv, group, dtype, g, TritonAttention, device=on_device)
    check_decodes(new, ref, g, kind, masked, [2, 7, 37, 53], dtype, on_device,
                  close_to_truth_here)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("masks", ["none", "shared", "own"])
def test_draft_rows_equal_reference_and_brute_force(dtype, group, masks, chunk, on_device):
    """Each draft sees the KV (under the drafts' mask) and its own K/V; the normal row the KV
    (over three runs out of order: the units cut them and keep the masks' positions)."""
    g = torch.Generator().manual_seed(group)
    new, ref, inputs, truths = drafts_case(dtype, group, "runs", masks, g, device=on_device)
    new = _as_triton(new)
    got = run(new, *inputs)
    close_to_reference(got, run(ref, *inputs), dtype)
    values = [new.pools["device"][1], inputs[2]]  # the pool's and the drafts' own
    for row, truth in enumerate(truths):
        close_to_truth_here(got[row], truth, dtype, values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("drafts", [0, 2])
def test_slabs_equal_reference_and_brute_force(dtype, group, drafts, chunk, on_device):
    """Sparse slabs, their drafts' K/V in the draft slots as the runner leaves them (the kernel
    reads a draft's own K/V from its row of the step's k/v: the same values)."""
    hkv, t, slots = 2, 37, 4
    g = torch.Generator().manual_seed(drafts * 10 + group)
    new, ref = layers(hkv, group, dtype, g, TritonAttention, device=on_device)
    # (the kernel reads a window where it lies)
    check_slabs(new, ref, g, SLAB_LAYOUTS["apart"], t, slots, drafts, dtype, on_device,
                close_to_truth_here)


@pytest.mark.parametrize("d", [16, 64, 80])  # 80: a head dim the tile pads (to 128)
def test_head_dims_and_a_mixed_step_equal_the_reference(d, chunk, on_device):
    """One step of a dense decode, a sparse one with drafts (own mask), a prefill chunk (left
    to SDPA) and a decode over the host pool: the kernel takes the decodes, one batch per pool."""
    hkv, group, dtype = 2, 3, torch.float32
    g = torch.Generator().manual_seed(d)
    new, ref = layers(hkv, group, dtype, g, TritonAttention, d=d, device=on_device)
    new.pools["host"] = ref.pools["host"] = tuple(torch.randn(hkv, 90, d, generator=g)
                                                  .to(on_device) for _ in range(2))
    valid, draft_valid = (torch.rand(hkv, 51, generator=g) > 0.5 for _ in range(2))
    valid[:, 0] = draft_valid[:, 0] = True
    valid, draft_valid = valid.to(on_device), draft_valid.to(on_device)
    seqs = [SeqAttention(0, 1, 33, 300, None),
            SeqAttention(1, 2, 51, 100, None, kv_valid=valid, draft_rows=[5, 6],
                         draft_valid=draft_valid),
            SeqAttention(2, 5, 9, 400, None),  # a prefill chunk: 3 queries over 9 slots
            SeqAttention(7, 8, 45, 20, None, pool="host")]
    q = torch.randn(8, hkv * group, d, generator=g).to(on_device)
    k, v = (torch.randn(8, hkv, d, generator=g).to(on_device) for _ in range(2))
    batches, rest = triton_attention.plan(seqs, q.device, hkv)
    assert [b.pool for b in batches] == ["device", "host"] and rest == [seqs[2]]
    got, want = run(new, q, k, v, seqs), run(ref, q, k, v, seqs)
    close_to_reference(got, want, dtype)


def test_units_cut_runs_in_order_and_the_split_fills_the_gpu():
    seq = SeqAttention(0, 1, 23, None, None, kv_runs=[(100, 10), (5, 13)])
    assert triton_attention.units_of(seq, 4) == [
        (100, 4, 0), (104, 4, 4), (108, 2, 8), (5, 4, 10), (9, 4, 14), (13, 4, 18), (17, 1, 22)]
    one = SeqAttention(0, 1, 300, 7, None)
    assert triton_attention.units_of(one, 4096) == [(7, 300, 0)]
    long = [SeqAttention(i, i + 1, 100_000, 0, None) for i in range(2)]
    size = triton_attention.chunk_for(long, 8)
    assert size % triton_attention.TILE == 0 and size >= triton_attention.MIN_CHUNK
    units = 2 * len(triton_attention.units_of(long[0], size))
    assert units * 8 >= triton_attention.PROGRAMS - 8 * 2  # within a unit per request of it
    short = [SeqAttention(0, 1, 50, 0, None)]
    assert triton_attention.chunk_for(short, 8) == triton_attention.MIN_CHUNK  # not below it


def test_cuda_only_and_the_environment_picks_torch_or_refuses_a_bad_value(monkeypatch,
                                                                          on_device):
    """On the CPU the layer never takes the Triton path, on CUDA it does; OASISKV_CUDA_ATTENTION
    =torch turns it off (then the decodes equal GqaAttention's exactly); a bad value is
    refused."""
    q = torch.zeros(1, 2, D)
    assert Attention(2, 1, D, 1.0)._triton(q) is None  # the CPU keeps its paths
    if on_device.type == "cuda":
        assert Attention(2, 1, D, 1.0)._triton(q.to(on_device)) is not None
    assert triton_kernels.load("decode") is not None
    monkeypatch.setenv(triton_kernels.ENV, "torch")
    monkeypatch.setenv(decode_kernel.ENV, "gqa")  # the PyTorch path: on the CPU, gqa's
    assert triton_kernels.load("decode") is None
    assert Attention(2, 1, D, 1.0)._triton(q.to(on_device)) is None
    g = torch.Generator().manual_seed(2)
    new, _, inputs, _ = drafts_case(torch.bfloat16, 7, "one run", "own", g, device=on_device)
    new = _as_triton(new)
    gqa, _ = layers(2, 7, torch.bfloat16, g, GqaAttention, device=on_device)
    gqa.pools = new.pools
    assert torch.equal(run(new, *inputs), run(gqa, *inputs))
    monkeypatch.setenv(triton_kernels.ENV, "fast")
    with pytest.raises(ValueError, match="OASISKV_CUDA_ATTENTION='fast'"):
        triton_kernels.load("decode")


def test_without_triton_one_warning_and_the_pytorch_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "oasiskv.layers.triton_kernels.decode", raising=False)
    monkeypatch.setattr(triton_kernels, "_missing", set())
    with pytest.warns(RuntimeWarning, match="Triton kernels are not available"):
        assert triton_kernels.load("decode") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert triton_kernels.load("decode") is None


def _as_triton(layer: Attention) -> TritonAttention:
    """The same layer (pools, heads), its decodes through the Triton kernel."""
    new = TritonAttention(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale)
    new.pools, new.layer_idx = layer.pools, layer.layer_idx
    return new
