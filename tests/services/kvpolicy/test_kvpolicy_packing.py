"""PackedKVView: exact packing of the issue's example, read-back identity, and validation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import symbolic_kv

from services.kvpolicy.errors import PackingError
from services.kvpolicy.packing import (
    OFFSET_DTYPE,
    POSITION_DTYPE,
    PackedKVView,
    SourceCache,
    materialize,
    pack,
    validate_view,
)
from services.kvpolicy.state import KVPolicyState

torch.set_num_threads(1)

SELECTED = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 2, 6, 7]]]


def example_view() -> PackedKVView:
    k, v = symbolic_kv(2, 2, 8, 4)
    return pack(k, v, SELECTED)


def test_issue_example_packs_exactly() -> None:
    view = example_view()
    assert view.original_position_map.tolist() == [0, 2, 5, 7, 0, 1, 6, 7, 0, 3, 4, 7, 0, 2, 6, 7]
    assert view.original_position_map.dtype == POSITION_DTYPE == torch.int32
    assert view.row_offsets.tolist() == [[0, 4, 8], [8, 12, 16]]
    assert view.row_offsets.dtype == OFFSET_DTYPE
    rows = view.rows(1, 0)
    assert (rows.start, rows.stop) == (8, 12)
    assert int(view.positions(1, 0)[1]) == 3
    assert view.packed_k[rows][1].tolist() == [1030, 1031, 1032, 1033]
    assert view.packed_v[rows][1].tolist() == [6030, 6031, 6032, 6033]
    assert (view.num_layers, view.num_kv_heads, view.head_dim, view.total_rows) == (2, 2, 4, 16)
    assert view.selected_positions() == SELECTED


def test_issue_example_bytes_with_two_byte_kv() -> None:
    k, v = symbolic_kv(
        2, 2, 8, 4, dtype=torch.int16
    )  # exact 2-byte storage for the symbolic values
    view = pack(k, v, SELECTED)
    assert _nbytes(k) + _nbytes(v) == 512
    assert view.payload_bytes == 256
    assert _nbytes(view.original_position_map) == 64
    assert _nbytes(view.row_offsets) == 24
    assert view.metadata_bytes == 88


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_owners_as_query_heads_gather_from_their_kv_head() -> None:
    k, v = symbolic_kv(1, 2, 6, 3)
    view = pack(k, v, [[[1], [2], [3], [4, 5]]], owner_to_kv_head=[0, 0, 1, 1])
    assert view.num_kv_heads == 4
    assert view.packed_k[:, 0].tolist() == [10, 20, 100 + 30, 100 + 40, 100 + 50]
    assert torch.equal(view.packed_v, view.packed_k + 5000)


def test_empty_owner_segments_are_valid() -> None:
    k, v = symbolic_kv(2, 2, 4, 2)
    view = pack(k, v, [[[], [1]], [[], []]])
    assert view.row_offsets.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert view.positions(1, 1).tolist() == []
    assert view.selected_positions() == [[[], [1]], [[], []]]


@st.composite
def packing_case(draw: st.DrawFn) -> tuple[tuple[int, int, int, int], list[list[list[int]]]]:
    layers = draw(st.integers(1, 3))
    heads = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 9))
    head_dim = draw(st.integers(1, 4))
    subsets = st.sets(st.integers(0, tokens - 1)).map(sorted)
    selected = [[draw(subsets) for _ in range(heads)] for _ in range(layers)]
    return (layers, heads, tokens, head_dim), selected


@settings(max_examples=50, deadline=None)
@given(packing_case())
def test_pack_then_read_back_is_identity_on_symbolic_kv(
    case: tuple[tuple[int, int, int, int], list[list[list[int]]]],
) -> None:
    (layers, heads, tokens, head_dim), selected = case
    k, v = symbolic_kv(layers, heads, tokens, head_dim)
    view = pack(k, v, selected)
    assert view.selected_positions() == selected
    assert view.total_rows == sum(len(s) for layer in selected for s in layer)
    for layer in range(layers):
        for head in range(heads):
            rows = view.rows(layer, head)
            positions = view.positions(layer, head).tolist()
            assert positions == selected[layer][head]
            for r, p in zip(range(rows.start, rows.stop), positions, strict=True):
                expected = [1000 * layer + 100 * head + 10 * p + c for c in range(head_dim)]
                assert view.packed_k[r].tolist() == expected
                assert view.packed_v[r].tolist() == [5000 + x for x in expected]


# --- pack input validation: one test per rule -------------------------------------------


def test_pack_rejects_non_4d_source() -> None:
    k, v = symbolic_kv(1, 1, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k[0], v[0], [[[0]]])
    assert info.value.field == "source_k"


def test_pack_rejects_kv_shape_mismatch() -> None:
    k, v = symbolic_kv(1, 1, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k, v[:, :, :3], [[[0]]])
    assert info.value.field == "source_v"


def test_pack_rejects_kv_device_mismatch() -> None:
    k, v = symbolic_kv(1, 1, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k, v.to("meta"), [[[0]]])
    assert info.value.field == "source_v"


def test_pack_rejects_wrong_layer_count() -> None:
    k, v = symbolic_kv(2, 1, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k, v, [[[0]]])
    assert info.value.field == "selected"


def test_pack_rejects_wrong_owner_count() -> None:
    k, v = symbolic_kv(1, 2, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k, v, [[[0]]])
    assert info.value.field == "selected[0]"


def test_pack_rejects_owner_map_outside_kv_heads() -> None:
    k, v = symbolic_kv(1, 2, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k, v, [[[0], [1]]], owner_to_kv_head=[0, 2])
    assert info.value.field == "owner_to_kv_head"


@pytest.mark.parametrize(
    ("positions", "reason"),
    [
        ([0, 4], "outside"),
        ([-1, 2], "outside"),
        ([2, 1], "ascending"),
        ([1, 1], "ascending"),
        ([0, 1.0], "not an int"),
        ([True], "not an int"),
    ],
)
def test_pack_rejects_bad_positions(positions: list[object], reason: str) -> None:
    k, v = symbolic_kv(1, 2, 4, 2)
    with pytest.raises(PackingError) as info:
        pack(k, v, [[[0], positions]])  # type: ignore[list-item]
    assert info.value.field == "selected[0][1]"
    assert reason in info.value.reason


# --- view validation (what a decode worker runs on received tensors) --------------------


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"packed_k": torch.zeros(16)}, "packed_k"),
        ({"packed_v": torch.zeros(15, 4)}, "packed_v"),
        ({"packed_v": torch.zeros(16, 4, device="meta")}, "packed_v"),
        ({"row_offsets": torch.tensor([[0, 4, 8], [8, 12, 16]], dtype=torch.int64)}, "row_offsets"),
        ({"row_offsets": torch.tensor([0, 8, 16], dtype=torch.int32)}, "row_offsets"),
        ({"row_offsets": torch.tensor([[1, 4, 8], [8, 12, 16]], dtype=torch.int32)}, "row_offsets"),
        ({"row_offsets": torch.tensor([[0, 4, 8], [7, 12, 16]], dtype=torch.int32)}, "row_offsets"),
        ({"row_offsets": torch.tensor([[0, 9, 8], [8, 12, 16]], dtype=torch.int32)}, "row_offsets"),
        ({"row_offsets": torch.tensor([[0, 4, 8], [8, 12, 15]], dtype=torch.int32)}, "row_offsets"),
        ({"original_position_map": torch.arange(16, dtype=torch.int64)}, "original_position_map"),
        ({"original_position_map": torch.arange(15, dtype=torch.int32)}, "original_position_map"),
        (
            {"original_position_map": torch.tensor([-1, 2, 5, 7] * 4, dtype=torch.int32)},
            "original_position_map",
        ),
        (
            {
                "original_position_map": torch.tensor(
                    [0, 5, 2, 7] + [0, 1, 6, 7] * 3, dtype=torch.int32
                )
            },
            "original_position_map",
        ),
        (
            {
                "original_position_map": torch.tensor(
                    [0, 2, 2, 7] + [0, 1, 6, 7] * 3, dtype=torch.int32
                )
            },
            "original_position_map",
        ),
    ],
)
def test_view_construction_validates_every_part(
    change: dict[str, torch.Tensor], field: str
) -> None:
    good = example_view()
    with pytest.raises(PackingError) as info:
        replace(good, **change)
    assert info.value.field == field


def test_validate_view_checks_the_contract_when_asked() -> None:
    view = example_view()
    validate_view(
        view,
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        k_dtype=torch.float32,
        v_dtype=torch.float32,
        frontier=8,
    )
    cases = [
        ({"num_layers": 3}, "row_offsets"),
        ({"num_kv_heads": 4}, "row_offsets"),
        ({"head_dim": 8}, "packed_k"),
        ({"k_dtype": torch.float16}, "packed_k"),
        ({"v_dtype": torch.bfloat16}, "packed_v"),
        ({"frontier": 7}, "original_position_map"),
    ]
    for kwargs, field in cases:
        with pytest.raises(PackingError) as info:
            validate_view(view, **kwargs)  # type: ignore[arg-type]
        assert info.value.field == field, kwargs


def test_rows_rejects_out_of_range_owner() -> None:
    view = example_view()
    with pytest.raises(PackingError):
        view.rows(2, 0)
    with pytest.raises(PackingError):
        view.rows(0, 2)


def test_view_error_names_the_segment() -> None:
    good = example_view()
    bad_map = torch.tensor([0, 2, 5, 7, 0, 1, 6, 7, 0, 3, 4, 7, 0, 6, 2, 7], dtype=torch.int32)
    with pytest.raises(PackingError) as info:
        replace(good, original_position_map=bad_map)
    assert "layer 1 owner 1" in info.value.reason


# --- materialization checks the source cache (issue 14, item 4) ----------------------------


def source_state(**overrides: object) -> KVPolicyState:
    fields: dict[str, object] = {
        "request_id": "req-1", "manifest_sha256": "ab" * 32, "request_generation": 1,
        "state_generation": 1, "parent_state_generation": 0, "cache_generation": 3,
        "frontier": 8, "selected_positions": SELECTED,
    }
    return KVPolicyState(**{**fields, **overrides})  # type: ignore[arg-type]


def test_materialize_gathers_the_states_rows_from_its_image() -> None:
    k, v = symbolic_kv(2, 2, 8, 4)
    view = materialize(source_state(), SourceCache(k, v, cache_generation=3))
    reference = example_view()
    assert torch.equal(view.packed_k, reference.packed_k) and torch.equal(view.packed_v, reference.packed_v)
    assert view.selected_positions() == SELECTED


def test_materialize_reads_positions_from_the_sources_origin() -> None:
    """A source image of positions [100, 108): row p - 100 holds position p."""
    k, v = symbolic_kv(2, 2, 8, 4)
    shifted = [[[100 + p for p in owner] for owner in layer] for layer in SELECTED]
    state = source_state(position_origin=100, selected_positions=shifted)
    view = materialize(state, SourceCache(k, v, cache_generation=3, position_origin=100))
    assert torch.equal(view.packed_k, example_view().packed_k)
    assert view.selected_positions() == shifted
    with pytest.raises(PackingError) as outside:
        pack(k, v, SELECTED, origin=100)
    assert outside.value.field == "selected[0][0]"


@pytest.mark.parametrize(
    ("overrides", "source_args", "field"),
    [
        ({}, {"cache_generation": 4}, "cache_generation"),
        ({"frontier": 9}, {"cache_generation": 3}, "frontier"),  # 9 positions over a source of 8
        ({"frontier": 7, "selected_positions": [[[0, 6]] * 2] * 2}, {"cache_generation": 3}, "frontier"),
        ({}, {"cache_generation": 3, "position_origin": 2}, "position_origin"),
    ],
)
def test_materialize_refuses_a_state_of_another_image(
    overrides: dict[str, object], source_args: dict[str, int], field: str
) -> None:
    k, v = symbolic_kv(2, 2, 8, 4)
    with pytest.raises(PackingError) as info:
        materialize(source_state(**overrides), SourceCache(k, v, **source_args))
    assert info.value.field == field
