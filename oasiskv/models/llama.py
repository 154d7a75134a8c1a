"""One Llama-family decoder for Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Parameter names equal transformers' so checkpoints load by name. The model knows nothing about
paging or sparsity: `Attention` reads those from the step context.
"""

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.layers.attention import Attention
from oasiskv.layers.linear import Linear
from oasiskv.layers.norm import RMSNorm
from oasiskv.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(h, hkv, d, scale=d**-0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]  # x [N, D]; rope: the pass's cos/sin rows (RotaryEmbedding.tables)
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rope, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
