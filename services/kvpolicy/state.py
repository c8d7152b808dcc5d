"""KVPolicyState: one immutable snapshot of what a request's decode worker may see.

A published state is never edited: compression, recall and the end of a request each
produce a successor with `state_generation = parent + 1`. Positions are absolute token
positions in `[position_origin, position_origin + frontier)`, where the frontier is the
exclusive committed frontier (number of committed tokens).
"""

from __future__ import annotations

import array
import bisect
import hashlib
import itertools
import operator
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, overload

import torch

from services.kvpolicy.errors import StateInvalid

NestedPositions = tuple[tuple[tuple[int, ...], ...], ...]  # [L][H_owner] -> ascending positions
BudgetGrid = tuple[tuple[int, ...], ...]  # [L][H_owner]


class PositionGrid(Sequence[tuple[tuple[int, ...], ...]]):
    """The retained positions of every (layer, owner), `[L][H_owner] -> ascending positions`,
    held as tensors: `flat` int64 `[R]` (every owner's positions back to back, layer-major)
    and `counts` int64 `[L, H_owner]`. Immutable (both tensors are private copies, never
    handed out writable). It reads as the nested tuples it stands for (`grid[l][h]`, `len`,
    iteration, equality with nested sequences), built once on first such use; the hot paths
    (selection, packing, receipts, state checks) use the tensors and never build Python ints.

    `PositionGrid.of(...)` takes a grid, nested sequences of ints (checked to be ints, naming
    the first that is not) or `(flat, counts)` tensors; `KVPolicyState` checks the values."""

    __slots__ = ("_flat", "_counts", "_nested", "_offsets")

    def __init__(self, flat: torch.Tensor, counts: torch.Tensor) -> None:
        if flat.dim() != 1 or counts.dim() != 2:
            raise StateInvalid("selected_positions", "expected flat [R] and counts [L, H] tensors")
        if flat.dtype != torch.long or counts.dtype != torch.long:
            raise StateInvalid("selected_positions", "flat and counts must be int64 tensors")
        if bool((counts < 0).any()) or int(counts.sum()) != int(flat.shape[0]):
            raise StateInvalid("selected_positions", "counts do not partition the positions")
        self._flat = flat.detach().cpu().contiguous()
        self._counts = counts.detach().cpu().contiguous()
        self._nested: NestedPositions | None = None
        self._offsets: list[int] | None = None

    @classmethod
    def of(cls, grid: Any, path: str = "selected_positions") -> PositionGrid:
        if isinstance(grid, PositionGrid):
            return grid
        if isinstance(grid, str | bytes):
            raise StateInvalid(path, "expected [L][H_owner] sequences of ints")
        nested = tuple(
            tuple(_freeze_ints(owner, f"{path}[{layer}][{h}]") for h, owner in enumerate(owners))
            for layer, owners in enumerate(grid)
        )
        if not nested or not nested[0]:
            raise StateInvalid(path, "needs at least one layer and one owner")
        for layer, owners in enumerate(nested):
            if len(owners) != len(nested[0]):
                raise StateInvalid(
                    f"{path}[{layer}]", f"{len(owners)} owners, layer 0 has {len(nested[0])}"
                )
        counts = torch.tensor([[len(o) for o in owners] for owners in nested], dtype=torch.long)
        flat = _int64_tensor(list(itertools.chain.from_iterable(itertools.chain(*nested))), path)
        made = cls(flat, counts)
        made._nested = nested
        return made

    @property
    def flat(self) -> torch.Tensor:
        """Every owner's positions back to back `[R]` int64 (a read-only view: do not write)."""
        return self._flat

    @property
    def counts(self) -> torch.Tensor:
        """Positions per owner `[L, H_owner]` int64."""
        return self._counts

    @property
    def num_layers(self) -> int:
        return int(self._counts.shape[0])

    @property
    def num_owners(self) -> int:
        return int(self._counts.shape[1])

    @property
    def total(self) -> int:
        return int(self._flat.shape[0])

    def owner(self, layer: int, owner: int) -> torch.Tensor:
        """One owner's positions `[n]` int64 (a view of `flat`)."""
        offsets = self.offsets()
        at = layer * self.num_owners + owner
        return self._flat[offsets[at] : offsets[at + 1]]

    def offsets(self) -> list[int]:
        """Start of every owner's positions in `flat`, `[L * H_owner + 1]`."""
        if self._offsets is None:
            self._offsets = [0, *itertools.accumulate(self._counts.reshape(-1).tolist())]
        return self._offsets

    def nested(self) -> NestedPositions:
        """The nested tuples `[L][H_owner] -> positions` (built once)."""
        if self._nested is None:
            values = self._flat.tolist()
            offsets = self.offsets()
            width = self.num_owners
            self._nested = tuple(
                tuple(
                    tuple(values[offsets[layer * width + h] : offsets[layer * width + h + 1]])
                    for h in range(width)
                )
                for layer in range(self.num_layers)
            )
        return self._nested

    def digest(self) -> str:
        """SHA-256 hex of the grid's canonical bytes: counts then positions, int64 little
        endian (what a receipt binds instead of the positions' text)."""
        hasher = hashlib.sha256()
        hasher.update(_le_bytes(self._counts))
        hasher.update(_le_bytes(self._flat))
        return hasher.hexdigest()

    def __len__(self) -> int:
        return self.num_layers

    @overload
    def __getitem__(self, index: int) -> tuple[tuple[int, ...], ...]: ...

    @overload
    def __getitem__(self, index: slice) -> NestedPositions: ...

    def __getitem__(self, index: int | slice) -> Any:
        return self.nested()[index]

    def __iter__(self) -> Iterator[tuple[tuple[int, ...], ...]]:
        return iter(self.nested())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PositionGrid):
            return torch.equal(self._counts, other._counts) and torch.equal(self._flat, other._flat)
        if isinstance(other, tuple | list):
            try:
                return self.nested() == tuple(tuple(tuple(o) for o in owners) for owners in other)
            except TypeError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        return f"PositionGrid({self.num_layers}x{self.num_owners}, {self.total} positions)"


