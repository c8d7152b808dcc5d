"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3). Parameter names follow the HF
checkpoints (`model.layers.{i}.self_attn.q_proj.weight`, ...) so weights load by name.

The model never owns a KV cache: each layer receives an `Attend` callable from the runtime
(chunked prefill or ragged decode), which stores keys/values wherever that stage keeps them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from services.model.attention import Attend, SelfAttention
from services.model.config import ModelConfig
from services.model.layers import GatedMLP, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """x `[N, D]` -> `[N, D]`."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """Embedding, decoder layers and final norm (the HF `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def blocks(self) -> list[DecoderLayer]:
        """The decoder layers, typed (nn.ModuleList yields plain Modules)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` runs every layer on N tokens with per-layer attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.scale = config.head_dim**-0.5

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[N, d_h]` at original token positions `[N]`."""
        return self.rotary(positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Callable[[int], Attend],
    ) -> torch.Tensor:
        """input_ids, positions `[N]` -> logits `[N, V]` (fp32); attention(l) serves layer l."""
        x = self.model.embed_tokens(input_ids)  # [N, D]
        cos, sin = self.rope(positions, x.dtype)
        for index, layer in enumerate(self.model.blocks()):
            x = layer(x, cos, sin, attention(index))
        return self.logits(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: hidden `[N, D]` -> logits `[N, V]` in fp32."""
        return self.lm_head(self.model.norm(hidden)).float()
