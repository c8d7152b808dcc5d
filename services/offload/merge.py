"""Merge recalled rows into visible sets, and the successor state a recall publishes.

Recalled rows keep their original positions: merging sorts them into the owner's
visible rows by position and rejects a position that is already visible (or recalled
twice), since a page only ever holds omitted positions. A recall is a state change like
any other: `recall_successor` builds state `s + 1` from the parent `s`, with the recalled
positions (and the rows decoded since the parent) added to every owner they belong to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.kvpolicy.errors import StateInvalid
from services.kvpolicy.packing import OFFSET_DTYPE, POSITION_DTYPE, PackedKVView
from services.kvpolicy.state import KVPolicyState, PositionGrid
from services.offload.errors import RecallMergeInvalid
from services.offload.pages import RecalledPage, offsets_from_counts


class Rows(Protocol):
    """Rows at original positions: `OwnerRows` or a `RecalledPage`."""

    @property
    def k(self) -> torch.Tensor: ...  # [n, d_h]

    @property
    def v(self) -> torch.Tensor: ...  # [n, d_h]

    @property
    def positions(self) -> torch.Tensor: ...  # [n] int


@dataclass(frozen=True)
class OwnerRows:
    """The visible rows of one (layer, owner), strictly ascending by original position."""

    k: torch.Tensor  # [R, d_h]
    v: torch.Tensor  # [R, d_h]
    positions: torch.Tensor  # [R] int32

    def __post_init__(self) -> None:
        if self.k.dim() != 2 or self.v.shape != self.k.shape:
            raise RecallMergeInvalid(
                "k", f"K {tuple(self.k.shape)} and V {tuple(self.v.shape)} must be [R, d_h]"
            )
        if self.positions.dim() != 1 or self.positions.shape[0] != self.k.shape[0]:
            raise RecallMergeInvalid("positions", f"expected [{self.k.shape[0]}] positions")
        if bool((self.positions[1:] <= self.positions[:-1]).any()):
            raise RecallMergeInvalid("positions", "must be strictly ascending")


def merge_rows(visible: Rows, recalled: Sequence[Rows]) -> OwnerRows:
    """One owner's visible rows with `recalled` rows sorted in by original position."""
    parts = [visible, *recalled]
    _check_compatible(visible.k, visible.v, recalled, "recalled")
    positions = torch.cat([p.positions.long() for p in parts])  # [R + n]
    order = torch.argsort(positions, stable=True)
    ordered = positions[order]
    _reject_duplicates(ordered, ordered, "recalled")
    return OwnerRows(
        k=torch.cat([p.k for p in parts])[order],
        v=torch.cat([p.v for p in parts])[order],
        positions=ordered.to(POSITION_DTYPE),
    )


def merge_view(view: PackedKVView, pages: Sequence[RecalledPage]) -> PackedKVView:
    """The packed view with the rows of `pages` merged into their (layer, owner) segments.

    Every segment stays strictly ascending by original position; the result is a new,
    validated view (the input is not modified).
    """
    owners = view.num_kv_heads
    _check_compatible(view.packed_k, view.packed_v, pages, "pages")
    for i, page in enumerate(pages):
        if not (0 <= page.ref.layer < view.num_layers and 0 <= page.ref.owner < owners):
            raise RecallMergeInvalid(f"pages[{i}].ref", f"{page.ref} outside the view")
    counts = (view.row_offsets[:, 1:] - view.row_offsets[:, :-1]).flatten().long()  # [L * H]
    segment = torch.cat(
        [torch.repeat_interleave(torch.arange(counts.numel()), counts)]
        + [torch.full_like(p.positions, p.ref.layer * owners + p.ref.owner).long() for p in pages]
    )  # [R + n]
    positions = torch.cat(
        [view.original_position_map.long()] + [p.positions.long() for p in pages]
    )
    span = int(positions.max()) + 1 if positions.numel() else 1
    keys = segment * span + positions  # orders by (layer, owner), then position
    order = torch.argsort(keys, stable=True)
    _reject_duplicates(keys[order], positions[order], "pages")
    return PackedKVView(
        packed_k=torch.cat([view.packed_k] + [p.k for p in pages])[order],
        packed_v=torch.cat([view.packed_v] + [p.v for p in pages])[order],
        original_position_map=positions[order].to(POSITION_DTYPE),
        row_offsets=offsets_from_counts(
            torch.bincount(segment, minlength=counts.numel()), view.num_layers, owners
        ).to(OFFSET_DTYPE),
    )


