"""Pack the retained KV rows of every (layer, owner) into one contiguous view.

A `PackedKVView` is what travels from prefill to decode: the retained K and V rows
back to back, the original token position of every packed row, and the global row
offsets of every (layer, owner) segment. Packed row r is *not* token position r;
every consumer goes through `original_position_map`.

Owners are K/V heads (the default) or, under the GQA reduction `expand`, query heads
whose rows are gathered from the K/V head they map to (storage charged at H_q).

A state is materialized only from the cache image it describes (`materialize`): the source
cache names its cache generation and position origin, its length is its frontier, and a
state that names another image is refused before anything is gathered.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from services.kvpolicy.errors import PackingError
from services.kvpolicy.state import KVPolicyState, PositionGrid, every

# Metadata dtypes are part of the wire contract (and of the byte ledger): a view with
# R_total rows carries 4 * R_total bytes of position map and 4 * L * (H+1) bytes of offsets.
POSITION_DTYPE = torch.int32
OFFSET_DTYPE = torch.int32

Selection = Sequence[Sequence[Sequence[int]]]  # [L][H_owner] -> sorted original positions


@dataclass(frozen=True)
class SourceIdentity:
    """Which cache image a view is gathered from: the positions it holds,
    `[position_origin, position_origin + length)`, at one cache generation."""

    length: int
    cache_generation: int
    position_origin: int = 0

    @property
    def end(self) -> int:
        """Exclusive end of the positions the source holds."""
        return self.position_origin + self.length


@dataclass(frozen=True)
class SourceCache:
    """A source K/V cache `[L, H_kv, T, d_h]` and the image it is: T positions from
    `position_origin`, at `cache_generation`."""

    k: torch.Tensor  # [L, H_kv, T, d_h]
    v: torch.Tensor  # [L, H_kv, T, d_h]
    cache_generation: int
    position_origin: int = 0

    def __post_init__(self) -> None:
        _check_sources(self.k, self.v)

    @property
    def identity(self) -> SourceIdentity:
        return SourceIdentity(int(self.k.shape[2]), self.cache_generation, self.position_origin)


@dataclass(frozen=True)
class PackedKVView:
    """Retained K/V rows of one request, packed per (layer, owner).

    Construction validates the whole view (see `validate_view`), so an instance is never
    half-built: rows, positions and offsets always agree.
    """

    packed_k: torch.Tensor  # [R_total, d_h]
    packed_v: torch.Tensor  # [R_total, d_h]
    original_position_map: torch.Tensor  # [R_total] int32
    row_offsets: torch.Tensor  # [L, H_owner + 1] int32, global, monotonic, last == R_total

    def __post_init__(self) -> None:
        validate_view(self)

    @property
    def num_layers(self) -> int:
        return int(self.row_offsets.shape[0])

    @property
    def num_kv_heads(self) -> int:
        """Number of owners per layer: H_kv, or H_q when owners are query heads (`expand`)."""
        return int(self.row_offsets.shape[1]) - 1

    @property
    def head_dim(self) -> int:
        return int(self.packed_k.shape[1])

    @property
    def total_rows(self) -> int:
        return int(self.packed_k.shape[0])

    @property
    def payload_bytes(self) -> int:
        """Bytes of packed K plus packed V."""
        return _nbytes(self.packed_k) + _nbytes(self.packed_v)

    @property
    def metadata_bytes(self) -> int:
        """Bytes of the position map plus the row offsets."""
        return _nbytes(self.original_position_map) + _nbytes(self.row_offsets)

    @cached_property
    def _offsets(self) -> list[list[int]]:
        return [[int(x) for x in row] for row in self.row_offsets.cpu().tolist()]

    def rows(self, layer: int, kv_head: int) -> slice:
        """Packed row range of one (layer, owner) segment."""
        if not 0 <= layer < self.num_layers:
            raise PackingError("layer", f"{layer} outside [0, {self.num_layers})")
        if not 0 <= kv_head < self.num_kv_heads:
            raise PackingError("kv_head", f"{kv_head} outside [0, {self.num_kv_heads})")
        row = self._offsets[layer]
        return slice(row[kv_head], row[kv_head + 1])

    def positions(self, layer: int, kv_head: int) -> torch.Tensor:
        """Original token positions of one segment, ascending.  # [R_lh] int32"""
        return self.original_position_map[self.rows(layer, kv_head)]

    def selected_positions(self) -> PositionGrid:
        """The retained original positions `[L][H_owner]`, read from the position map and the
        offsets as tensors (no Python ints)."""
        offsets = self.row_offsets.cpu().long()  # [L, H + 1]
        return PositionGrid(
            self.original_position_map.cpu().long(), offsets[:, 1:] - offsets[:, :-1]
        )


