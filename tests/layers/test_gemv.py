"""The bf16 linear kernel (`layers/gemv.py`, through `Linear.forward`) against a float64
reference of the same bf16 inputs (to the output's own bf16 rounding) and F.linear: rows 1 to
MAX_ROWS and one more (oneDNN's path), K and N with tails, bias or not, 1 and 2 threads; the
fallback when it cannot be built; OASISKV_LINEAR."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from oasiskv.layers import decode_kernel, gemv
from oasiskv.layers.linear import Linear, pack_linears


@pytest.fixture(autouse=True)
def kernel_on(monkeypatch):
    monkeypatch.setenv(gemv.ENV, "kernel")


@pytest.fixture
def ext(kernel_on):
    e = decode_kernel.load(gemv.SOURCE, "the bf16 linear kernel", "oneDNN")
    assert e is not None, "the kernel builds and loads on this machine"
    if "avx512bf16" not in e.isas():
        pytest.skip("this CPU has no AVX-512 BF16: Linear keeps oneDNN's path")
    return e


def layer(k: int, n: int, bias: bool, seed: int = 0) -> Linear:
    torch.manual_seed(seed)
    lin = Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.normal_()  # unit scale: sums of K products, far from bf16's tiny values
        if bias:
            lin.bias.normal_()
    lin.pack()
    return lin


def reference(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.double(), lin.weight.double(),
                    None if lin.bias is None else lin.bias.double())


def close_to_truth(got: torch.Tensor, truth: torch.Tensor) -> None:
    """The exact sum rounded once to bf16 (the products are exact in fp32; fp32 summation adds
    ~K * 2^-24 relative): half a bf16 ulp, 2^-8 of the value, plus fp32's slack near zero."""
    assert got.dtype == torch.bfloat16 and got.shape == truth.shape
    scale = truth.abs().max().item()
    torch.testing.assert_close(got.double(), truth, rtol=2**-8, atol=1e-5 * scale)


@pytest.mark.parametrize("k", [40, 72, 576, 33])
@pytest.mark.parametrize("n", [1, 17, 576, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_float64_and_f_linear(ext, threads, k, n, bias):
    lin = layer(k, n, bias, seed=k * n)
    assert lin.gemv_packed is not None, "bf16 on a CPU with AVX-512 BF16: the kernel's copy"
    g = torch.Generator().manual_seed(k + n)
    with torch.inference_mode():
        for rows in [*range(1, gemv.MAX_ROWS + 1), gemv.MAX_ROWS + 1]:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            assert gemv.serves(lin.gemv_packed, x) == (rows <= gemv.MAX_ROWS)
            got = lin(x)
            close_to_truth(got, reference(lin, x))
            # F.linear (oneDNN) rounds the same fp32 sums once: equal up to one bf16 ulp
            torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias),
                                       rtol=2**-7, atol=1e-5 * got.abs().max().item())


def test_kernel_takes_leading_dims_and_strided_rows(ext):
    lin = layer(72, 100, True)
    with torch.inference_mode():
        x = torch.randn(2, 3, 72).to(torch.bfloat16)
        close_to_truth(lin(x), reference(lin, x))
        x = torch.randn(4, 200).to(torch.bfloat16)[:, 50:122]  # a strided input
        close_to_truth(lin(x), reference(lin, x))


def test_kernel_computes_the_calls_a_decode_makes(ext, monkeypatch):
    """Linear's few-row bf16 calls go to the kernel (a spy), oneDNN's packed path elsewhere."""
    lin = layer(64, 48, False)
    calls = []
    real = gemv.linear
    monkeypatch.setattr(gemv, "linear", lambda p, x: calls.append(x.shape) or real(p, x))
    with torch.inference_mode():
        lin(torch.randn(3, 64).to(torch.bfloat16))
        lin(torch.randn(gemv.MAX_ROWS + 1, 64).to(torch.bfloat16))
    assert calls == [(3, 64)]
    x = torch.randn(2, 64).to(torch.bfloat16)
    lin(x)  # autograd on: the weight, not a packed copy
    assert calls == [(3, 64)]


def test_onednn_choice_keeps_the_packed_path(ext, monkeypatch):
    monkeypatch.setenv(gemv.ENV, "onednn")
    lin = layer(64, 48, False)
    assert lin.gemv_packed is None and lin.packed is not None
    monkeypatch.setenv(gemv.ENV, "fast")
    with pytest.raises(ValueError, match="OASISKV_LINEAR='fast'"):
        layer(64, 48, False)


def test_a_cpu_without_avx512_bf16_keeps_the_packed_path(ext, monkeypatch):
    monkeypatch.setattr(ext, "isas", lambda: [])  # as the kernel answers on such a CPU
    lin = layer(64, 48, False)
    assert lin.gemv_packed is None and lin.packed is not None


def test_float32_never_takes_the_kernel(ext):
    lin = Linear(64, 48)
    lin.pack()
    assert lin.gemv_packed is None


def test_pack_linears_shares_the_kernel_copy(ext):
    model = torch.nn.Sequential(Linear(64, 48).to(torch.bfloat16))
    pack_linears(model)
    other = torch.nn.Sequential(Linear(64, 48).to(torch.bfloat16))
    pack_linears(other, like=model)
    assert other[0].gemv_packed is model[0].gemv_packed is not None


def test_falls_back_to_onednn_with_one_warning_when_the_kernel_cannot_build(tmp_path,
                                                                            monkeypatch):
    broken = tmp_path / "gemv_broken.cpp"
    broken.write_text("#include <torch/extension.h>\nthis is not C++;\n")
    monkeypatch.setattr(gemv, "SOURCE", broken)
    monkeypatch.setattr(decode_kernel, "_loaded", {})
    monkeypatch.setenv("OASISKV_CACHE", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="bf16 linear kernel could not be built"):
        lin = layer(64, 48, True)
    assert lin.gemv_packed is None and lin.packed is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning only
        lin2 = layer(64, 48, True)
        with torch.inference_mode():
            x = torch.randn(2, 64).to(torch.bfloat16)
            close_to_truth(lin2(x), reference(lin2, x))
