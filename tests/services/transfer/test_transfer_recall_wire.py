"""The recall transport's pure parts: recalled pages packed as a view and split back, the
digest that binds them, the inline wire form, and validation that names the field. Rows are
symbolic (K[l,h,t,c] = 1000 l + 100 h + 10 t + c, V = 5000 + K), so every value says where
it came from."""

from __future__ import annotations

import pytest
import torch
from kv_helpers import symbolic_kv

from services.offload.pages import PageRef, RecalledPage, gather_omitted, summarize_pages
from services.transfer import DescriptorInvalid
from services.transfer.recall import (
    PageRows,
    RecallAnswer,
    RecallCall,
    answer_from_proto,
    answer_to_proto,
    call_from_proto,
    call_to_proto,
    pages_of_view,
    recall_digest,
    recall_view,
    travel_order,
)

torch.set_num_threads(1)
LAYERS, HEADS, TOKENS, HEAD_DIM, PAGE = 2, 2, 16, 4, 3
SELECTED = [[[0, 1, 7, 15], [0, 15]], [[2, 3, 4, 15], [0, 5, 10, 15]]]


def all_pages(dtype: torch.dtype = torch.float32) -> list[RecalledPage]:
    k, v = symbolic_kv(LAYERS, HEADS, TOKENS, HEAD_DIM, dtype)
    summaries = summarize_pages(k, SELECTED, PAGE)
    rows = gather_omitted(k, v, summaries)
    return [rows.page(summaries.page_ref(p)) for p in range(summaries.num_pages)]


def expected_k(ref: PageRef, position: int) -> torch.Tensor:
    return 1000.0 * ref.layer + 100 * ref.owner + 10 * position + torch.arange(HEAD_DIM).float()


def test_pages_travel_as_a_view_and_come_back_at_their_positions() -> None:
    pages = travel_order(list(reversed(all_pages())))
    view = recall_view(pages, LAYERS, HEADS)
    assert view.total_rows == sum(int(p.positions.shape[0]) for p in pages)
    back = pages_of_view(view, [PageRows(p.ref, int(p.positions.shape[0])) for p in pages])
    for sent, got in zip(pages, back, strict=True):
        assert got.ref == sent.ref
        assert torch.equal(got.positions, sent.positions)
        for row, position in enumerate(got.positions.tolist()):
            assert torch.equal(got.k[row], expected_k(got.ref, position))
            assert torch.equal(got.v[row], 5000 + expected_k(got.ref, position))


def test_a_view_with_other_rows_than_answered_is_refused() -> None:
    pages = travel_order(all_pages())
    view = recall_view(pages, LAYERS, HEADS)
    answered = [PageRows(p.ref, int(p.positions.shape[0])) for p in pages]
    with pytest.raises(DescriptorInvalid, match="rows"):
        pages_of_view(view, answered[:-1])
    grown = [*answered[:-1], PageRows(answered[-1].ref, answered[-1].rows + 1)]
    with pytest.raises(DescriptorInvalid) as caught:
        pages_of_view(view, grown)
    assert caught.value.field == f"pages[{len(grown) - 1}].rows"


def test_the_digest_binds_generations_and_every_position() -> None:
    pages = travel_order(all_pages())
    digest = recall_digest("req-1", 3, 2, pages)
    assert digest == recall_digest("req-1", 3, 2, list(pages))
    assert digest != recall_digest("req-1", 4, 2, pages)
    assert digest != recall_digest("req-1", 3, 1, pages)
    moved = RecalledPage(pages[0].ref, pages[0].positions + 1, pages[0].k, pages[0].v)
    assert digest != recall_digest("req-1", 3, 2, [moved, *pages[1:]])


def test_inline_answers_round_trip_exactly_with_distinct_k_and_v_dtypes() -> None:
    pages = travel_order(all_pages(torch.float32))
    mixed = [RecalledPage(p.ref, p.positions, p.k.to(torch.bfloat16), p.v) for p in pages]
    answer = RecallAnswer(
        request_generation=2, parent_state_generation=1,
        pages=tuple(PageRows(p.ref, int(p.positions.shape[0])) for p in mixed),
        missing=(), nbytes=sum(p.nbytes for p in mixed), inline=tuple(mixed),
    )
    back = answer_from_proto(answer_to_proto(answer))
    assert (back.request_generation, back.parent_state_generation, back.nbytes) == (2, 1, answer.nbytes)
    assert back.transfer is None and back.rows == answer.rows
    for sent, got in zip(mixed, back.inline, strict=True):
        assert got.ref == sent.ref and torch.equal(got.positions, sent.positions)
        assert got.k.dtype == torch.bfloat16 and torch.equal(got.k, sent.k)
        assert got.v.dtype == torch.float32 and torch.equal(got.v, sent.v)


def test_a_recall_call_round_trips_and_names_its_bad_fields() -> None:
    refs = (PageRef(0, 1, 2), PageRef(1, 0, 0))
    call = RecallCall("req-1", 3, 2, "h1", refs, "127.0.0.1:4000", trace_context=(("traceparent", "x"),))
    assert call_from_proto(call_to_proto(call)) == call
    bad = {
        "pages": {"pages": ()},
        "parent_state_generation": {"parent_state_generation": 0},
        "rendezvous_address": {"rendezvous_address": "nowhere"},
        "handoff_id": {"handoff_id": ""},
    }
    for field, change in bad.items():
        values = {**call.__dict__, **change}
        with pytest.raises(DescriptorInvalid) as caught:
            RecallCall(**values)
        assert caught.value.field == field
    with pytest.raises(DescriptorInvalid, match="twice"):
        RecallCall("req-1", 3, 2, "h1", (refs[0], refs[0]), inline=True)
    assert RecallCall("req-1", 3, 2, "h1", refs, inline=True).rendezvous_address == ""