def recalled_position_grid(
    pages: Sequence[RecalledPage], num_layers: int, num_owners: int, origin: int = 0
) -> list[list[list[int]]]:
    """Recalled positions per (layer, owner), ascending, shifted by the state's `origin`."""
    grid: list[list[list[int]]] = [[[] for _ in range(num_owners)] for _ in range(num_layers)]
    for i, page in enumerate(pages):
        if not (0 <= page.ref.layer < num_layers and 0 <= page.ref.owner < num_owners):
            raise RecallMergeInvalid(f"pages[{i}].ref", f"{page.ref} outside the state's grid")
        grid[page.ref.layer][page.ref.owner].extend(origin + int(p) for p in page.positions)
    return [[sorted(owner) for owner in layer] for layer in grid]


def recall_successor(
    parent: KVPolicyState,
    recalled: Sequence[Sequence[Sequence[int]]],
    *,
    cache_generation: int,
    frontier: int | None = None,
) -> KVPolicyState:
    """The state a recall publishes: `parent` + the recalled positions, generation + 1.

    `recalled[l][h]` lists the positions recalled for owner h of layer l (absolute, like
    the state's, each below the parent's end and not yet visible). `frontier` is the
    decode worker's committed frontier (default: the parent's); the positions decoded since
    the parent, `[parent.end, origin + frontier)`, are visible to every owner and join
    every set. A recall changes the cache, so `cache_generation` must exceed the parent's.
    Owner budgets, when the parent has them, grow by the rows each owner gained.
    """
    frontier = parent.frontier if frontier is None else frontier
    _check_recall_shape(parent, recalled, cache_generation)
    selected = _merged_grid(parent, recalled, parent.position_origin + frontier)
    decoded = range(parent.end, parent.position_origin + frontier)
    budgets = None
    if parent.owner_budgets is not None:
        budgets = [
            [budget + len(recalled[layer][h]) + len(decoded) for h, budget in enumerate(row)]
            for layer, row in enumerate(parent.owner_budgets)
        ]
    return parent.successor(
        selected_positions=selected,
        frontier=frontier,
        cache_generation=cache_generation,
        owner_budgets=budgets,
    )


def _check_compatible(
    k: torch.Tensor, v: torch.Tensor, recalled: Sequence[Rows], name: str
) -> None:
    """Recalled rows have the visible rows' head_dim and K/V dtypes, and one position each."""
    head_dim = k.shape[1]
    for i, part in enumerate(recalled):
        field = f"{name}[{i}]"
        if part.k.dim() != 2 or part.k.shape[1] != head_dim or part.v.shape != part.k.shape:
            raise RecallMergeInvalid(
                field, f"rows {tuple(part.k.shape)} do not match head_dim {head_dim}"
            )
        if part.k.dtype != k.dtype or part.v.dtype != v.dtype:
            raise RecallMergeInvalid(field, f"dtypes {part.k.dtype}/{part.v.dtype} differ")
        if part.positions.dim() != 1 or part.positions.shape[0] != part.k.shape[0]:
            raise RecallMergeInvalid(field, f"expected [{part.k.shape[0]}] positions")


def _reject_duplicates(sorted_keys: torch.Tensor, positions: torch.Tensor, field: str) -> None:
    repeated = sorted_keys[1:] == sorted_keys[:-1]  # [n - 1]
    if bool(repeated.any()):
        position = int(positions[1:][repeated][0])
        raise RecallMergeInvalid(field, f"position {position} is already visible")