def _le_bytes(tensor: torch.Tensor) -> bytes:
    values = tensor.reshape(-1).numpy()
    return values.astype("<i8", copy=False).tobytes()


def _int64_tensor(flat: list[int], path: str) -> torch.Tensor:
    """`flat` as int64 `[n]` through a C array (twice as fast as torch.tensor on a list)."""
    if not flat:
        return torch.zeros(0, dtype=torch.long)
    try:
        return torch.frombuffer(array.array("q", flat), dtype=torch.long)
    except OverflowError as error:
        raise StateInvalid(path, "a position does not fit in int64") from error

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class KVPolicyState:
    """Generations, frontier and the retained positions of every (layer, owner).

    `owner_budgets[l][h]`, when given, bounds how many positions owner h of layer l may
    retain (protected rows included): the compression core always gives it (the owner's row
    capacity, `services.kvpolicy.compress.owner_capacities`), and a receipt of a view binds
    it. Protected positions that lie inside the frontier must be retained by every owner.
    Nested sequences of ints are accepted and frozen into a `PositionGrid`; every check runs
    on its tensors (the message of a failing one names the first (layer, owner) that fails).
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
            self, "selected_positions", PositionGrid.of(self.selected_positions)
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
        return self.selected_positions.num_layers

    @property
    def num_owners(self) -> int:
        return self.selected_positions.num_owners

    @property
    def retained_rows(self) -> int:
        return self.selected_positions.total

    @property
    def end(self) -> int:
        """Exclusive end of the visible position range: origin + frontier."""
        return self.position_origin + self.frontier

    def successor(
        self,
        *,
        selected_positions: PositionGrid | Sequence[Sequence[Sequence[int]]],
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
            selected_positions=PositionGrid.of(selected_positions),
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
        if grid.num_layers == 0 or grid.num_owners == 0:
            raise StateInvalid("selected_positions", "needs at least one layer and one owner")
        _check_ascending(
            self.protected_positions, "protected_positions", self.position_origin, None
        )
        inside = [p for p in self.protected_positions if p < self.end]
        if not _grid_sound(grid, self.position_origin, self.end, inside):
            self._name_unsound(grid, inside)
        self._check_budgets()

    def _name_unsound(self, grid: PositionGrid, inside: list[int]) -> None:
        """The first (layer, owner) whose positions fail, and how (the slow way, once)."""
        for layer, owners in enumerate(grid):
            for owner, positions in enumerate(owners):
                path = f"selected_positions[{layer}][{owner}]"
                _check_ascending(positions, path, self.position_origin, self.end)
                missing = _missing(inside, positions)
                if missing:
                    raise StateInvalid(
                        path, f"protected_positions {missing} inside the frontier are not retained"
                    )

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
    return len(budgets) == grid.num_layers and all(len(b) == grid.num_owners for b in budgets)


def first_over_budget(grid: PositionGrid, budgets: BudgetGrid) -> tuple[int, int] | None:
    """The first (layer, owner) retaining more positions than its budget, or None. The one
    budget rule: the state, the receipt and the decode worker's recomputation all apply it."""
    over = (grid.counts > torch.tensor(budgets, dtype=torch.long)).reshape(-1).nonzero()
    if over.numel() == 0:
        return None
    layer, owner = divmod(int(over[0]), grid.num_owners)
    return layer, owner