def materialize(
    state: KVPolicyState, source: SourceCache, owner_to_kv_head: Sequence[int] | None = None
) -> PackedKVView:
    """Gather the rows `state` retains from `source`, which must be the image the state
    describes: the same cache generation and position origin, and the state's frontier is the
    source's length. PackingError names the first field that differs (`cache_generation`,
    `position_origin`, `frontier`); nothing is gathered then."""
    identity = source.identity
    for field, claimed, actual in (
        ("cache_generation", state.cache_generation, identity.cache_generation),
        ("position_origin", state.position_origin, identity.position_origin),
        ("frontier", state.frontier, identity.length),
    ):
        if claimed != actual:
            raise PackingError(field, f"the state has {claimed}, the source cache {actual}")
    positions = state.selected_positions
    # The state checked its grid (ascending inside [origin, frontier), the source's rows),
    # so packing does not check the same positions again.
    return pack(source.k, source.v, positions, owner_to_kv_head, origin=source.position_origin,
                checked=True)


def pack(
    source_k: torch.Tensor,
    source_v: torch.Tensor,
    selected: Selection | PositionGrid,
    owner_to_kv_head: Sequence[int] | None = None,
    *,
    origin: int = 0,
    checked: bool = False,
) -> PackedKVView:
    """Gather the selected rows of `source_k`/`source_v` `[L, H_kv, T, d_h]` into a view.

    `selected[l][h]` lists the retained original positions of owner h in layer l, strictly
    ascending, inside `[origin, origin + T)` (source row p - origin holds position p). Owners
    are the K/V heads unless `owner_to_kv_head` maps each owner (a query head under GQA
    `expand`) to the K/V head its rows come from. K and V are gathered with the same indices
    (their dtypes may differ). Every input is validated before anything is gathered, and the
    result is validated again before it is returned. `checked`: a `KVPolicyState` already
    checked the grid's positions against these sources (`materialize`).
    """
    num_layers, num_kv_heads, seq_len, _ = _check_sources(source_k, source_v)
    owners = _check_owner_map(owner_to_kv_head, selected, num_layers, num_kv_heads)
    if isinstance(selected, PositionGrid):
        counts = selected.counts.reshape(-1).tolist()  # [L * H_owner]
        positions = (selected.flat if checked
                     else _grid_positions(selected, counts, origin, origin + seq_len))
    else:
        segments = [
            selected[layer][owner] for layer in range(num_layers) for owner in range(len(owners))
        ]
        counts = [len(segment) for segment in segments]
        positions = _segment_positions(segments, counts, origin, origin + seq_len, len(owners))
    position_map = positions.to(POSITION_DTYPE)
    rows = positions if origin == 0 else positions - origin  # source rows of each segment
    rows = rows.to(source_k.device)
    del positions
    starts = [0, *itertools.accumulate(counts)]
    width = len(owners)
    offsets = [starts[layer * width : (layer + 1) * width + 1] for layer in range(num_layers)]
    sources = [layer * num_kv_heads + owners[owner]
               for layer in range(num_layers) for owner in range(width)]
    return PackedKVView(
        packed_k=_gather(source_k, rows, starts, sources),
        packed_v=_gather(source_v, rows, starts, sources),
        original_position_map=position_map,
        row_offsets=torch.tensor(offsets, dtype=OFFSET_DTYPE),
    )


def _grid_positions(grid: PositionGrid, counts: list[int], lo: int, hi: int) -> torch.Tensor:
    """A grid's positions `[R_total]` int64, checked inside `[lo, hi)` and strictly ascending
    in every segment on its tensors; the first segment that fails is named."""
    if _ascending_inside(grid.flat, counts, lo, hi):
        return grid.flat
    for number, segment in enumerate(itertools.chain.from_iterable(grid.nested())):
        layer, owner = divmod(number, grid.num_owners)
        _check_positions(segment, lo, hi, f"selected[{layer}][{owner}]")
    raise PackingError("selected", "positions are not strictly ascending inside the source")