def _check_recall_shape(
    parent: KVPolicyState, recalled: Sequence[Sequence[Sequence[int]]], cache_generation: int
) -> None:
    if len(recalled) != parent.num_layers or any(
        len(layer) != parent.num_owners for layer in recalled
    ):
        raise RecallMergeInvalid(
            "recalled", f"expected [{parent.num_layers}][{parent.num_owners}] position lists"
        )
    if not any(positions for layer in recalled for positions in layer):
        raise RecallMergeInvalid("recalled", "a recall adds at least one row")
    if cache_generation <= parent.cache_generation:
        raise StateInvalid(
            "cache_generation",
            f"a recall changes the cache: {cache_generation} must exceed {parent.cache_generation}",
        )


def _merged_grid(
    parent: KVPolicyState, recalled: Sequence[Sequence[Sequence[int]]], stop: int
) -> PositionGrid:
    """The parent's positions with `recalled[l][h]` added to each owner and every position
    of `[parent.end, stop)` (decoded since the parent) added to all, each owner ascending,
    in tensor operations over (owner, position) keys (this runs for every recall of every
    request; per-owner Python lists took 4.5 ms at 4K, a sort of the whole grid 3 ms).
    RecallMergeInvalid naming the owner when a recalled position lies outside `[origin, end)`
    or is already visible (or recalled twice)."""
    grid = parent.selected_positions
    layers, owners = parent.num_layers, parent.num_owners
    segments = torch.arange(layers * owners)
    counts = grid.counts.reshape(-1)  # [S]
    added_counts = torch.tensor([len(p) for row in recalled for p in row], dtype=torch.long)
    added = torch.tensor([int(x) for row in recalled for p in row for x in p], dtype=torch.long)
    added_segment = torch.repeat_interleave(segments, added_counts)
    outside = (added < parent.position_origin) | (added >= parent.end)
    if bool(outside.any()):
        layer, owner = divmod(int(added_segment[outside.nonzero()[0, 0]]), owners)
        raise RecallMergeInvalid(
            f"recalled[{layer}][{owner}]",
            f"positions must lie in [{parent.position_origin}, {parent.end})",
        )
    decoded = torch.arange(parent.end, max(stop, parent.end), dtype=torch.long)  # [D]
    # (owner, position) keys: the parent's are ascending already, the recalled few are
    # sorted and slotted in (no sort of the whole grid), the decoded go after each owner's.
    span = max(stop, parent.end) + 1
    visible_segment = torch.repeat_interleave(segments, counts)  # [R]
    visible = visible_segment * span + grid.flat  # [R] ascending
    recall = torch.sort(added_segment * span + added).values  # [n]
    before = torch.searchsorted(visible, recall)  # [n] visible keys below each recalled one
    seen = before < visible.numel()
    twice = torch.zeros_like(recall, dtype=torch.bool)
    twice[seen] = visible[before[seen]] == recall[seen]
    twice[1:] |= recall[1:] == recall[:-1]
    if bool(twice.any()):
        key = int(recall[twice.nonzero()[0, 0]])
        layer, owner = divmod(key // span, owners)
        raise RecallMergeInvalid(
            f"recalled[{layer}][{owner}]", f"position {key % span} is already visible"
        )
    width = decoded.numel()
    total = counts + added_counts + width  # [S]
    start = torch.cumsum(total, 0) - total  # [S] first slot of each owner
    flat = torch.empty(int(total.sum()), dtype=torch.long)
    # A visible key's slot: its index, plus the recalled keys below it, plus the decoded rows
    # of the owners before its own; a recalled key's: the visible keys below it, plus its
    # rank among the recalled, plus the same; the decoded fill each owner's last `width`.
    below = torch.searchsorted(recall, visible)
    flat[torch.arange(visible.numel()) + below + visible_segment * width] = grid.flat
    recalled_segment = recall // span
    flat[before + torch.arange(recall.numel()) + recalled_segment * width] = recall % span
    tail = (start + total - width)[:, None] + torch.arange(width)  # [S, D]
    flat[tail.flatten()] = decoded.repeat(segments.numel())
    return PositionGrid(flat, total.view(layers, owners))
