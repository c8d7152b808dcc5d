"""KVPolicyState: valid snapshots, successors, and one negative test per validation rule."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace
from typing import Any

import pytest

from services.kvpolicy.errors import StateInvalid
from services.kvpolicy.state import KVPolicyState

SHA = "ab" * 32


def make_state(**overrides: Any) -> KVPolicyState:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "manifest_sha256": SHA,
        "request_generation": 3,
        "state_generation": 1,
        "parent_state_generation": 0,
        "cache_generation": 1,
        "frontier": 8,
        "selected_positions": [[[0, 2, 6, 7], [0, 1, 6, 7]], [[0, 3, 6, 7], [0, 5, 6, 7]]],
        "protected_positions": [0, 6, 7],
        "owner_budgets": [[4, 4], [4, 5]],
    }
    fields.update(overrides)
    return KVPolicyState(**fields)


def test_valid_state_is_frozen_into_tuples() -> None:
    state = make_state()
    assert state.selected_positions[1][1] == (0, 5, 6, 7)
    assert state.protected_positions == (0, 6, 7)
    assert state.owner_budgets == ((4, 4), (4, 5))
    assert (state.num_layers, state.num_owners, state.retained_rows, state.end) == (2, 2, 16, 8)
    with pytest.raises(FrozenInstanceError):
        state.frontier = 9  # type: ignore[misc]


def test_successor_advances_generations_and_keeps_identity() -> None:
    state = make_state()
    grid = [[[0, 2, 6, 7, 8], [0, 1, 6, 7, 8]], [[0, 3, 6, 7, 8], [0, 5, 6, 7, 8]]]
    child = state.successor(selected_positions=grid, frontier=9, cache_generation=2)
    assert (child.state_generation, child.parent_state_generation) == (2, 1)
    assert (child.request_id, child.request_generation, child.manifest_sha256) == ("req-1", 3, SHA)
    assert child.protected_positions == state.protected_positions
    assert child.owner_budgets is None
    assert state.state_generation == 1  # the parent is never edited


def test_successor_cannot_move_frontier_or_cache_generation_back() -> None:
    state = make_state()
    with pytest.raises(StateInvalid) as frontier:
        state.successor(selected_positions=state.selected_positions, frontier=7, cache_generation=2)
    assert frontier.value.field == "frontier"
    with pytest.raises(StateInvalid) as cache:
        state.successor(selected_positions=state.selected_positions, frontier=8, cache_generation=0)
    assert cache.value.field == "cache_generation"


def test_position_origin_shifts_the_visible_range() -> None:
    state = make_state(
        position_origin=100,
        selected_positions=[[[100, 107]]],
        protected_positions=[100],
        owner_budgets=None,
    )
    assert state.end == 108
    with pytest.raises(StateInvalid) as info:
        make_state(
            position_origin=100,
            selected_positions=[[[99, 107]]],
            protected_positions=[],
            owner_budgets=None,
        )
    assert info.value.field == "selected_positions[0][0]"


def test_protected_positions_beyond_the_frontier_need_not_be_retained() -> None:
    state = make_state(protected_positions=[0, 6, 7, 12])
    assert 12 in state.protected_positions


# (overrides, field) — one row per validation rule.
NEGATIVE_RULES: list[tuple[dict[str, Any], str]] = [
    ({"request_id": ""}, "request_id"),
    ({"manifest_sha256": "xyz"}, "manifest_sha256"),
    ({"request_generation": 0}, "request_generation"),
    ({"parent_state_generation": -1, "state_generation": 0}, "parent_state_generation"),
    ({"state_generation": 3}, "state_generation"),
    ({"cache_generation": -1}, "cache_generation"),
    ({"frontier": -1}, "frontier"),
    ({"position_origin": -1}, "position_origin"),
    ({"selected_positions": []}, "selected_positions"),
    ({"selected_positions": [[]]}, "selected_positions"),
    ({"selected_positions": [[[0, 6, 7], [0, 6, 7]], [[0, 6, 7]]]}, "selected_positions[1]"),
    (
        {"selected_positions": [[[0, 6, 7, 8], [0, 6, 7]], [[0, 6, 7], [0, 6, 7]]]},
        "selected_positions[0][0]",
    ),
    (
        {"selected_positions": [[[0, 7, 6], [0, 6, 7]], [[0, 6, 7], [0, 6, 7]]]},
        "selected_positions[0][0]",
    ),
    (
        {"selected_positions": [[[0, 6, 6, 7], [0, 6, 7]], [[0, 6, 7], [0, 6, 7]]]},
        "selected_positions[0][0]",
    ),
    (
        {"selected_positions": [[[0, 6, 7], [0, 6, 7]], [[0, 6, 7], [0, 6, 7.0]]]},
        "selected_positions[1][1]",
    ),
    (
        {"selected_positions": [[[0, 6, 7], [0, 7]], [[0, 6, 7], [0, 6, 7]]]},
        "selected_positions[0][1]",
    ),
    ({"protected_positions": [6, 0, 7]}, "protected_positions"),
    ({"protected_positions": [0, 0, 6, 7]}, "protected_positions"),
    ({"protected_positions": [-1, 0]}, "protected_positions"),
    ({"protected_positions": [True]}, "protected_positions"),
    ({"owner_budgets": [[4, 4]]}, "owner_budgets"),
    ({"owner_budgets": [[4, 4], [4, -1]]}, "owner_budgets"),
    ({"owner_budgets": [[4, 4], [4, 3]]}, "selected_positions[1][1]"),
]


@pytest.mark.parametrize(
    ("overrides", "field"),
    NEGATIVE_RULES,
    ids=[r[1] + ":" + ",".join(r[0]) for r in NEGATIVE_RULES],
)
def test_validation_rule_rejects_with_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(StateInvalid) as info:
        make_state(**overrides)
    assert info.value.field == field, str(info.value)


def test_replace_revalidates() -> None:
    with pytest.raises(StateInvalid):
        replace(make_state(), frontier=7)
