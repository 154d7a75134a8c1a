"""One Llama-family decoder for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Parameter names equal transformers' so checkpoints load by name, except the fused q/k/v and
gate/up projections, whose parts are stacked at load (`stack_fused`). The model knows nothing
about paging or sparsity: `Attention` reads those from the step context.
"""

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.layers.attention import Attention
from oasiskv.layers.linear import Linear
from oasiskv.layers.norm import RMSNorm
from oasiskv.layers.rotary import RotaryEmbedding

# fused projection -> the checkpoint's projections stacked in it: one wider product per step
# instead of several (7 -> 4 linear calls per layer, 10 % less linear time on CPU)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PART_OF = {part: (fused, i) for fused, parts in FUSED.items() for i, part in enumerate(parts)}


def stack_fused(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's separate projections stacked (along the output dim) into the fused
    ones; a fused projection with a part missing keeps its parts' names (reported missing
    or unexpected by the caller)."""
    out, parts = {}, {}
    for name, w in state_dict.items():
        module, _, kind = name.rpartition(".")  # kind: weight | bias
        parent, _, proj = module.rpartition(".")
        if proj in PART_OF:
            fused, index = PART_OF[proj]
            parts.setdefault((parent, fused, kind), {})[index] = name
        else:
            out[name] = w
    for (parent, fused, kind), names in parts.items():
        if len(names) == len(FUSED[fused]):
            out[f"{parent}.{fused}.{kind}"] = torch.cat([state_dict[names[i]]
                                                         for i in range(len(names))])
        else:
            out.update({n: state_dict[n] for n in names.values()})
    return out


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        # q, k and v in one product (checkpoints' q_proj/k_proj/v_proj stacked at load)
        self.qkv_proj = Linear(cfg.hidden_size, (h + 2 * hkv) * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(h, hkv, d, scale=d**-0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]  # x [N, D]; rope: the pass's cos/sin rows (RotaryEmbedding.tables)
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(n, h, d), k.view(n, hkv, d), v.view(n, hkv, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up in one product (checkpoints' gate_proj/up_proj stacked at load)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(rope, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary = rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                               cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Final hidden states [N, D]; with aux_layers also the outputs of those layers
        concatenated, [N, len(aux_layers) * D] (the features an EAGLE-style drafter reads)."""
        x = self.embed_tokens(input_ids)  # [N, D]
        rope = self.rotary.tables(positions, x.dtype)  # once per pass, not once per layer
        aux = []
        for i, layer in enumerate(self.layers):
            x = layer(rope, x)
            if i in aux_layers:
                aux.append(x)
        hidden = self.norm(x)
        return (hidden, torch.cat(aux, dim=-1)) if aux_layers else hidden


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                aux_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Hidden states [N, D] for a flattened batch of tokens (and aux features, see
        LlamaModel); logits are separate so that only the positions that sample pay for the
        vocabulary projection."""
        return self.model(input_ids, positions, aux_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Loads a checkpoint with transformers' parameter names."""
        state_dict = stack_fused(state_dict)
        own = dict(self.named_parameters())
        if self.config.tie_word_embeddings:
            own.pop("lm_head.weight", None)
        # Checkpoints with tied embeddings may still carry lm_head; drop rotary buffers etc.
        extra = {k for k in state_dict if k not in own and k != "lm_head.weight"}
        missing = sorted(set(own) - set(state_dict))
        if missing or extra:
            raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                             f"unexpected {sorted(extra)[:5]}")
        with torch.no_grad():
            for name, param in own.items():
                w = state_dict[name]
                if w.shape != param.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)}, "
                                     f"model expects {tuple(param.shape)}")
                param.copy_(w)
        if self.config.tie_word_embeddings:  # re-tie: to_empty() gives lm_head its own tensor
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
