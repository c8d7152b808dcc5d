"""Decode-time retention decisions: pure torch, no model, no I/O.

One call per decode step covers any number of owners `N` (owners of one layer, or every
(layer, owner) of a step at once): rows are padded to `R` per owner, `lengths[n]` of them real,
in ascending original position, the newest last. The per-step contract (issue 18):

    state = append(state, new_positions)     # 1. the step's row, an unpublished candidate
    attn = ...attention over the candidates   # 2. the caller's model, [N, R] probabilities
    out = step(contract, state, attn, t)     # 3-5. score, protect, select to the budget
    k, v = gather_rows(k, out.keep), ...      # 6. K, V, scores, positions: the SAME indices
    state = out.state                         # 7. commit (the caller's successor)

Nothing here is mutated in place: a caller that abandons a step before 7 keeps its old state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from services.kvpolicy.errors import SelectionError
from services.kvpolicy.retention_contract import (
    KeyformerNoise,
    PositionContract,
    RetentionContract,
    RetentionMethod,
    ScoreOwner,
)

if TYPE_CHECKING:
    from services.kvpolicy.manifest import KVVisibilityPolicyManifest

PAD_POSITION = -1
_SEED_MOD = 2**63 - 25  # a prime below 2**63: seeds stay valid int64


@dataclass(frozen=True)
class ScoreState:
    """What retention keeps next to the rows of N owners (padded to R rows each).

    positions: [N, R] int64 original positions, ascending per owner, PAD_POSITION past lengths.
    lengths: [N] int64 rows each owner holds.
    scores: [N, R] float32 accumulated score (H2O: attention, Keyformer: tempered Gumbel
        softmax), or None for methods that score nothing (window, sink_recent, scissorhands).
    low_count / low_bits: [N, R] int32 / int64 Scissorhands' steps below the threshold within
        the history window, and the window itself as bits (bit i: i steps ago); else None.
    """

    positions: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor | None = None
    low_count: torch.Tensor | None = None
    low_bits: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.positions.shape[1])

    def valid(self) -> torch.Tensor:
        """[N, R] bool: which padded entries are real rows."""
        slots = torch.arange(self.rows, device=self.positions.device)
        return slots[None, :] < self.lengths[:, None]


@dataclass(frozen=True)
class Retained:
    """One step's decision. keep: [N, K] int64 candidate-row indices per owner, ascending, the
    first `lengths[n]` real (the rest repeat index 0); dropped: [N, R] bool over the candidate
    rows (what `DecodeCache.drop_rows` takes, owner by owner); state: the successor, gathered
    with `keep`."""

    keep: torch.Tensor
    lengths: torch.Tensor
    dropped: torch.Tensor
    state: ScoreState


def state_bytes_per_row(contract: RetentionContract) -> int:
    """Bytes of score state one retained row carries (positions included)."""
    if contract.method is RetentionMethod.SCISSORHANDS:
        return 8 + 4 + 8
    return 8 + (4 if contract.method.scores else 0)


def new_state(contract: RetentionContract, positions: torch.Tensor,
              lengths: torch.Tensor) -> ScoreState:
    """The state of rows admitted from a prompt view: no evidence yet (zero scores)."""
    _check_positions(positions, lengths)
    return _with_score_fields(contract, positions, lengths)


def append(contract: RetentionContract, state: ScoreState,
           new_positions: torch.Tensor) -> ScoreState:
    """Step 1: one candidate row per owner at slot `lengths[n]` (R grows by one if needed),
    with no score yet. `new_positions`: [N] int64."""
    n = state.lengths.shape[0]
    if tuple(new_positions.shape) != (n,):
        raise SelectionError("new_positions", f"need one position per owner ({n})")
    width = max(state.rows, int(state.lengths.max()) + 1 if n else 1)
    grown = _pad_to(state, width)
    positions = grown.positions.clone()
    positions.scatter_(1, state.lengths[:, None], new_positions.to(torch.int64)[:, None])
    return replace(grown, positions=positions, lengths=state.lengths + 1)


def step(contract: RetentionContract, state: ScoreState, attn: torch.Tensor | None,
         step_index: int, stream: int = 0) -> Retained:
    """Steps 3-6 over the candidate rows of `state` (after `append`).

    attn: [N, R] attention probabilities of the step's query over each owner's candidate rows
    (reduced over the owner's query heads per `contract.score_owner`, see
    `reduce_query_heads`); None for the positional methods. step_index: the decode step
    (Keyformer's temperature); stream: which noise stream (e.g. the layer) Keyformer draws.
    """
    if contract.method.scores:
        if attn is None or tuple(attn.shape) != tuple(state.positions.shape):
            raise SelectionError("attn", f"need [N, R] = {list(state.positions.shape)}")
        state = _update(contract, state, attn.to(torch.float32), step_index, stream)
    keep_mask = _select(contract, state)
    keep, lengths = _indices(keep_mask)
    return Retained(keep, lengths, state.valid() & ~keep_mask, gather_state(state, keep, lengths))


def key_positions(contract: RetentionContract, state: ScoreState) -> torch.Tensor:
    """[N, R] int64: the position each row's key is rotated at when attended: its original
    position, or under cache-local positions its slot (rank among the owner's rows, the
    newest row's slot being the query's); PAD_POSITION past lengths."""
    if contract.positions is PositionContract.ORIGINAL:
        return state.positions
    slots = torch.arange(state.rows, device=state.positions.device).expand_as(state.positions)
    return torch.where(state.valid(), slots, torch.full_like(slots, PAD_POSITION))


def reduce_query_heads(probs: torch.Tensor, group: int, owner: ScoreOwner) -> torch.Tensor:
    """[..., H_q, R] query-head attention to [..., H_owner, R] owner scores: the mean or max
    over each K/V head's `group` contiguous query heads, or unchanged (owners = query heads)."""
    if owner is ScoreOwner.QUERY_HEAD:
        return probs
    grouped = probs.unflatten(-2, (probs.shape[-2] // group, group))
    return grouped.mean(-2) if owner is ScoreOwner.KV_HEAD_MEAN else grouped.amax(-2)


def gather_rows(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[N, R, ...] per-owner rows (K, V, anything indexed like the candidates) to [N, K, ...]:
    the one gather every consumer of `Retained.keep` uses."""
    index = keep.reshape(*keep.shape, *([1] * (rows.dim() - 2))).expand(
        *keep.shape, *rows.shape[2:])
    return torch.gather(rows, 1, index)


def gather_state(state: ScoreState, keep: torch.Tensor, lengths: torch.Tensor) -> ScoreState:
    """Step 6 for the score state: every field gathered with `keep`, padding reset."""
    valid = torch.arange(keep.shape[1], device=keep.device)[None, :] < lengths[:, None]

    def pick(values: torch.Tensor | None, pad: int | float) -> torch.Tensor | None:
        if values is None:
            return None
        return torch.where(valid, gather_rows(values, keep), torch.full_like(keep, pad,
                                                                            dtype=values.dtype))

    positions = pick(state.positions, PAD_POSITION)
    assert positions is not None
    return ScoreState(positions, lengths, pick(state.scores, 0.0), pick(state.low_count, 0),
                      pick(state.low_bits, 0))


def _check_positions(positions: torch.Tensor, lengths: torch.Tensor) -> None:
    if positions.dim() != 2 or positions.dtype != torch.int64:
        raise SelectionError("positions", "need [N, R] int64 original positions")
    if lengths.dim() != 1 or lengths.shape[0] != positions.shape[0]:
        raise SelectionError("lengths", "need one length per owner")
    if bool((lengths < 0).any()) or bool((lengths > positions.shape[1]).any()):
        raise SelectionError("lengths", f"each in [0, {positions.shape[1]}]")


def _with_score_fields(contract: RetentionContract, positions: torch.Tensor,
                       lengths: torch.Tensor) -> ScoreState:
    zeros = torch.zeros(positions.shape, device=positions.device)
    method = contract.method
    if method is RetentionMethod.SCISSORHANDS:
        return ScoreState(positions, lengths, None, zeros.to(torch.int32), zeros.to(torch.int64))
    return ScoreState(positions, lengths, zeros if method.scores else None)


def _pad_to(state: ScoreState, width: int) -> ScoreState:
    extra = width - state.rows
    if extra <= 0:
        return state

    def pad(values: torch.Tensor | None, fill: int | float) -> torch.Tensor | None:
        return None if values is None else torch.nn.functional.pad(values, (0, extra),
                                                                   value=fill)

    positions = pad(state.positions, PAD_POSITION)
    assert positions is not None
    return ScoreState(positions, state.lengths, pad(state.scores, 0.0),
                      pad(state.low_count, 0), pad(state.low_bits, 0))


def _update(contract: RetentionContract, state: ScoreState, attn: torch.Tensor,
            step_index: int, stream: int) -> ScoreState:
    """Step 3: fold this step's attention into the method's score state (real rows only)."""
    valid = state.valid()
    attn = torch.where(valid, attn, torch.zeros_like(attn))
    if contract.method is RetentionMethod.SCISSORHANDS:
        return _update_scissorhands(contract, state, attn, valid)
    assert state.scores is not None
    if contract.method is RetentionMethod.KEYFORMER:
        attn = _keyformer_scores(contract, attn, valid, step_index, stream)
    return replace(state, scores=state.scores + attn)


def _update_scissorhands(contract: RetentionContract, state: ScoreState, attn: torch.Tensor,
                         valid: torch.Tensor) -> ScoreState:
    params = contract.scissorhands
    assert params is not None and state.low_bits is not None and state.low_count is not None
    if params.threshold is None:  # 1/t: below what uniform attention over t rows would give
        threshold = 1.0 / state.lengths.clamp_min(1).to(torch.float32)[:, None]
    else:
        threshold = torch.full_like(attn[:, :1], params.threshold)
    low = ((attn < threshold) & valid).to(torch.int64)
    window = params.history_window
    leaving = (state.low_bits >> (window - 1)) & 1  # the step that falls out of the window
    bits = ((state.low_bits << 1) | low) & ((1 << window) - 1)
    count = state.low_count + (low - leaving).to(torch.int32)
    return replace(state, low_bits=bits, low_count=count)


def _keyformer_scores(contract: RetentionContract, attn: torch.Tensor, valid: torch.Tensor,
                      step_index: int, stream: int) -> torch.Tensor:
    """softmax((log p + g) / tau) over each owner's real rows: log p is the logit up to a
    per-owner constant, which the softmax ignores."""
    params = contract.keyformer
    assert params is not None
    logits = attn.clamp_min(torch.finfo(torch.float32).tiny).log()
    if params.noise is KeyformerNoise.GUMBEL:
        logits = logits + _gumbel(attn.shape, params.noise_seed, stream, step_index).to(
            attn.device)
    logits = torch.where(valid, logits / params.temperature(step_index),
                         torch.full_like(logits, -torch.inf))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def _gumbel(shape: torch.Size, seed: int, stream: int, step_index: int) -> torch.Tensor:
    """Declared randomness: the same (seed, stream, step) give the same noise on any device."""
    mixed = ((seed * 1_000_003 + stream) * 1_000_033 + step_index) % _SEED_MOD
    generator = torch.Generator().manual_seed(mixed)
    uniform = torch.rand(shape, generator=generator).clamp(1e-20, 1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def _select(contract: RetentionContract, state: ScoreState) -> torch.Tensor:
    """Steps 4-5: [N, R] bool keep mask. The protected partition (first `sinks`, newest
    `recent_window` real rows) always stays; the rest of the budget goes to the best-ranked
    historical rows."""
    valid = state.valid()
    slots = torch.arange(state.rows, device=valid.device)[None, :]
    lengths = state.lengths[:, None]
    protected = valid & ((slots < contract.sinks) | (slots >= lengths - contract.recent_window))
    target = _target(contract, state.lengths)[:, None]
    if not contract.method.scores:
        return torch.where(lengths > target, protected, valid)
    rank_key = _rank_key(contract, state, slots)
    big = torch.iinfo(torch.int64).max // 4
    rank_key = torch.where(protected, torch.full_like(rank_key, big), rank_key)
    rank_key = torch.where(valid, rank_key, torch.full_like(rank_key, -big))
    order = torch.sort(rank_key, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(1, order, slots.expand_as(order).contiguous())
    return valid & (ranks < target)


def _target(contract: RetentionContract, lengths: torch.Tensor) -> torch.Tensor:
    """[N] rows each owner keeps: all if within budget, else the budget (Scissorhands: a
    whole drop batch, or more if the owner is further over)."""
    budget = contract.budget_rows
    if contract.scissorhands is None:
        return lengths.clamp_max(budget)
    drop = (lengths - budget).clamp_min(contract.scissorhands.drop_batch)
    return torch.where(lengths > budget, lengths - drop, lengths)


def _rank_key(contract: RetentionContract, state: ScoreState, slots: torch.Tensor
              ) -> torch.Tensor:
    """[N, R] int64, larger = kept first. H2O / Keyformer: the accumulated score, equal scores
    keep the older row (a stable sort on the score order-preserving int view). Scissorhands:
    fewer low-attention steps first, equal counts keep the newer row (the older drops)."""
    if contract.method is RetentionMethod.SCISSORHANDS:
        assert state.low_count is not None
        return -state.low_count.to(torch.int64) * (state.rows + 1) + slots
    assert state.scores is not None
    # Non-negative float32 scores order like their bit patterns read as integers.
    return state.scores.clamp_min(0.0).view(torch.int32).to(torch.int64)


def _indices(keep_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, R] bool to ([N, K] ascending indices, padded with 0; [N] counts)."""
    lengths = keep_mask.sum(1)
    width = int(lengths.max()) if lengths.numel() else 0
    slots = torch.arange(keep_mask.shape[1], device=keep_mask.device)
    # Kept slots sort before dropped ones, each group in slot order.
    key = torch.where(keep_mask, slots, slots + keep_mask.shape[1])
    order = torch.sort(key, dim=1).indices[:, :width]
    valid = torch.arange(width, device=keep_mask.device)[None, :] < lengths[:, None]
    return torch.where(valid, order, torch.zeros_like(order)), lengths


def retention_of(manifest: KVVisibilityPolicyManifest) -> RetentionContract | None:
    """The manifest's decode-time retention contract, or None (decode only appends)."""
    return manifest.selection.retention
