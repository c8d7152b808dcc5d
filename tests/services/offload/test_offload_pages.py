"""Page summaries and omitted rows: exact pages, exact partition, symbolic rows, validation."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import symbolic_kv

from services.offload.errors import PageRefInvalid, SummaryInvalid
from services.offload.pages import (
    PAGE_INDEX_DTYPE,
    OmittedRows,
    PageRef,
    PageSummaries,
    gather_omitted,
    summarize_pages,
    validate_against_view,
    validate_summaries,
)

torch.set_num_threads(1)

# 2 layers, 2 K/V heads, 10 tokens; owner (0, 0) omits 2-4 and 6-8, owner (1, 1) nothing.
SELECTED = [[[0, 1, 5, 9], [2, 3]], [[], list(range(10))]]


def test_runs_are_cut_into_pages_of_at_most_page_size() -> None:
    k, _ = symbolic_kv(2, 2, 10, 3)
    pages = summarize_pages(k, SELECTED, page_size=3)
    # owner (0,0): runs 2-4, 6-8; (0,1): 0-1, 4-9 -> 4-6, 7-9; (1,0): 0-9 -> 0-2, 3-5, 6-8, 9
    assert pages.page_first.tolist() == [2, 6, 0, 4, 7, 0, 3, 6, 9]
    assert pages.page_count.tolist() == [3, 3, 2, 3, 3, 3, 3, 3, 1]
    assert pages.page_offsets.tolist() == [[0, 2, 5], [5, 9, 9]]
    assert pages.page_min[:, 0].tolist() == [20, 60, 100, 140, 170, 1000, 1030, 1060, 1090]
    assert pages.page_max[:, 2].tolist() == [42, 82, 112, 162, 192, 1022, 1052, 1082, 1092]
    assert pages.omitted_rows == 24
    assert pages.page_ref(7) == PageRef(layer=1, owner=0, page_index=2)
    assert pages.global_index(PageRef(0, 1, 2)) == 4


def test_bytes_of_summaries_match_the_wire_layout() -> None:
    k, _ = symbolic_kv(2, 2, 10, 3, torch.bfloat16)
    pages = summarize_pages(k, SELECTED, page_size=3)
    # per page: min + max (2 * d_h * 2 bytes) + first + count (2 * 4 bytes); offsets 2 * 3 * 4
    assert pages.nbytes == 9 * (2 * 3 * 2 + 8) + 2 * 3 * 4
    assert pages.page_min.dtype == torch.bfloat16


def test_gathered_rows_are_the_symbolic_rows_of_each_page() -> None:
    k, v = symbolic_kv(2, 2, 10, 3)
    pages = summarize_pages(k, SELECTED, page_size=3)
    rows = gather_omitted(k, v, pages)
    page = rows.page(PageRef(layer=1, owner=0, page_index=2))
    assert page.positions.tolist() == [6, 7, 8]
    assert page.k.tolist() == [[1000 + 10 * t + c for c in range(3)] for t in (6, 7, 8)]
    assert page.v.tolist() == [[6000 + 10 * t + c for c in range(3)] for t in (6, 7, 8)]
    assert rows.nbytes == 2 * 24 * 3 * 4 + 24 * 4 + 10 * 4 + 6 * 4


def test_owners_as_query_heads_read_their_kv_head() -> None:
    k, v = symbolic_kv(1, 2, 6, 2)
    selected = [[[0, 1], [2, 3], [4, 5], [0, 5]]]  # query heads 0,1 -> K/V 0; 2,3 -> K/V 1
    pages = summarize_pages(k, selected, page_size=4, owner_to_kv_head=[0, 0, 1, 1])
    rows = gather_omitted(k, v, pages, owner_to_kv_head=[0, 0, 1, 1])
    page = rows.page(PageRef(layer=0, owner=3, page_index=0))
    assert page.positions.tolist() == [1, 2, 3, 4]
    assert page.k[:, 0].tolist() == [110, 120, 130, 140]
    assert pages.page_min[pages.global_index(PageRef(0, 1, 1)), 0] == 40  # K/V head 0, pos 4


def test_nothing_omitted_gives_no_pages() -> None:
    k, v = symbolic_kv(1, 1, 4, 2)
    pages = summarize_pages(k, [[[0, 1, 2, 3]]], page_size=2)
    assert pages.num_pages == 0 and pages.page_offsets.tolist() == [[0, 0]]
    assert gather_omitted(k, v, pages).num_rows == 0


@st.composite
def paging_case(draw: st.DrawFn) -> tuple[tuple[int, int, int, int], list[list[list[int]]], int]:
    layers, heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    tokens, page_size = draw(st.integers(1, 9)), draw(st.integers(1, 5))
    positions = st.sets(st.integers(0, tokens - 1)).map(sorted)
    selected = [[draw(positions) for _ in range(heads)] for _ in range(layers)]
    return (layers, heads, tokens, 3), selected, page_size


@settings(max_examples=80, deadline=None)
@given(paging_case())
def test_pages_partition_the_omitted_positions_exactly(
    case: tuple[tuple[int, int, int, int], list[list[list[int]]], int],
) -> None:
    shape, selected, page_size = case
    k, v = symbolic_kv(*shape)
    pages = summarize_pages(k, selected, page_size)
    rows = gather_omitted(k, v, pages)
    validate_against_view(pages, selected, frontier=shape[2])
    for layer, owners in enumerate(selected):
        for owner, kept in enumerate(owners):
            start, end = pages.page_offsets[layer, owner : owner + 2].tolist()
            covered: list[int] = []
            for p in range(start, end):
                first, count = int(pages.page_first[p]), int(pages.page_count[p])
                span = list(range(first, first + count))
                assert 1 <= count <= page_size
                assert not covered or span[0] > covered[-1]
                expected_k = k[layer, owner, span]  # [count, d_h]
                assert torch.equal(pages.page_min[p], expected_k.amin(0))
                assert torch.equal(pages.page_max[p], expected_k.amax(0))
                page = rows.page(pages.page_ref(p))
                assert page.positions.tolist() == span
                assert torch.equal(page.k, expected_k)
                assert torch.equal(page.v, v[layer, owner, span])
                covered += span
            assert covered == sorted(set(range(shape[2])) - set(kept))


def test_a_page_may_not_cross_a_retained_position() -> None:
    k, _ = symbolic_kv(1, 1, 6, 2)
    pages = summarize_pages(k, [[[2]]], page_size=8)
    assert pages.page_first.tolist() == [0, 3] and pages.page_count.tolist() == [2, 3]


def test_view_check_names_the_owner_of_a_gap_or_an_overlap() -> None:
    k, _ = symbolic_kv(2, 2, 10, 3)
    pages = summarize_pages(k, SELECTED, page_size=3)
    missing = [[[0, 1, 5], [2, 3]], SELECTED[1]]  # position 9 of (0, 0) vanished
    with pytest.raises(SummaryInvalid, match="position 9 is neither") as gap:
        validate_against_view(pages, missing, frontier=10)
    assert gap.value.field == "pages[0][0]"
    doubled = [SELECTED[0], [[4], list(range(10))]]
    with pytest.raises(SummaryInvalid, match="position 4 is retained and paged") as both:
        validate_against_view(pages, doubled, frontier=10)
    assert both.value.field == "pages[1][0]"


def _valid() -> PageSummaries:
    k, _ = symbolic_kv(2, 2, 10, 3)
    return summarize_pages(k, SELECTED, page_size=3)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: {"page_size": 0}, "page_size"),
        (lambda s: {"page_size": 2}, "page_count"),
        (lambda s: {"page_max": s.page_min - 1}, "page_max"),
        (lambda s: {"page_max": s.page_max.double()}, "page_max"),
        (lambda s: {"page_min": s.page_min.int()}, "page_min"),
        (lambda s: {"page_first": s.page_first.long()}, "page_first"),
        (lambda s: {"page_first": s.page_first - 3}, "page_first"),
        (lambda s: {"page_first": s.page_first.flip(0)}, "page_first"),
        (lambda s: {"page_count": s.page_count[:-1]}, "page_count"),
        (lambda s: {"page_count": s.page_count * 0}, "page_count"),
        (lambda s: {"page_offsets": s.page_offsets + 1}, "page_offsets"),
        (lambda s: {"page_offsets": s.page_offsets.flip(1)}, "page_offsets"),
        (lambda s: {"page_offsets": s.page_offsets[:, :1]}, "page_offsets"),
    ],
    ids=[
        "page_size_zero",
        "page_size_below_count",
        "min_above_max",
        "max_dtype",
        "min_not_float",
        "first_dtype",
        "first_negative",
        "first_overlapping",
        "count_length",
        "count_zero",
        "offsets_shifted",
        "offsets_reversed",
        "offsets_one_column",
    ],
)
def test_summaries_validate_every_part(change: object, field: str) -> None:
    summaries = _valid()
    with pytest.raises(SummaryInvalid) as info:
        replace(summaries, **change(summaries))  # type: ignore[operator]
    assert info.value.field == field, str(info.value)


def test_frontier_bounds_the_pages() -> None:
    with pytest.raises(SummaryInvalid, match="reaches position 9"):
        validate_summaries(_valid(), frontier=9)


def test_page_refs_outside_the_pages_are_rejected_with_the_field() -> None:
    k, v = symbolic_kv(2, 2, 10, 3)
    rows = gather_omitted(k, v, _valid())
    for ref, field in [
        (PageRef(2, 0, 0), "page.layer"),
        (PageRef(0, 2, 0), "page.owner"),
        (PageRef(1, 1, 0), "page.page_index"),
        (PageRef(0, 0, -1), "page.page_index"),
    ]:
        with pytest.raises(PageRefInvalid) as info:
            rows.page(ref)
        assert info.value.field == field
    with pytest.raises(PageRefInvalid):
        _valid().page_ref(9)


@pytest.mark.parametrize(
    ("selected", "field"),
    [
        ([[[0, 1], [2, 3]]], "selected"),
        ([[[1, 0], []], [[], []]], "selected[0][0]"),
        ([[[0], [10]], [[], []]], "selected[0][1]"),
        ([[[0], []], [[-1], []]], "selected[1][0]"),
        ([[[0], []], [[True], []]], "selected[1][0]"),
    ],
)
def test_bad_selections_are_rejected(selected: list[list[list[int]]], field: str) -> None:
    k, _ = symbolic_kv(2, 2, 10, 3)
    with pytest.raises(SummaryInvalid) as info:
        summarize_pages(k, selected, page_size=3)
    assert info.value.field == field


def test_bad_sources_and_owner_maps_are_rejected() -> None:
    k, v = symbolic_kv(2, 2, 10, 3)
    with pytest.raises(SummaryInvalid, match="source_k"):
        summarize_pages(k[0], SELECTED, page_size=3)
    with pytest.raises(SummaryInvalid, match="page_size"):
        summarize_pages(k, SELECTED, page_size=0)
    with pytest.raises(SummaryInvalid, match="owner_to_kv_head"):
        summarize_pages(k, SELECTED, page_size=3, owner_to_kv_head=[0, 2])
    with pytest.raises(SummaryInvalid, match="source_v"):
        gather_omitted(k, v[:, :1], _valid())
    with pytest.raises(SummaryInvalid, match="summaries"):
        gather_omitted(k[:, :, :, :2], v[:, :, :, :2], _valid())


def test_omitted_rows_validate_their_layout() -> None:
    k, v = symbolic_kv(2, 2, 10, 3)
    rows = gather_omitted(k, v, _valid())
    with pytest.raises(SummaryInvalid, match="page_rows"):
        replace(rows, page_rows=rows.page_rows[:-1])
    with pytest.raises(SummaryInvalid, match="page_rows"):
        replace(rows, page_rows=torch.zeros(10, dtype=PAGE_INDEX_DTYPE))
    with pytest.raises(SummaryInvalid, match="positions"):
        replace(rows, positions=rows.positions[1:])
    with pytest.raises(SummaryInvalid, match="k"):
        OmittedRows(rows.k, rows.v[:, :2], rows.positions, rows.page_rows, rows.page_offsets)


def test_fetched_page_is_a_copy() -> None:
    k, v = symbolic_kv(2, 2, 10, 3)
    rows = gather_omitted(k, v, _valid())
    page = rows.page(PageRef(0, 0, 0))
    page.k.fill_(-1)
    assert rows.page(PageRef(0, 0, 0)).k[0, 0] == 20


def test_summaries_and_rows_live_in_host_memory() -> None:
    summaries = _valid()
    with pytest.raises(SummaryInvalid) as info:
        replace(summaries, page_offsets=summaries.page_offsets.to("meta"))
    assert info.value.field == "page_offsets"
    k, v = symbolic_kv(2, 2, 10, 3)
    rows = gather_omitted(k, v, summaries)
    with pytest.raises(SummaryInvalid) as on_device:
        replace(rows, v=rows.v.to("meta"))
    assert on_device.value.field == "v"
