"""Self-attention: the projection module and the three attention computations the runtime
needs. Keys are stored after RoPE at their original positions, so a key row carries its
position with it and attention over any subset of rows needs no re-rotation.

- `causal_chunk_attention`: one prefill chunk of queries against all keys before it.
- `observation_attention`: the last W_obs queries' softmax rows, for SnapKV scoring.
- `ragged_decode_attention` / `varlen_decode_attention`: one new query per request over a
  padded per-(request, K/V head) cache where every head has its own length;
  `ragged_decode_attention_lse` also returns each query's log-sum-exp (for recall).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.model.config import ModelConfig
from services.model.layers import RMSNorm, apply_rotary

# attend(q [N, H_q, d_h], k [N, H_kv, d_h], v [N, H_kv, d_h]) -> [N, H_q, d_h]; N tokens are
# either one prefill chunk of one sequence or one new token per request of a decode batch.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SelfAttention(nn.Module):
    """q/k/v/o projections (+ Qwen3 per-head q/k RMSNorm); the attention itself is injected."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d_h, h_q, h_kv = config.head_dim, config.num_q_heads, config.num_kv_heads
        self.num_heads, self.head_dim = h_q, d_h
        self.q_proj = nn.Linear(config.hidden_size, h_q * d_h, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, h_kv * d_h, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, h_kv * d_h, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h_q * d_h, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(d_h, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d_h, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """x `[N, D]`, cos/sin `[N, d_h]` at each token's original position -> `[N, D]`."""
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))  # [N, H_q, d_h]
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))  # [N, H_kv, d_h]
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))  # [N, H_kv, d_h]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(q, k, v).flatten(-2))


def causal_chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Queries at positions [start, start+C) over keys at positions [0, start+C).

    q `[C, H_q, d_h]`, keys/values `[H_kv, start+C, d_h]` -> `[C, H_q, d_h]`.
    Peak score memory is C x (start+C) per head: the T x T matrix is never built.
    """
    chunk = q.shape[0]
    mask = None
    if start > 0 or window is not None:
        mask = visibility_mask(
            torch.arange(start, start + chunk, device=q.device),
            torch.arange(keys.shape[1], device=q.device),
            window,
        )  # [C, start+C]
    # 4-D inputs: torch's CPU flash kernel only takes [B, H, T, d_h]; 3-D falls back to math.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )  # [1, H_q, C, d_h]
    return out[0].transpose(0, 1)


def observation_attention(
    q_obs: torch.Tensor,
    keys: torch.Tensor,
    q_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Softmax rows of the last W_obs queries over all T keys, in fp32, causal inside the window.

    q_obs `[H_q, W_obs, d_h]`, keys `[H_kv, T, d_h]`, q_positions `[W_obs]` -> `[H_q, W_obs, T]`.
    """
    h_q, w_obs, d_h = q_obs.shape
    h_kv, length, _ = keys.shape
    grouped = q_obs.float().view(h_kv, h_q // h_kv * w_obs, d_h)  # [H_kv, G*W_obs, d_h]
    scores = torch.matmul(grouped, keys.float().transpose(1, 2)) * scale  # [H_kv, G*W_obs, T]
    scores = scores.view(h_q, w_obs, length)
    visible = visibility_mask(q_positions, torch.arange(length, device=keys.device), window)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def visibility_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """True where key position j is visible to query position i: j <= i (and i - j < window)."""
    # Compared straight into bool: an int64 [Q, K] difference would cost 8x the mask's memory.
    visible = k_positions[None, :] <= q_positions[:, None]  # [Q, K]
    if window is not None:
        visible &= k_positions[None, :] > (q_positions - window)[:, None]
    return visible


def ragged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over per-(request, K/V head) ragged rows (pad + mask).

    q `[B, H_q, d_h]`; keys/values `[B, H_kv, S, d_h]` (rows beyond a head's length are padding,
    any contents); lengths `[B, H_kv]`; hidden `[B, H_kv, S]` bool masks further rows
    (sliding window). Query head i reads K/V head i // G only. Softmax in fp32 -> `[B, H_q, d_h]`.
    """
    scores = _ragged_scores(q, keys, lengths, scale, hidden)  # [B, H_kv, G, S]
    return _ragged_output(scores, values)


def ragged_decode_attention_lse(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ragged_decode_attention` (same output, same arithmetic) plus, per request and query
    head, the log-sum-exp of the scaled logits over the rows that query sees `[B, H_q]` fp32
    (what recall bounds the omitted rows' softmax mass against)."""
    scores = _ragged_scores(q, keys, lengths, scale, hidden)  # [B, H_kv, G, S]
    lse = torch.logsumexp(scores, dim=-1).reshape(q.shape[0], -1)  # [B, H_q]
    return _ragged_output(scores, values), lse


def _ragged_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None,
) -> torch.Tensor:
    """Scaled fp32 logits, -inf on padding and hidden rows.  # [B, H_kv, G, S]"""
    batch, h_kv, span, d_h = keys.shape
    grouped = q.view(batch, h_kv, -1, d_h)  # [B, H_kv, G, d_h]
    # keys @ q^T reads the [S, d_h] rows in storage order (faster on CPU than q @ keys^T).
    scores = torch.matmul(keys, grouped.transpose(-1, -2)).transpose(-1, -2)  # [B, H_kv, G, S]
    scores = scores.float().contiguous() * scale
    masked = torch.arange(span, device=q.device) >= lengths[..., None]  # [B, H_kv, S]
    if hidden is not None:
        masked |= hidden
    return scores.masked_fill_(masked[:, :, None, :], float("-inf"))


def _ragged_output(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ values: scores `[B, H_kv, G, S]`, values `[B, H_kv, S, d_h]`."""
    batch, _, _, d_h = values.shape
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, -1, d_h)


def varlen_decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's flash-attention varlen kernel: CUDA only, half precision only."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same result as `ragged_decode_attention` via torch's varlen flash kernel (CUDA).

    Every (request, K/V head) is its own sequence of `lengths[b, h]` valid rows inside a slot of
    `capacity` rows, whose single query token carries that head's G query heads.
    q `[B, H_q, d_h]`; key_cache/value_cache `[B, H_kv, capacity, d_h]` contiguous.
    """
    from torch.nn.attention.varlen import varlen_attn

    batch, h_kv, capacity, d_h = key_cache.shape
    sequences = batch * h_kv
    steps = torch.arange(sequences + 1, device=q.device, dtype=torch.int32)
    out = varlen_attn(
        q.reshape(sequences, -1, d_h),  # [B*H_kv, G, d_h]
        key_cache.reshape(sequences * capacity, 1, d_h),
        value_cache.reshape(sequences * capacity, 1, d_h),
        steps,
        steps * capacity,
        1,
        capacity,
        scale=scale,
        enable_gqa=True,
        seqused_k=lengths.reshape(-1).to(torch.int32),
    )  # [B*H_kv, G, d_h]
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were requested
    return out.reshape(batch, -1, d_h)
