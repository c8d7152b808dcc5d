"""Attention over one request's rows read out of the pages, for what the paged kernels do not
give (decode-time retention, issue 18): the attention probabilities over every candidate row
of an owner, and cache-local positions.

A request's `RowContract` says how its rows are read. `positions`:
- `original`: keys are stored post-RoPE at their original positions (every other path);
- `cache_local` (StreamingLLM): keys are stored pre-RoPE and rotated at attention time to
  their slot in the owner's cache (row j of `DecodeCache.rows()` order to slot j); the query
  sits at the new row's slot, n - 1 for an owner of n rows (the new one included). Original
  positions stay what the state and the receipt name; slots are never published.
`capture`: None, or how each owner's query heads are reduced ("mean", "max", "sum") when the
step's attention probabilities over the owner's rows are captured (`StepAttention`).

Only requests whose contract asks for either pay for it: their rows are gathered from the
pages into a padded block `[s, H_owner, S, d_h]` per layer and attended with the dense
masked computation (`ragged_decode_attention_probs`), whose output replaces the paged
kernel's for those requests (the same softmax over the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model.attention import ragged_decode_attention_probs
from services.model.errors import InvalidModelInput
from services.model.layers import RotaryEmbedding, rotate

POSITIONS_ORIGINAL = "original"
POSITIONS_CACHE_LOCAL = "cache_local"
POSITION_CONTRACTS = (POSITIONS_ORIGINAL, POSITIONS_CACHE_LOCAL)
HEAD_REDUCTIONS = ("mean", "max", "sum")


@dataclass(frozen=True)
class RowContract:
    """How one request's rows are stored and read (see the module docstring)."""

    positions: str = POSITIONS_ORIGINAL
    capture: str | None = None

    def __post_init__(self) -> None:
        if self.positions not in POSITION_CONTRACTS:
            raise InvalidModelInput("positions", f"{self.positions!r} is not one of "
                                    f"{POSITION_CONTRACTS}")
        if self.capture is not None and self.capture not in HEAD_REDUCTIONS:
            raise InvalidModelInput("capture", f"{self.capture!r} is not one of {HEAD_REDUCTIONS}")

    @property
    def cache_local(self) -> bool:
        return self.positions == POSITIONS_CACHE_LOCAL

    @property
    def gathered(self) -> bool:
        """Whether this request's attention runs over its gathered rows."""
        return self.cache_local or self.capture is not None


@dataclass(frozen=True)
class StepAttention:
    """One request's attention at one decode step over every row each owner held (the step's
    own row included), reduced over the owner's query heads: `probs[l]` `[H_owner, S_l]` fp32
    in `DecodeCache.rows()` order, 0 past `lengths[l, h]` `[L, H_owner]` (and on rows a
    sliding-window layer hides)."""

    probs: tuple[torch.Tensor, ...]
    lengths: torch.Tensor

    def owner(self, layer: int, head: int) -> torch.Tensor:
        """Probabilities over one owner's rows `[n]`."""
        return self.probs[layer][head, : int(self.lengths[layer, head])]


@dataclass(frozen=True)
class GatheredRows:
    """Rows of s requests' owners of one layer, padded: keys/values `[s, H, S, d_h]` (0 past a
    length), original positions `[s, H, S]`, lengths `[s, H]`."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor


def gather_rows(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                table: torch.Tensor, lengths: torch.Tensor) -> GatheredRows:
    """Read owners' rows out of a page pool (keys/values `[N, P, d_h]`, positions `[N, P]`)
    through their page table `[s, H, W]` (host) and lengths `[s, H]` (host), in row order."""
    rows, d_h = keys.shape[1], keys.shape[2]
    span = max(int(lengths.max()), 1)
    local = torch.arange(span)
    column = (local // rows).clamp(max=table.shape[-1] - 1).expand(*table.shape[:2], -1)
    flat = (table.gather(2, column) * rows + local % rows).to(keys.device)  # [s, H, S]
    pad = (local >= lengths[..., None]).to(keys.device)  # [s, H, S]
    # Rows past a length may be another request's (even non-finite): zeroed, not just masked.
    k = keys.view(-1, d_h)[flat].masked_fill_(pad[..., None], 0)
    v = values.view(-1, d_h)[flat].masked_fill_(pad[..., None], 0)
    return GatheredRows(k, v, positions.view(-1)[flat], lengths.to(keys.device))


def attend_rows(q: torch.Tensor, rows: GatheredRows, scale: float, head_to_owner: torch.Tensor,
                hidden_at_or_before: torch.Tensor | None = None,
                cache_local: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request over its gathered rows: q `[s, H_q, d_h]` (query head i reads
    owner `head_to_owner[i]`); rows whose original position is at or before
    `hidden_at_or_before` `[s]` are hidden (sliding window); `cache_local` `[s]` bool: those
    requests' keys and queries are pre-RoPE and are rotated here to their slots (`rotary`).
    -> output `[s, H_q, d_h]`, probabilities `[s, H, G, S]` fp32."""
    keys = rows.keys
    if cache_local is not None and bool(cache_local.any()):
        assert rotary is not None  # the cache passes its own
        keys, q = _to_slots(q, rows, head_to_owner, cache_local, rotary)
    hidden = None
    if hidden_at_or_before is not None:
        hidden = rows.positions <= hidden_at_or_before[:, None, None].to(rows.positions.dtype)
    return ragged_decode_attention_probs(q, keys, rows.values, rows.lengths, scale, hidden)


def reduce_heads(probs: torch.Tensor, how: str) -> torch.Tensor:
    """An owner's query heads reduced: probs `[..., G, S]` -> `[..., S]`."""
    if how == "mean":
        return probs.mean(dim=-2)
    if how == "max":
        return probs.amax(dim=-2)
    return probs.sum(dim=-2)


def _to_slots(q: torch.Tensor, rows: GatheredRows, head_to_owner: torch.Tensor,
              cache_local: torch.Tensor, rotary: RotaryEmbedding) -> tuple[torch.Tensor, ...]:
    """Keys rotated to slots 0..S-1 and each query to its owner's newest slot, for the
    cache-local requests only."""
    s, owners, span, _ = rows.keys.shape
    slots = torch.arange(span, device=q.device).expand(s, owners, span)  # [s, H, S]
    keys = torch.where(cache_local[:, None, None, None], rotate(rows.keys, slots, rotary),
                       rows.keys)
    newest = rows.lengths[:, head_to_owner] - 1  # [s, H_q]
    q = torch.where(cache_local[:, None, None], rotate(q, newest, rotary), q)
    return keys, q
