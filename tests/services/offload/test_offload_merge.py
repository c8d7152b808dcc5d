"""Merging recalled rows: sorted unique positions, full recall = the full view, successor state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import symbolic_kv

from services.kvpolicy.errors import StateInvalid
from services.kvpolicy.packing import pack
from services.kvpolicy.state import KVPolicyState
from services.offload.errors import RecallMergeInvalid
from services.offload.merge import (
    OwnerRows,
    merge_rows,
    merge_view,
    recall_successor,
    recalled_position_grid,
)
from services.offload.pages import PageRef, RecalledPage, gather_omitted, summarize_pages
from services.offload.store import OffloadStore, OffloadStoreConfig, StoreKey

torch.set_num_threads(1)

SHA = "cd" * 32


def page_at(ref: PageRef, positions: list[int], k: torch.Tensor, v: torch.Tensor) -> RecalledPage:
    return RecalledPage(ref, torch.tensor(positions, dtype=torch.int32), k, v)


def owner_rows(k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> OwnerRows:
    """Rows of one owner `k`, `v` `[T, d_h]` at `positions`."""
    return OwnerRows(k[positions], v[positions], torch.tensor(positions, dtype=torch.int32))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=10))
def test_merged_rows_are_sorted_unique_and_the_right_rows(groups: list[int]) -> None:
    # position t goes to the visible set (group 0) or to recalled batch 1..3
    k, v = symbolic_kv(1, 1, len(groups), 3)
    k, v = k[0, 0], v[0, 0]  # [T, d_h]
    visible = owner_rows(k, v, [t for t, g in enumerate(groups) if g == 0])
    batches = [owner_rows(k, v, [t for t, g in enumerate(groups) if g == b]) for b in (1, 2, 3)]
    merged = merge_rows(visible, batches)
    assert merged.positions.tolist() == list(range(len(groups)))
    assert torch.equal(merged.k, k) and torch.equal(merged.v, v)


def test_merging_a_visible_position_again_is_rejected() -> None:
    k, v = symbolic_kv(1, 1, 6, 2)
    visible = owner_rows(k[0, 0], v[0, 0], [0, 3, 5])
    with pytest.raises(RecallMergeInvalid, match="position 3 is already visible"):
        merge_rows(visible, [owner_rows(k[0, 0], v[0, 0], [2, 3])])
    with pytest.raises(RecallMergeInvalid, match="head_dim"):
        merge_rows(visible, [owner_rows(k[0, 0, :, :1], v[0, 0, :, :1], [1])])
    with pytest.raises(RecallMergeInvalid, match="strictly ascending"):
        owner_rows(k[0, 0], v[0, 0], [4, 1])


@st.composite
def recall_case(
    draw: st.DrawFn,
) -> tuple[tuple[int, int, int, int], list[list[list[int]]], int, bool]:
    layers, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 9))
    positions = st.sets(st.integers(0, tokens - 1)).map(sorted)
    selected = [[draw(positions) for _ in range(heads)] for _ in range(layers)]
    return (layers, heads, tokens, 2), selected, draw(st.integers(1, 4)), draw(st.booleans())


@settings(max_examples=80, deadline=None)
@given(recall_case())
def test_recalling_every_page_through_the_store_rebuilds_the_full_view(
    case: tuple[tuple[int, int, int, int], list[list[list[int]]], int, bool],
) -> None:
    shape, selected, page_size, expand = case
    owners = shape[1]
    # under `expand` owners are query heads, two per K/V head
    owner_map = [h // 2 for h in range(owners)] if expand else None
    k, v = symbolic_kv(shape[0], (owners + 1) // 2 if expand else owners, shape[2], shape[3])
    view = pack(k, v, selected, owner_map)
    pages = summarize_pages(k, selected, page_size, owner_map)
    store = OffloadStore(OffloadStoreConfig(capacity_bytes=1 << 20, lease_s=60.0))
    store.put(StoreKey("r", 1, 1), gather_omitted(k, v, pages, owner_map))
    refs = [pages.page_ref(p) for p in range(pages.num_pages)]
    fetched = store.fetch(StoreKey("r", 1, 1), refs[::-1])  # any order
    merged = merge_view(view, fetched.pages)
    full = pack(k, v, [[list(range(shape[2]))] * shape[1]] * shape[0], owner_map)
    for name in ("packed_k", "packed_v", "original_position_map", "row_offsets"):
        assert torch.equal(getattr(merged, name), getattr(full, name)), name
    store.release("r")
    assert store.used_bytes == 0


def test_merge_view_rejects_duplicates_and_foreign_pages() -> None:
    k, v = symbolic_kv(1, 2, 6, 2)
    view = pack(k, v, [[[0, 2], [1]]])
    twice = page_at(PageRef(0, 0, 0), [2], k[0, 0, 2:3], v[0, 0, 2:3])
    with pytest.raises(RecallMergeInvalid, match="position 2 is already visible"):
        merge_view(view, [twice])
    foreign = page_at(PageRef(0, 2, 0), [3], k[0, 0, 3:4], v[0, 0, 3:4])
    with pytest.raises(RecallMergeInvalid) as info:
        merge_view(view, [foreign])
    assert info.value.field == "pages[0].ref"


def parent_state(**overrides: Any) -> KVPolicyState:
    fields: dict[str, Any] = {
        "request_id": "req-1",
        "manifest_sha256": SHA,
        "request_generation": 2,
        "state_generation": 1,
        "parent_state_generation": 0,
        "cache_generation": 1,
        "frontier": 8,
        "selected_positions": [[[0, 5, 6, 7], [0, 1, 6, 7]]],
        "protected_positions": [6, 7],
        "owner_budgets": [[4, 4]],
    }
    fields.update(overrides)
    return KVPolicyState(**fields)


def test_recall_successor_adds_recalled_and_decoded_positions() -> None:
    parent = parent_state()
    child = recall_successor(parent, [[[2, 3], []]], cache_generation=5, frontier=10)
    assert (child.state_generation, child.parent_state_generation) == (2, 1)
    assert (child.request_generation, child.cache_generation, child.frontier) == (2, 5, 10)
    assert child.selected_positions == (((0, 2, 3, 5, 6, 7, 8, 9), (0, 1, 6, 7, 8, 9)),)
    assert child.owner_budgets == ((8, 6),)
    assert child.protected_positions == (6, 7)
    assert parent.selected_positions == (((0, 5, 6, 7), (0, 1, 6, 7)),)  # never edited


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["kept", "recalled", "omitted"]), min_size=2, max_size=12),
    st.integers(0, 3),
)
def test_recall_successor_validates_for_any_disjoint_recall(marks: list[str], decoded: int) -> None:
    marks[-1] = "kept"  # the protected last position stays visible
    marks[0] = "recalled"  # a recall adds at least one row
    kept = [t for t, m in enumerate(marks) if m == "kept"]
    recalled = [t for t, m in enumerate(marks) if m == "recalled"]
    parent = parent_state(
        frontier=len(marks), selected_positions=[[kept]], protected_positions=[len(marks) - 1],
        owner_budgets=None,
    )
    frontier = len(marks) + decoded
    child = recall_successor(parent, [[recalled]], cache_generation=2, frontier=frontier)
    positions = child.selected_positions[0][0]
    assert list(positions) == sorted(set(kept) | set(recalled) | set(range(len(marks), child.end)))
    assert child.state_generation == parent.state_generation + 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from(["kept", "recalled", "omitted"]), min_size=6, max_size=6),
             min_size=4, max_size=4),
    st.integers(0, 3),
    st.sampled_from([None, "twice", "visible"]),
)
def test_recall_successor_merges_every_owner_of_every_layer(
    marks: list[list[str]], decoded: int, forge: str | None
) -> None:
    # Owners (layer, owner) = divmod(i, 2) over 6 positions; the last stays visible in all.
    for owner in marks:
        owner[-1] = "kept"
    marks[1][0] = "recalled"
    kept = [[t for t, m in enumerate(o) if m == "kept"] for o in marks]
    recalled = [[t for t, m in enumerate(o) if m == "recalled"] for o in marks]
    parent = parent_state(
        frontier=6, selected_positions=[kept[0:2], kept[2:4]], protected_positions=[5],
        owner_budgets=None,
    )
    grid = [recalled[0:2], recalled[2:4]]
    if forge is not None:  # owner (0, 1) recalls a position twice, or one it already sees
        grid[0][1] = [*grid[0][1], grid[0][1][0] if forge == "twice" else 5]
        with pytest.raises(RecallMergeInvalid) as error:
            recall_successor(parent, grid, cache_generation=2, frontier=6 + decoded)
        assert error.value.field == "recalled[0][1]"
        return
    child = recall_successor(parent, grid, cache_generation=2, frontier=6 + decoded)
    for i in range(4):
        layer, owner = divmod(i, 2)
        expected = sorted(set(kept[i]) | set(recalled[i]) | set(range(6, 6 + decoded)))
        assert list(child.selected_positions[layer][owner]) == expected


def test_recall_successor_rejections_name_the_field() -> None:
    parent = parent_state()
    cases = [
        ([[[5], []]], 2, "recalled[0][0]", RecallMergeInvalid),  # already visible
        ([[[], [8]]], 2, "recalled[0][1]", RecallMergeInvalid),  # beyond the parent's end
        ([[[], []]], 2, "recalled", RecallMergeInvalid),  # nothing recalled
        ([[[2]]], 2, "recalled", RecallMergeInvalid),  # wrong grid
        ([[[2], []]], 1, "cache_generation", StateInvalid),  # the cache changed
    ]
    for recalled, cache_generation, field, error in cases:
        with pytest.raises(error) as info:
            recall_successor(parent, recalled, cache_generation=cache_generation)
        assert info.value.field == field
    with pytest.raises(StateInvalid) as back:
        recall_successor(parent, [[[2], []]], cache_generation=2, frontier=7)
    assert back.value.field == "frontier"


def test_recalled_position_grid_groups_pages_by_owner() -> None:
    pages = [
        page_at(PageRef(0, 1, 1), [6, 7], torch.zeros(2, 1), torch.zeros(2, 1)),
        page_at(PageRef(0, 1, 0), [2], torch.zeros(1, 1), torch.zeros(1, 1)),
    ]
    assert recalled_position_grid(pages, 1, 2, origin=10) == [[[], [12, 16, 17]]]
    with pytest.raises(RecallMergeInvalid):
        recalled_position_grid(pages, 1, 1)
