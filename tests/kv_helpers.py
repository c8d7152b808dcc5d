"""Test helpers shared across the tree (imported by basename; tests/conftest.py puts this
folder on sys.path): K/V tensors whose every value names its own coordinates."""

from __future__ import annotations

import torch


def symbolic_kv(
    layers: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """K[l,h,t,c] = 1000 l + 100 h + 10 t + c and V = 5000 + K.  # [L, H_kv, T, d_h] each"""
    l = torch.arange(layers).view(-1, 1, 1, 1)  # noqa: E741 - the formula's own name
    h = torch.arange(heads).view(1, -1, 1, 1)
    t = torch.arange(tokens).view(1, 1, -1, 1)
    c = torch.arange(head_dim).view(1, 1, 1, -1)
    k = (1000 * l + 100 * h + 10 * t + c).to(dtype)
    return k, (5000 + k).to(dtype)
