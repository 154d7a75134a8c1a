"""Rotary position embedding (RoPE) with the rope_scaling variants Llama-family configs use."""

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.theta, self.scaling = (
            head_dim, max_position, theta, scaling)
        self.register_buffer("cos", torch.empty(max_position, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_position, head_dim), persistent=False)
        self.build()

    def build(self) -> None:
        """Computes the cos/sin tables [P, d] in fp32 on the buffers' device (call again after
        the module was created on the meta device)."""
        if self.cos.is_meta:
            return
        inv_freq = _inv_freq(self.head_dim, self.theta, self.scaling).float()
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).to(self.cos.device)
        self.cos, self.sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of `positions` ([N]) in `dtype`, [N, 1, d] each. A model gathers them
        once per forward pass and hands them to every layer."""
        return (self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q [N, H, d], k [N, Hkv, d], rope: `tables` of their positions
        cos, sin = rope
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
