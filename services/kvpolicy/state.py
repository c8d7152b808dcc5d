"""KVPolicyState: one immutable snapshot of what a request's decode worker may see.

A published state is never edited: compression, recall and the end of a request each
produce a successor with `state_generation = parent + 1`. Positions are absolute token
positions in `[position_origin, position_origin + frontier)`, where the frontier is the
exclusive committed frontier (number of committed tokens).
"""

from __future__ import annotations

import bisect
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from services.kvpolicy.errors import StateInvalid

PositionGrid = tuple[tuple[tuple[int, ...], ...], ...]  # [L][H_owner] -> ascending positions
BudgetGrid = tuple[tuple[int, ...], ...]  # [L][H_owner]

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class KVPolicyState:
    """Generations, frontier and the retained positions of every (layer, owner).

    `owner_budgets[l][h]`, when given, bounds how many positions owner h of layer l may
    retain (protected rows included): the compression core always gives it (the owner's row
    capacity, `services.kvpolicy.compress.owner_capacities`), and a receipt of a view binds
    it. Protected positions that lie inside the frontier must be retained by every owner.
    Lists are accepted and frozen into tuples.
    """

    request_id: str
    manifest_sha256: str
    request_generation: int
    state_generation: int
    parent_state_generation: int
    cache_generation: int
    frontier: int
    selected_positions: PositionGrid
    protected_positions: tuple[int, ...] = ()
    position_origin: int = 0
    owner_budgets: BudgetGrid | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "selected_positions", _freeze_grid(self.selected_positions, "selected_positions")
        )
        object.__setattr__(
            self,
            "protected_positions",
            _freeze_ints(self.protected_positions, "protected_positions"),
        )
        if self.owner_budgets is not None:
            object.__setattr__(self, "owner_budgets", _freeze_budgets(self.owner_budgets))
        self._check_identity()
        self._check_positions()

    @property
    def num_layers(self) -> int:
        return len(self.selected_positions)

    @property
    def num_owners(self) -> int:
        return len(self.selected_positions[0])

    @property
    def retained_rows(self) -> int:
        return sum(len(owner) for layer in self.selected_positions for owner in layer)

    @property
    def end(self) -> int:
        """Exclusive end of the visible position range: origin + frontier."""
        return self.position_origin + self.frontier

    def successor(
        self,
        *,
        selected_positions: Sequence[Sequence[Sequence[int]]],
        frontier: int,
        cache_generation: int,
        protected_positions: Sequence[int] | None = None,
        owner_budgets: Sequence[Sequence[int]] | None = None,
    ) -> KVPolicyState:
        """The next snapshot (state generation + 1). Frontier and cache generation never go back."""
        if frontier < self.frontier:
            raise StateInvalid(
                "frontier", f"successor frontier {frontier} < parent frontier {self.frontier}"
            )
        if cache_generation < self.cache_generation:
            raise StateInvalid(
                "cache_generation",
                f"successor cache generation {cache_generation} < parent {self.cache_generation}",
            )
        protected = self.protected_positions if protected_positions is None else protected_positions
        return replace(
            self,
            state_generation=self.state_generation + 1,
            parent_state_generation=self.state_generation,
            cache_generation=cache_generation,
            frontier=frontier,
            selected_positions=_freeze_grid(selected_positions, "selected_positions"),
            protected_positions=_freeze_ints(protected, "protected_positions"),
            owner_budgets=None if owner_budgets is None else _freeze_budgets(owner_budgets),
        )

    def _check_identity(self) -> None:
        if not self.request_id:
            raise StateInvalid("request_id", "must not be empty")
        if not _HEX64.match(self.manifest_sha256):
            raise StateInvalid("manifest_sha256", "must be 64 lowercase hex characters")
        if self.request_generation < 1:
            raise StateInvalid("request_generation", f"must be >= 1, got {self.request_generation}")
        if self.parent_state_generation < 0:
            raise StateInvalid(
                "parent_state_generation", f"must be >= 0, got {self.parent_state_generation}"
            )
        if self.state_generation != self.parent_state_generation + 1:
            raise StateInvalid(
                "state_generation",
                f"{self.state_generation} is not parent_state_generation + 1 ="
                f" {self.parent_state_generation + 1}",
            )
        for name in ("cache_generation", "frontier", "position_origin"):
            if getattr(self, name) < 0:
                raise StateInvalid(name, f"must be >= 0, got {getattr(self, name)}")

    def _check_positions(self) -> None:
        grid = self.selected_positions
        if not grid or not grid[0]:
            raise StateInvalid("selected_positions", "needs at least one layer and one owner")
        for layer, owners in enumerate(grid):
            if len(owners) != len(grid[0]):
                raise StateInvalid(
                    f"selected_positions[{layer}]",
                    f"{len(owners)} owners, layer 0 has {len(grid[0])}",
                )
        _check_ascending(
            self.protected_positions, "protected_positions", self.position_origin, None
        )
        inside = [p for p in self.protected_positions if p < self.end]
        for layer, owners in enumerate(grid):
            for owner, positions in enumerate(owners):
                path = f"selected_positions[{layer}][{owner}]"
                _check_ascending(positions, path, self.position_origin, self.end)
                missing = _missing(inside, positions)
                if missing:
                    raise StateInvalid(
                        path, f"protected_positions {missing} inside the frontier are not retained"
                    )
        self._check_budgets()

    def _check_budgets(self) -> None:
        if self.owner_budgets is None:
            return
        if not budgets_match_shape(self.owner_budgets, self.selected_positions):
            raise StateInvalid("owner_budgets", "shape differs from selected_positions")
        over = first_over_budget(self.selected_positions, self.owner_budgets)
        if over is not None:
            layer, owner = over
            retained = len(self.selected_positions[layer][owner])
            raise StateInvalid(
                f"selected_positions[{layer}][{owner}]",
                f"{retained} positions exceed owner_budgets[{layer}][{owner}] ="
                f" {self.owner_budgets[layer][owner]}",
            )