def _grid_sound(grid: PositionGrid, lo: int, hi: int, protected: Sequence[int]) -> bool:
    """Whether every owner's positions rise strictly inside `[lo, hi)` and include every
    `protected` position, checked on the grid's tensors at once."""
    if grid.total == 0:
        return not protected
    return _ascending_inside(grid, lo, hi) and (not protected or _retains(grid, hi, protected))


def every(mask: torch.Tensor) -> bool:
    """`bool(mask.all())` for a CPU bool mask, read as its bytes' minimum: torch's `all`
    over a bool tensor does not vectorize (about 15x slower over a 16K-token grid's steps)."""
    if mask.numel() == 0:
        return True
    if mask.device.type != "cpu" or mask.dtype != torch.bool:
        return bool(mask.all())
    return int(mask.view(torch.uint8).min()) != 0


def _ascending_inside(grid: PositionGrid, lo: int, hi: int) -> bool:
    flat = grid.flat
    if int(flat.min()) < lo or int(flat.max()) >= hi:
        return False
    steps = flat[1:] > flat[:-1]  # [R - 1] bool
    restarts = [s - 1 for s in grid.offsets()[1:-1] if 0 < s < grid.total]
    if restarts:
        steps[torch.tensor(restarts, dtype=torch.long)] = True  # a segment restarts anywhere
    return every(steps)


def _retains(grid: PositionGrid, hi: int, protected: Sequence[int]) -> bool:
    """Whether every owner retains every `protected` position (its positions ascending inside
    `[0, hi)`). Each (owner, position) pair is a key `owner * (hi + 1) + position`: the keys of
    the retained positions are globally ascending, so one searchsorted finds them all."""
    span = hi + 1
    segments = torch.arange(grid.num_layers * grid.num_owners, dtype=torch.long) * span  # [S]
    keys = torch.repeat_interleave(segments, grid.counts.reshape(-1))  # [R]
    keys += grid.flat
    wanted = segments[:, None] + torch.tensor(protected, dtype=torch.long)[None, :]  # [S, P]
    at = torch.searchsorted(keys, wanted).clamp_(max=grid.total - 1)
    return bool(torch.equal(keys[at], wanted))


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


def _freeze_budgets(budgets: Sequence[Sequence[int]]) -> BudgetGrid:
    frozen = tuple(_freeze_ints(layer, "owner_budgets") for layer in budgets)
    if any(b < 0 for layer in frozen for b in layer):
        raise StateInvalid("owner_budgets", "budgets must be non-negative")
    return frozen