def _segment_positions(
    segments: Sequence[Sequence[int]], counts: Sequence[int], lo: int, hi: int, num_owners: int
) -> torch.Tensor:
    """Every segment's positions back to back `[R_total]` int64, checked as `_check_positions`
    checks one segment (ints, inside `[lo, hi)`, strictly ascending) but on one tensor; the
    first segment that fails is checked again alone, for its own error."""
    flat = list(itertools.chain.from_iterable(segments))
    # `type(p) is int` for every p at C speed; anything else (bool, float, numpy) goes the slow
    # way, which accepts int subclasses and names the first non-int.
    positions = _int64_tensor(flat) if set(map(type, flat)) <= {int} else None
    if positions is not None and _ascending_inside(positions, counts, lo, hi):
        return positions
    for number, segment in enumerate(segments):
        layer, owner = divmod(number, num_owners)
        _check_positions(segment, lo, hi, f"selected[{layer}][{owner}]")
    return torch.tensor([int(p) for p in flat], dtype=torch.long)  # int subclasses


def _int64_tensor(flat: list[int]) -> torch.Tensor | None:
    """`flat` as int64 `[n]` through a C array (twice as fast as torch.tensor on a list; the
    tensor keeps the array, its own copy, alive); None past int64, which no source holds."""
    if not flat:
        return torch.zeros(0, dtype=torch.long)
    try:
        return torch.frombuffer(array.array("q", flat), dtype=torch.long)
    except OverflowError:
        return None


def _ascending_inside(positions: torch.Tensor, counts: Sequence[int], lo: int, hi: int) -> bool:
    """Whether every position lies in `[lo, hi)` and rises strictly inside its segment."""
    total = int(positions.shape[0])
    if total == 0:
        return True
    if int(positions.min()) < lo or int(positions.max()) >= hi:
        return False
    steps = positions[1:] > positions[:-1]  # [R_total - 1]
    starts = [s for s in itertools.accumulate(counts) if 0 < s < total]
    if starts:
        steps[torch.tensor(starts, dtype=torch.long) - 1] = True  # a segment restarts anywhere
    return every(steps)


def validate_view(
    view: PackedKVView,
    *,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    k_dtype: torch.dtype | None = None,
    v_dtype: torch.dtype | None = None,
    frontier: int | None = None,
) -> None:
    """Check a view's internal consistency and, optionally, that it matches a contract.

    Structural checks: K/V are 2-D with equal shape and device (their dtypes may differ, as
    the tensor contract declares K and V dtypes separately); the position map is
    1-D int32 with one entry per row; offsets are `[L, H+1]` int32, start at 0, are
    non-decreasing and globally contiguous across layers, and end at R_total; positions
    are non-negative and strictly ascending inside every segment. Keyword arguments, when
    given, must match (`frontier` bounds every position from above, exclusive).
    Raises PackingError naming the field.
    """
    _check_payload(view.packed_k, view.packed_v)
    total_rows = int(view.packed_k.shape[0])
    offsets = _check_offsets(view.row_offsets, total_rows)
    positions = _check_position_map(view.original_position_map, total_rows)
    _check_segments_ascending(positions, offsets, frontier)
    _check_expected(view, num_layers, num_kv_heads, head_dim)
    if k_dtype is not None and view.packed_k.dtype != k_dtype:
        raise PackingError("packed_k", f"dtype {view.packed_k.dtype}, contract says {k_dtype}")
    if v_dtype is not None and view.packed_v.dtype != v_dtype:
        raise PackingError("packed_v", f"dtype {view.packed_v.dtype}, contract says {v_dtype}")


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _gather(
    source: torch.Tensor, rows: torch.Tensor, starts: Sequence[int], sources: Sequence[int]
) -> torch.Tensor:
    """`[R_total, d_h]`: packed rows `starts[i]:starts[i + 1]` are rows `rows[...]` of the
    (layer, K/V head) image `sources[i]` of `source [L, H_kv, T, d_h]`, each segment gathered
    straight into its place in the output: no flat gather index is built, and one segment's
    source rows stay in cache while it is copied."""
    num_layers, num_kv_heads, seq_len, head_dim = (int(x) for x in source.shape)
    images = source.reshape(num_layers * num_kv_heads, seq_len, head_dim)
    out = torch.empty(starts[-1], head_dim, dtype=source.dtype, device=source.device)
    row_bytes = head_dim * source.element_size()
    aligned = (source.storage_offset() * source.element_size()) % 8 == 0
    if row_bytes % 8 == 0 and aligned and source.is_contiguous():
        # Rows copied as int64 words (a 64-wide bf16 row is 16 of them): the same bytes,
        # fewer and wider element copies than index_select makes for 2-byte elements.
        images, target = images.view(torch.int64), out.view(torch.int64)
    else:
        target = out
    for number, image in enumerate(sources):
        lo, hi = starts[number], starts[number + 1]
        if hi > lo:
            torch.index_select(images[image], 0, rows[lo:hi], out=target[lo:hi])
    return out


