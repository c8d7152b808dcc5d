"""Llama-family building blocks: RMSNorm, rotary position embedding, gated SiLU MLP.
Arithmetic follows the HF reference so logits agree to rounding."""

from __future__ import annotations

import math

import torch
from torch import nn

from services.model.config import RopeConfig


class RMSNorm(nn.Module):
    """y = w * x / rms(x), normalized in fp32 and cast back before the weight multiply."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Per-pair rotation speeds `[d_h / 2]` (fp32), with linear or Llama-3 scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    assert rope.original_max_position_embeddings is not None
    context = rope.original_max_position_embeddings
    low_wavelen = context / rope.low_freq_factor
    high_wavelen = context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for arbitrary (original) token positions.

    The frequencies are a plain fp32 attribute, not a buffer, so that casting the model to
    bf16/fp16 never rounds them (HF keeps them in fp32 as well).
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.inv_freq = rope_inverse_frequencies(rope, head_dim)  # [d_h/2] fp32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[N]` int -> cos, sin `[N, d_h]` in `dtype` (angles computed in fp32)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [N, d_h/2]
        angles = torch.cat((angles, angles), dim=-1)  # [N, d_h]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[N, H, d_h]` by per-token cos/sin `[N, d_h]` (HF rotate-half convention)."""
    return _rotate_half(x, cos[:, None, :], sin[:, None, :])


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
    """x `[*P, ..., d_h]` (keys or queries) rotated by RoPE to `positions` `[*P]` int: each
    position covers the dims of x after its own (e.g. x `[N, H, d_h]` with positions `[N]` or
    `[N, H]`). The one RoPE helper outside the model's forward: cache-local positions
    (StreamingLLM) rotate pre-RoPE keys by their slot in the cache, and a negative position
    undoes a rotation (post-RoPE keys back to pre-RoPE, up to rounding). Same arithmetic as
    the model's own rotation: `rotate(k, p, model.rotary)` is bit-equal to what the model
    caches for a key at position p."""
    cos, sin = rotary(positions.reshape(-1), x.dtype)  # [prod(P), d_h]
    shape = (*positions.shape, *([1] * (x.dim() - positions.dim() - 1)), x.shape[-1])
    return _rotate_half(x, cos.view(shape), sin.view(shape))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
