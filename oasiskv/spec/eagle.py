"""An EAGLE-style draft head: one small decoder layer over the target's own features.

Row p of the head reads the embedding of the known token x_p and the target's features at
position p-1 (the outputs of a few target layers, fused), attends over its own K/V of the
previous `window` rows, and the target's LM head (restricted to a draft vocabulary) predicts
x_{p+1}. Between engine steps the head is always conditioned on true tokens and true target
features, so its errors do not compound like a self-draft chain.

A trained head is a directory: `config.json` (EagleConfig) and `head.safetensors` (the head's
weights and `d2t`, draft index -> target token id). The target's embedding and LM head are
not stored: they come from the target model the head is attached to.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.config_checks import check_field_types
from oasiskv.layers.norm import RMSNorm
from oasiskv.layers.rotary import RotaryEmbedding
from oasiskv.models.llama import LlamaForCausalLM, LlamaMLP

CONFIG_FILE, WEIGHTS_FILE = "config.json", "head.safetensors"


@dataclass
class EagleConfig:
    target: str  # the model it was trained on (informative; shapes are checked on load)
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    vocab_size: int  # the target's
    aux_layers: list[int]  # target layers whose outputs are the features
    draft_vocab: int  # rows of the target's LM head the head predicts over
    window: int = 1024  # past head rows each row attends to (the training chunk length)

    @classmethod
    def for_target(cls, target: str, mc: ModelConfig, draft_vocab: int,
                   aux_layers: list[int] | None = None, window: int = 1024) -> EagleConfig:
        if aux_layers is None:  # low, middle and last layer, as EAGLE-3 fuses
            aux_layers = sorted({min(2, mc.num_layers - 1), mc.num_layers // 2,
                                 mc.num_layers - 1})
        return cls(target, mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                   mc.intermediate_size, mc.rms_norm_eps, mc.rope_theta,
                   mc.max_position_embeddings, mc.vocab_size, aux_layers, draft_vocab, window)

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.hidden_size


class HeadAttention(nn.Module):
    """Plain causal attention over the head's own K/V, limited to the last `window` rows."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h, hkv, d, hidden = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = nn.Linear(hidden, h * d, bias=False)
        self.k_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.v_proj = nn.Linear(hidden, hkv * d, bias=False)
        self.o_proj = nn.Linear(h * d, hidden, bias=False)
        self.rotary = RotaryEmbedding(d, cfg.max_position, cfg.rope_theta)
        self.window = cfg.window

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """x [B, S, D], positions [S]; past (k, v [B, T, Hkv, d], positions [T]).
        Returns the output [B, S, D] and the K/V of past + these rows."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b * s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b * s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(self.rotary.tables(positions.repeat(b), q.dtype), q, k)
        q, k = q.view(b, s, self.num_heads, -1), k.view(b, s, self.num_kv_heads, -1)
        kpos = positions
        if past is not None:
            k, v, kpos = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1), torch.cat(
                [past[2], positions])
        # [S, T+S]: causal and at most `window` rows back
        mask = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] > positions[:, None]
                                                         - self.window)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        out = self.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        return out, (k, v, kpos)


class EagleHead(nn.Module):
    """Fused features + token embedding -> one decoder layer -> norm -> the target's LM head
    rows for the draft vocabulary. The target's embedding and LM head are frozen buffers."""

    def __init__(self, cfg: EagleConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 d2t: torch.Tensor) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.feature_norms = nn.ModuleList(RMSNorm(hidden, cfg.rms_norm_eps)
                                           for _ in cfg.aux_layers)
        self.embed_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.feature_size + hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)  # reads hidden_size and intermediate_size
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.register_buffer("d2t", d2t.long())  # [Vd] draft index -> target token id
        self.register_buffer("embed", embed, persistent=False)  # [V, D] target's
        self.register_buffer("lm_head", lm_head[d2t], persistent=False)  # [Vd, D]

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """tokens [B, S] (x_p), features [B, S, F] (the target's at p-1), positions [S] (p).
        Returns hidden states [B, S, D] (before the LM head) and the head's K/V."""
        parts = features.float().split(self.config.hidden_size, dim=-1)
        fused = [norm(part) for norm, part in zip(self.feature_norms, parts, strict=True)]
        x = self.fc(torch.cat([self.embed_norm(self.embed[tokens]), *fused], dim=-1))
        attn, kv = self.self_attn(self.input_layernorm(x), positions, past)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.norm(x), kv

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., Vd] over the draft vocabulary."""
        return hidden @ self.lm_head.T

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.config), indent=1))
        save_file({k: v.contiguous() for k, v in self.state_dict().items()},
                  str(path / WEIGHTS_FILE))


def read_config(path: Path) -> EagleConfig:
    """The head's config.json, refused (naming the file and fields) when a field is missing,
    unknown, of the wrong type or not positive."""
    file = path / CONFIG_FILE
    try:
        data = json.loads(file.read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from None
    fields = {f.name: f for f in dataclasses.fields(EagleConfig)}
    if not isinstance(data, dict):
        raise ValueError(f"{file}: holds {type(data).__name__}, not a JSON object")
    missing = sorted(n for n, f in fields.items()
                     if n not in data and f.default is dataclasses.MISSING)
    unknown = sorted(set(data) - set(fields))
    if missing or unknown:
        raise ValueError(f"{file}: missing fields {missing}, unknown fields {unknown}")
    cfg = EagleConfig(**data)
    try:
        check_field_types(cfg)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None
    sizes = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
             "max_position", "vocab_size", "draft_vocab", "window")
    bad = [f"{n}={getattr(cfg, n)}" for n in sizes if getattr(cfg, n) <= 0]
    layers = cfg.aux_layers
    if not isinstance(layers, list) or not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
        bad.append(f"aux_layers={layers!r} (a non-empty list of layer indices)")
    if bad:
        raise ValueError(f"{file}: not positive: {', '.join(bad)}")
    return cfg


def read_weights(path: Path, cfg: EagleConfig) -> dict[str, torch.Tensor]:
    """head.safetensors, refused (naming the file and tensors) when it cannot be read or its
    tensors are not the ones, of the shapes, that `cfg` makes."""
    file = path / WEIGHTS_FILE
    try:
        weights = load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file, truncated or corrupted? "
                         f"({e})") from None
    d2t = weights.get("d2t")
    if d2t is None or tuple(d2t.shape) != (cfg.draft_vocab,) or d2t.is_floating_point():
        raise ValueError(f"{file}: d2t must be {cfg.draft_vocab} integer token ids, got "
                         f"{None if d2t is None else (tuple(d2t.shape), d2t.dtype)}")
    if d2t.numel() and not 0 <= int(d2t.min()) <= int(d2t.max()) < cfg.vocab_size:
        raise ValueError(f"{file}: d2t holds token ids outside [0, {cfg.vocab_size})")
    with torch.device("meta"):  # the shapes `cfg` makes, no memory
        want = EagleHead(cfg, torch.empty(cfg.vocab_size, cfg.hidden_size),
                         torch.empty(cfg.vocab_size, cfg.hidden_size), d2t.to("meta")
                         ).state_dict()
    missing, unknown = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    shapes = [f"{k} {tuple(weights[k].shape)} (the config makes {tuple(want[k].shape)})"
              for k in sorted(set(want) & set(weights)) if weights[k].shape != want[k].shape]
    if missing or unknown or shapes:
        raise ValueError(f"{file} does not fit {CONFIG_FILE}: missing {missing[:5]}, unknown "
                         f"{unknown[:5]}, wrong shapes {shapes[:5]}")
    return weights


def load_head(path: str | Path, target: LlamaForCausalLM) -> EagleHead:
    """A trained head from its directory, attached to `target`'s embedding and LM head."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} is not a trained draft head (needs {CONFIG_FILE} and "
                         f"{WEIGHTS_FILE}; make one with `oasiskv train-drafter`)")
    cfg = read_config(path)
    mc = target.config
    if (cfg.hidden_size, cfg.vocab_size) != (mc.hidden_size, mc.vocab_size) or max(
            cfg.aux_layers) >= mc.num_layers:
        raise ValueError(f"draft head {path} was trained for {cfg.target} (hidden "
                         f"{cfg.hidden_size}, vocabulary {cfg.vocab_size}); the target has "
                         f"hidden {mc.hidden_size}, vocabulary {mc.vocab_size}, "
                         f"{mc.num_layers} layers")
    weights = read_weights(path, cfg)
    head = EagleHead(cfg, target.model.embed_tokens.weight, target.lm_head.weight,
                     weights["d2t"])
    head.load_state_dict(weights)
    # on the target's device: its features and embedding live there (the frozen buffers
    # already do; the head's own weights come from the file, on the CPU)
    return head.to(target.lm_head.weight.device).eval().requires_grad_(False)