def budgets_match_shape(budgets: BudgetGrid, grid: PositionGrid) -> bool:
    """Whether `budgets` has one entry per (layer, owner) of `grid`."""
    return len(budgets) == len(grid) and all(
        len(b) == len(g) for b, g in zip(budgets, grid, strict=True)
    )


def first_over_budget(grid: PositionGrid, budgets: BudgetGrid) -> tuple[int, int] | None:
    """The first (layer, owner) retaining more positions than its budget, or None. The one
    budget rule: the state, the receipt and the decode worker's recomputation all apply it."""
    for layer, (layer_budgets, owners) in enumerate(zip(budgets, grid, strict=True)):
        for owner, (budget, positions) in enumerate(zip(layer_budgets, owners, strict=True)):
            if len(positions) > budget:
                return layer, owner
    return None


def _missing(required: Sequence[int], positions: tuple[int, ...]) -> list[int]:
    """Which of `required` the ascending `positions` lack, ascending (a binary search each:
    a handful of protected positions against thousands of retained ones)."""
    absent = set()
    for p in required:
        at = bisect.bisect_left(positions, p)
        if at == len(positions) or positions[at] != p:
            absent.add(p)
    return sorted(absent)


def _check_ascending(positions: tuple[int, ...], path: str, lo: int, hi: int | None) -> None:
    if all(map(operator.lt, positions, positions[1:])):  # the common case, at C speed
        _check_bounds(positions, path, lo, hi)
        return
    for previous, p in zip(positions, positions[1:], strict=False):
        if p == previous:
            raise StateInvalid(path, f"duplicate position {p}")
        if p < previous:
            raise StateInvalid(path, f"positions not sorted: {p} after {previous}")


def _check_bounds(positions: tuple[int, ...], path: str, lo: int, hi: int | None) -> None:
    if positions and positions[0] < lo:
        raise StateInvalid(path, f"position {positions[0]} before the position_origin {lo}")
    if positions and hi is not None and positions[-1] >= hi:
        raise StateInvalid(
            path, f"position {positions[-1]} at or beyond position_origin + frontier = {hi}"
        )


def _freeze_ints(values: Sequence[int], path: str) -> tuple[int, ...]:
    if isinstance(values, str | bytes):
        raise StateInvalid(path, "expected a sequence of ints")
    out = tuple(values)
    if set(map(type, out)) <= {int}:  # the common case, at C speed
        return out
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int):
            raise StateInvalid(path, f"{v!r} is not an int")
    return out


def _freeze_grid(grid: Sequence[Sequence[Sequence[int]]], path: str) -> PositionGrid:
    return tuple(
        tuple(_freeze_ints(owner, f"{path}[{layer}][{h}]") for h, owner in enumerate(owners))
        for layer, owners in enumerate(grid)
    )


def _freeze_budgets(budgets: Sequence[Sequence[int]]) -> BudgetGrid:
    frozen = tuple(_freeze_ints(layer, "owner_budgets") for layer in budgets)
    if any(b < 0 for layer in frozen for b in layer):
        raise StateInvalid("owner_budgets", "budgets must be non-negative")
    return frozen
