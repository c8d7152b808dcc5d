"""Static policies from the exclusive frontier: full, sliding window, sink + recent."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.kvpolicy.errors import SelectionError
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.static import (
    full_positions,
    sink_recent_positions,
    sliding_window_positions,
    static_positions,
    static_protected_positions,
    static_selection,
)

TENSOR = TensorContract(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=4,
    k_dtype=DType.FLOAT16,
    v_dtype=DType.FLOAT16,
)

SINK_RECENT_K2_W3 = {
    0: (),
    1: (0,),
    2: (0, 1),
    3: (0, 1, 2),
    4: (0, 1, 2, 3),
    5: (0, 1, 2, 3, 4),
    6: (0, 1, 3, 4, 5),
    7: (0, 1, 4, 5, 6),
    8: (0, 1, 5, 6, 7),
}


def test_sink_recent_exact_sets_and_sizes() -> None:
    for frontier, expected in SINK_RECENT_K2_W3.items():
        positions = sink_recent_positions(frontier, sinks=2, window=3)
        assert positions == expected, frontier
        assert len(positions) == min(frontier, 5)


def test_sink_recent_first_saturation_and_first_middle_omission() -> None:
    sizes = {f: len(sink_recent_positions(f, 2, 3)) for f in range(9)}
    first_saturation = min(f for f, size in sizes.items() if size == 2 + 3)
    first_omission = min(f for f in range(9) if len(sink_recent_positions(f, 2, 3)) < f)
    assert first_saturation == 5
    assert first_omission == 6
    assert 2 not in sink_recent_positions(6, 2, 3)  # the omitted row is in the middle


def test_sliding_window_and_full() -> None:
    assert sliding_window_positions(0, 3) == ()
    assert sliding_window_positions(2, 3) == (0, 1)
    assert sliding_window_positions(8, 3) == (5, 6, 7)
    assert full_positions(4) == (0, 1, 2, 3)
    assert sliding_window_positions(8, 3, origin=100) == (105, 106, 107)
    assert sink_recent_positions(8, 2, 3, origin=100) == (100, 101, 105, 106, 107)


def test_static_policies_from_manifests() -> None:
    manifests = default_manifests(TENSOR, recent_window=3, sinks=2)
    assert static_positions(manifests["full"].selection, 5) == (0, 1, 2, 3, 4)
    assert static_positions(manifests["window"].selection, 8) == (5, 6, 7)
    assert static_positions(manifests["sink-recent"].selection, 8) == (0, 1, 5, 6, 7)
    grid = static_selection(manifests["sink-recent"], 8)
    assert grid == (((0, 1, 5, 6, 7),) * 2,) * 2
    assert static_protected_positions(manifests["sink-recent"].selection, 1) == (0,)
    assert static_protected_positions(manifests["window"].selection, 8) == ()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: full_positions(-1), "frontier"),
        (lambda: full_positions(3, origin=-1), "position_origin"),
        (lambda: sliding_window_positions(3, 0), "selection.recent_window"),
        (lambda: sink_recent_positions(3, -1, 2), "selection.protected.sinks"),
        (
            lambda: static_positions(default_manifests(TENSOR)["snapkv"].selection, 3),
            "selection.method",
        ),
    ],
)
def test_static_inputs_are_validated(call: Callable[[], object], field: str) -> None:
    with pytest.raises(SelectionError) as info:
        call()
    assert info.value.field == field
