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
from services.kvpolicy.state import KVPolicyState
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
    decoded = list(range(parent.end, parent.position_origin + frontier))
    selected = [
        [
            _merge_positions(visible, recalled[layer][owner], parent, f"recalled[{layer}][{owner}]")
            + decoded
            for owner, visible in enumerate(owners)
        ]
        for layer, owners in enumerate(parent.selected_positions)
    ]
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


def _merge_positions(
    visible: Sequence[int], recalled: Sequence[int], parent: KVPolicyState, field: str
) -> list[int]:
    if not recalled:  # most owners recall nothing: the parent's set is already checked
        return list(visible)
    added = sorted(recalled)
    if added[0] < parent.position_origin or added[-1] >= parent.end:
        raise RecallMergeInvalid(
            field, f"positions must lie in [{parent.position_origin}, {parent.end})"
        )
    merged = sorted([*visible, *added])
    for previous, position in zip(merged, merged[1:], strict=False):
        if previous == position:
            raise RecallMergeInvalid(field, f"position {position} is already visible")
    return merged