def _check_sources(source_k: torch.Tensor, source_v: torch.Tensor) -> tuple[int, int, int, int]:
    if source_k.dim() != 4:
        raise PackingError(
            "source_k", f"expected [L, H_kv, T, d_h], got shape {tuple(source_k.shape)}"
        )
    if source_v.shape != source_k.shape:
        raise PackingError(
            "source_v", f"shape {tuple(source_v.shape)} != source_k {tuple(source_k.shape)}"
        )
    if source_v.device != source_k.device:
        raise PackingError("source_v", f"device {source_v.device} != source_k {source_k.device}")
    num_layers, num_kv_heads, seq_len, head_dim = (int(x) for x in source_k.shape)
    if min(num_layers, num_kv_heads, head_dim) <= 0:
        raise PackingError("source_k", f"non-positive dimension in shape {tuple(source_k.shape)}")
    return num_layers, num_kv_heads, seq_len, head_dim


def _check_owner_map(
    owner_to_kv_head: Sequence[int] | None,
    selected: Selection | PositionGrid,
    num_layers: int,
    num_kv_heads: int,
) -> list[int]:
    if len(selected) != num_layers:
        raise PackingError("selected", f"{len(selected)} layers, source has {num_layers}")
    owners = list(range(num_kv_heads)) if owner_to_kv_head is None else list(owner_to_kv_head)
    for owner, kv_head in enumerate(owners):
        if (
            isinstance(kv_head, bool)
            or not isinstance(kv_head, int)
            or not 0 <= kv_head < num_kv_heads
        ):
            raise PackingError(
                "owner_to_kv_head", f"owner {owner} maps to {kv_head!r}, need [0, {num_kv_heads})"
            )
    if not owners:
        raise PackingError("owner_to_kv_head", "no owners")
    if isinstance(selected, PositionGrid):
        if selected.num_owners != len(owners):
            raise PackingError(
                "selected[0]", f"{selected.num_owners} owners, expected {len(owners)}"
            )
        return owners
    for layer, per_layer in enumerate(selected):
        if len(per_layer) != len(owners):
            raise PackingError(
                f"selected[{layer}]", f"{len(per_layer)} owners, expected {len(owners)}"
            )
    return owners


def _check_positions(positions: Sequence[int], lo: int, hi: int, field: str) -> list[int]:
    out = list(positions)
    previous = lo - 1
    for p in out:
        if isinstance(p, bool) or not isinstance(p, int):
            raise PackingError(field, f"position {p!r} is not an int")
        if not lo <= p < hi:
            raise PackingError(field, f"position {p} outside [{lo}, {hi})")
        if p <= previous:
            raise PackingError(
                field, f"positions must be strictly ascending, got {p} after {previous}"
            )
        previous = p
    return out


def _check_payload(packed_k: torch.Tensor, packed_v: torch.Tensor) -> None:
    if packed_k.dim() != 2:
        raise PackingError(
            "packed_k", f"expected [R_total, d_h], got shape {tuple(packed_k.shape)}"
        )
    if packed_k.shape[1] <= 0:
        raise PackingError("packed_k", "head_dim must be positive")
    if packed_v.shape != packed_k.shape:
        raise PackingError(
            "packed_v", f"shape {tuple(packed_v.shape)} != packed_k {tuple(packed_k.shape)}"
        )
    if packed_v.device != packed_k.device:
        raise PackingError("packed_v", f"device {packed_v.device} != packed_k {packed_k.device}")


