"""Static visibility policies computed from the exclusive frontier alone.

Positions are absolute: the committed tokens are `[origin, origin + frontier)`.
Sink + recent is a union of the first `sinks` and the last `window` positions, so while
the two ranges overlap (frontier < sinks + window) it keeps every position, never more.
"""

from __future__ import annotations

import torch

from services.kvpolicy.errors import SelectionError
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    SelectionContract,
    SelectionMethod,
)
from services.kvpolicy.state import PositionGrid


def full_positions(frontier: int, origin: int = 0) -> tuple[int, ...]:
    _check_frontier(frontier, origin)
    return tuple(range(origin, origin + frontier))


def sliding_window_positions(frontier: int, window: int, origin: int = 0) -> tuple[int, ...]:
    """The last `window` committed positions."""
    _check_frontier(frontier, origin)
    if window < 1:
        raise SelectionError("selection.recent_window", f"must be positive, got {window}")
    end = origin + frontier
    return tuple(range(max(origin, end - window), end))


def sink_recent_positions(
    frontier: int, sinks: int, window: int, origin: int = 0
) -> tuple[int, ...]:
    """The union of the first `sinks` and the last `window` committed positions."""
    if sinks < 0:
        raise SelectionError("selection.protected.sinks", f"must be non-negative, got {sinks}")
    recent = sliding_window_positions(frontier, window, origin)
    sink_end = origin + min(sinks, frontier)
    head = tuple(range(origin, min(sink_end, recent[0] if recent else sink_end)))
    return head + recent


def static_positions(
    selection: SelectionContract, frontier: int, origin: int = 0
) -> tuple[int, ...]:
    """Visible positions of a static policy (full, sliding_window, sink_recent)."""
    if selection.method is SelectionMethod.FULL:
        return full_positions(frontier, origin)
    window = selection.recent_window
    if window is None:
        raise SelectionError("selection.method", f"{selection.method.value} is not a static policy")
    if selection.method is SelectionMethod.SLIDING_WINDOW:
        return sliding_window_positions(frontier, window, origin)
    return sink_recent_positions(frontier, selection.protected.sinks, window, origin)


def static_selection(
    manifest: KVVisibilityPolicyManifest, frontier: int, origin: int = 0
) -> PositionGrid:
    """The same static position set for every (layer, owner): `[L][H_owner]`."""
    positions = torch.tensor(static_positions(manifest.selection, frontier, origin))
    segments = manifest.tensor.num_layers * manifest.num_owners
    counts = torch.full((manifest.tensor.num_layers, manifest.num_owners), positions.numel())
    return PositionGrid(positions.long().repeat(segments), counts)


def static_protected_positions(
    selection: SelectionContract, frontier: int, origin: int = 0
) -> tuple[int, ...]:
    """Sink positions a static policy must keep while they are committed."""
    if selection.method is not SelectionMethod.SINK_RECENT:
        return ()
    return tuple(range(origin, origin + min(selection.protected.sinks, frontier)))


def _check_frontier(frontier: int, origin: int) -> None:
    if frontier < 0:
        raise SelectionError("frontier", f"must be non-negative, got {frontier}")
    if origin < 0:
        raise SelectionError("position_origin", f"must be non-negative, got {origin}")
