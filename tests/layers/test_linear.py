"""The packed and small-batch paths of Linear against a float64 reference."""

import pytest
import torch
import torch.nn.functional as F

from oasiskv.layers.linear import Linear, pack_linears


def make(dtype: torch.dtype, bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias).to(dtype)
    with torch.no_grad():
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_reference(dtype, bias):
    layer = make(dtype, bias)
    layer.pack()
    # bfloat16 packs only where oneDNN has a bf16 path (not on an AVX2-only CPU): elsewhere
    # the layer runs unpacked, with the same results
    bf16_path = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (layer.packed is not None) == (dtype == torch.float32 or bf16_path)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.inference_mode():
        for shape in [(1, 96), (2, 96), (3, 96), (16, 96), (40, 96), (2, 5, 96)]:
            x = torch.randn(shape).to(dtype)
            ref = F.linear(x.double(), layer.weight.double(),
                           None if layer.bias is None else layer.bias.double())
            out = layer(x)
            assert out.shape == ref.shape and out.dtype == dtype
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
        x = torch.randn(16, 200).to(dtype)[:, 50:146]  # a strided input
        torch.testing.assert_close(layer(x).double(), F.linear(x.double(), layer.weight.double(),
                                   None if layer.bias is None else layer.bias.double()),
                                   atol=tol, rtol=tol)


def test_packed_linear_leaves_autograd_to_the_weight():
    layer = make(torch.float32, True)
    layer.pack()
    x = torch.randn(4, 96)
    layer(x).sum().backward()  # with grad enabled the packed copy (no autograd) is not used
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(160, 96))


def test_pack_linears_shares_packed_copies():
    model = torch.nn.Sequential(make(torch.float32, False), torch.nn.ReLU(),
                                make(torch.float32, True))
    pack_linears(model)
    other = torch.nn.Sequential(make(torch.float32, False), torch.nn.ReLU(),
                                make(torch.float32, True))
    pack_linears(other, like=model)
    assert other[0].packed is model[0].packed and other[2].packed is model[2].packed