def _check_offsets(row_offsets: torch.Tensor, total_rows: int) -> list[list[int]]:
    field = "row_offsets"
    if row_offsets.dtype != OFFSET_DTYPE:
        raise PackingError(field, f"dtype {row_offsets.dtype}, expected {OFFSET_DTYPE}")
    if row_offsets.dim() != 2 or row_offsets.shape[0] < 1 or row_offsets.shape[1] < 2:
        raise PackingError(
            field, f"expected [L >= 1, H + 1 >= 2], got shape {tuple(row_offsets.shape)}"
        )
    offsets = [[int(x) for x in row] for row in row_offsets.cpu().tolist()]
    previous_end = 0
    for layer, row in enumerate(offsets):
        if row[0] != previous_end:
            raise PackingError(
                field, f"layer {layer} starts at {row[0]}, previous segment ended at {previous_end}"
            )
        if any(b < a for a, b in zip(row, row[1:], strict=False)):
            raise PackingError(field, f"layer {layer} offsets {row} are not monotonic")
        previous_end = row[-1]
    if previous_end != total_rows:
        raise PackingError(field, f"last offset {previous_end} != R_total {total_rows}")
    return offsets


def _check_position_map(position_map: torch.Tensor, total_rows: int) -> torch.Tensor:
    field = "original_position_map"
    if position_map.dtype != POSITION_DTYPE:
        raise PackingError(field, f"dtype {position_map.dtype}, expected {POSITION_DTYPE}")
    if position_map.dim() != 1 or int(position_map.shape[0]) != total_rows:
        raise PackingError(field, f"shape {tuple(position_map.shape)}, expected [{total_rows}]")
    positions = position_map.cpu()  # [R_total] int32: compared as it is, not copied to int64
    if total_rows and int(positions.min()) < 0:
        raise PackingError(field, f"negative position {int(positions.min())}")
    return positions


def _check_segments_ascending(
    positions: torch.Tensor, offsets: list[list[int]], frontier: int | None
) -> None:
    total_rows = int(positions.shape[0])
    if frontier is not None and total_rows and int(positions.max()) >= frontier:
        raise PackingError(
            "original_position_map", f"position {int(positions.max())} >= frontier {frontier}"
        )
    if total_rows < 2:
        return
    ascending = positions[1:] > positions[:-1]  # [R_total - 1]
    starts = torch.tensor(
        [s for row in offsets for s in row[:-1] if 0 < s < total_rows], dtype=torch.long
    )
    ascending[starts - 1] = True  # a segment boundary may restart at any position
    if not every(ascending):
        row = int(torch.nonzero(~ascending)[0, 0]) + 1
        layer, owner = _segment_of(row, offsets)
        raise PackingError(
            "original_position_map",
            f"positions of layer {layer} owner {owner} not strictly ascending at packed row {row}",
        )


def _segment_of(row: int, offsets: list[list[int]]) -> tuple[int, int]:
    for layer, layer_offsets in enumerate(offsets):
        for owner in range(len(layer_offsets) - 1):
            if layer_offsets[owner] <= row < layer_offsets[owner + 1]:
                return layer, owner
    raise AssertionError(f"row {row} not inside any segment")


def _check_expected(
    view: PackedKVView,
    num_layers: int | None,
    num_kv_heads: int | None,
    head_dim: int | None,
) -> None:
    actual_layers = int(view.row_offsets.shape[0])
    actual_owners = int(view.row_offsets.shape[1]) - 1
    if num_layers is not None and actual_layers != num_layers:
        raise PackingError("row_offsets", f"{actual_layers} layers, contract says {num_layers}")
    if num_kv_heads is not None and actual_owners != num_kv_heads:
        raise PackingError(
            "row_offsets", f"{actual_owners} owners per layer, contract says {num_kv_heads}"
        )
    if head_dim is not None and int(view.packed_k.shape[1]) != head_dim:
        raise PackingError(
            "packed_k", f"head_dim {int(view.packed_k.shape[1])}, contract says {head_dim}"
        )
