"""RoPE against a float64 rotation computed here: one pass's tables serve several layers."""

import torch

from oasiskv.layers.rotary import RotaryEmbedding


def rotate_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, H, d]: each pair (i, i + d/2) turned by position * theta^(-2i/d), in float64."""
    d = x.shape[-1]
    angle = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]  # [N, 1, d/2]
    a, b = x.double()[..., :d // 2], x.double()[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def test_rotary_matches_reference_across_calls():
    rope = RotaryEmbedding(16, 64, 10000.0)
    g = torch.Generator().manual_seed(0)
    first, second = torch.tensor([0, 5, 63]), torch.tensor([1, 2, 3])
    tables = {0: rope.tables(first, torch.float32), 1: rope.tables(second, torch.float32)}
    for pass_, positions in ((0, first), (0, first), (1, second)):  # a pass's layers, another
        q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
        q_rot, k_rot = rope(tables[pass_], q, k)
        torch.testing.assert_close(q_rot.double(), rotate_reference(q, positions, 10000.0),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k_rot.double(), rotate_reference(k, positions, 10000.0),
                                   atol=1e-5, rtol=1e-5)
    q = torch.randn(3, 4, 16, generator=g).bfloat16()  # same positions, another dtype
    q_rot, _ = rope(rope.tables(first, torch.bfloat16), q, q[:, :2])
    assert q_rot.dtype == torch.bfloat16
    torch.testing.assert_close(q_rot.double(), rotate_reference(q, first, 10000.0),
                               atol=0.05, rtol=0.02)
