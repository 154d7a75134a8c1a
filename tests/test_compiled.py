"""compiled(): a compiled function equals its eager self; a failed compile falls back to eager
with one warning."""

import pytest
import torch
import torch._inductor.config as inductor_config

from oasiskv.compiled import compiled


def scaled_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x * w[..., None, :]).sum(-1) + 0.5


def test_compiled_equals_eager_across_shapes():
    fn = compiled(scaled_sums)
    for shape in [(5, 8), (3, 7, 8), (2, 4, 9, 16)]:  # dynamic: ranks and sizes vary
        x = torch.randn(shape, dtype=torch.bfloat16)
        w = torch.randn(*shape[:-2], shape[-1])
        torch.testing.assert_close(fn(x, w), scaled_sums(x, w), rtol=1e-5, atol=1e-5)


def test_failed_compile_warns_once_and_runs_eagerly():
    def shifted_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # not compiled before
        return (x * w[..., None, :]).sum(-1) - 1.25

    fn = compiled(shifted_sums)
    x, w = torch.randn(3, 7, 8), torch.randn(3, 8)
    with inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",), "fx_graph_cache": False}):
        with pytest.warns(RuntimeWarning, match="torch.compile of .*shifted_sums failed"):
            got = fn(x, w)
        assert torch.equal(got, shifted_sums(x, w))
        assert fn._run is fn.eager  # no second attempt, no second warning
        assert torch.equal(fn(x, w), shifted_sums(x, w))
