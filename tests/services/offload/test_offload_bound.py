"""Recall bounds: true upper bounds on page logits and omitted mass, and page choice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from services.kvpolicy.manifest import RecoverabilityContract
from services.offload.bound import (
    Ranking,
    RecallPolicy,
    bound_omitted_mass,
    choose_pages,
    page_logit_bounds,
    page_midpoint_logits,
)
from services.offload.errors import BoundInputInvalid
from services.offload.pages import PageRef, PageSummaries, summarize_pages

torch.set_num_threads(1)

VALUES = st.one_of(
    st.floats(-4.0, 4.0, width=32), st.sampled_from([0.0, 1.0, -1.0, 2.5, -2.5])
)


class Case:
    """Random keys, a retained selection, queries and the GQA map of one decode step."""

    def __init__(self, keys: np.ndarray, query: np.ndarray, selected: list[list[list[int]]],
                 head_to_owner: list[int], page_size: int) -> None:
        self.keys = torch.from_numpy(keys)  # [L, H_kv, T, d_h]
        self.query = torch.from_numpy(query)  # [L, H_q, d_h]
        self.selected = selected
        self.head_to_owner = head_to_owner
        self.pages = summarize_pages(self.keys, selected, page_size)
        self.scale = self.keys.shape[-1] ** -0.5

    def logits(
        self, layer: int, head: int, positions: list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """What attention computes: scale * q.k per position.  # [n]"""
        keys = self.keys[layer, self.head_to_owner[head], positions].to(dtype)  # [n, d_h]
        return (keys @ self.query[layer, head].to(dtype)) * self.scale

    def retained_lse(self) -> torch.Tensor:
        layers, heads = self.query.shape[:2]
        r = torch.empty(layers, heads, dtype=torch.float64)
        for layer in range(layers):
            for head in range(heads):
                kept = self.selected[layer][self.head_to_owner[head]]
                r[layer, head] = torch.logsumexp(self.logits(layer, head, kept, torch.float64), 0)
        return r

    def omitted(self, layer: int, head: int) -> list[int]:
        kept = self.selected[layer][self.head_to_owner[head]]
        return sorted(set(range(self.keys.shape[2])) - set(kept))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    layers, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    tokens, head_dim = draw(st.integers(1, 12)), draw(st.integers(1, 6))
    keys = draw(hnp.arrays(np.float32, (layers, kv_heads, tokens, head_dim), elements=VALUES))
    query = draw(hnp.arrays(np.float32, (layers, kv_heads * group, head_dim), elements=VALUES))
    positions = st.sets(st.integers(0, tokens - 1)).map(sorted)
    selected = [[draw(positions) for _ in range(kv_heads)] for _ in range(layers)]
    head_to_owner = [q // group for q in range(kv_heads * group)]
    return Case(keys, query, selected, head_to_owner, draw(st.integers(1, 4)))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_no_omitted_logit_exceeds_its_page_bound(case: Case) -> None:
    bounds = page_logit_bounds(case.pages, case.query, case.head_to_owner)  # [P, H_q]
    pages = case.pages
    for p in range(pages.num_pages):
        ref = pages.page_ref(p)
        first, count = int(pages.page_first[p]), int(pages.page_count[p])
        span = list(range(first, first + count))
        for head, owner in enumerate(case.head_to_owner):
            if owner != ref.owner:
                assert bounds[p, head] == -math.inf
                continue
            for dtype in (torch.float32, torch.float64):
                logits = case.logits(ref.layer, head, span, dtype)
                assert bool((logits <= bounds[p, head].to(dtype)).all()), (p, head, dtype)


@settings(max_examples=150, deadline=None)
@given(cases(), st.data())
def test_mass_bound_covers_the_true_omitted_mass(case: Case, data: st.DataObject) -> None:
    count = case.pages.num_pages
    live = torch.tensor(
        data.draw(st.lists(st.booleans(), min_size=count, max_size=count)), dtype=torch.bool
    )
    r = case.retained_lse()  # [L, H_q]
    bound = bound_omitted_mass(case.pages, case.query, r, case.head_to_owner, live=live)
    live_positions = _live_positions(case.pages, live)
    for layer in range(r.shape[0]):
        for head, owner in enumerate(case.head_to_owner):
            omitted = [t for t in case.omitted(layer, head) if t in live_positions[layer][owner]]
            lse = torch.logsumexp(case.logits(layer, head, omitted, torch.float64), 0)
            true_mass = float(torch.sigmoid(lse - r[layer, head])) if omitted else 0.0
            assert float(bound.head_mass_bound[layer, head]) >= true_mass * (1 - 1e-9)
            assert bound.owner_log_odds[layer, owner] >= bound.head_log_odds[layer, head]


def _live_positions(pages: PageSummaries, live: torch.Tensor) -> list[list[set[int]]]:
    out = [[set() for _ in range(pages.num_owners)] for _ in range(pages.num_layers)]
    for p in torch.nonzero(live)[:, 0].tolist():
        ref, first = pages.page_ref(p), int(pages.page_first[p])
        out[ref.layer][ref.owner].update(range(first, first + int(pages.page_count[p])))
    return out


@settings(max_examples=60, deadline=None)
@given(cases(), st.integers(1, 3))
def test_threshold_zero_recalls_every_omitted_page_over_enough_steps(
    case: Case, max_pages: int
) -> None:
    policy = RecallPolicy(threshold=0.0, max_pages_per_step=max_pages)
    r = case.retained_lse()
    live = torch.ones(case.pages.num_pages, dtype=torch.bool)
    chosen: list[int] = []
    for _ in range(math.ceil(case.pages.num_pages / max_pages)):
        bound = bound_omitted_mass(case.pages, case.query, r, case.head_to_owner, live=live)
        choice = choose_pages(bound, policy)
        assert choice.triggered and 1 <= len(choice.pages) <= max_pages
        assert bool(live[choice.pages].all())
        live[choice.pages] = False
        chosen += choice.pages.tolist()
    assert sorted(chosen) == list(range(case.pages.num_pages))
    last = choose_pages(
        bound_omitted_mass(case.pages, case.query, r, case.head_to_owner, live=live), policy
    )
    assert not last.triggered and last.pages.numel() == 0 and last.max_mass_bound == 0.0


def _two_owner_step() -> tuple[PageSummaries, torch.Tensor, list[int]]:
    """One layer, two K/V heads, 8 tokens, d_h 2; query heads 0,1 read owner 0, 2,3 owner 1."""
    keys = torch.zeros(1, 2, 8, 2)  # [L, H_kv, T, d_h]
    keys[0, 0, 2] = torch.tensor([6.0, 0.0])  # owner 0, page 0 (positions 2, 3): one hot key
    keys[0, 0, 5] = torch.tensor([3.0, 0.0])  # owner 0, page 1 (positions 4, 5): a warm key
    selected = [[[0, 1, 6, 7], [0, 1, 6, 7]]]  # pages of size 2: 2-3, 4-5 per owner
    pages = summarize_pages(keys, selected, page_size=2)
    query = torch.tensor([[[4.0, 0.0], [1.0, 0.0], [-1.0, 0.0], [-1.0, 0.0]]])  # [L, H_q, d_h]
    return pages, query, [0, 0, 1, 1]


def test_hot_pages_come_first_and_only_from_owners_over_the_threshold() -> None:
    pages, query, head_to_owner = _two_owner_step()
    r = torch.zeros(1, 4)
    bound = bound_omitted_mass(pages, query, r, head_to_owner)
    assert float(bound.owner_mass_bound[0, 0]) > 0.99 and float(bound.owner_mass_bound[0, 1]) < 0.9
    choice = choose_pages(bound, RecallPolicy(threshold=0.9, max_pages_per_step=8))
    assert choice.page_refs(pages) == (PageRef(0, 0, 0), PageRef(0, 0, 1))
    assert not choice.full_recall and choice.triggered
    one = choose_pages(bound, RecallPolicy(threshold=0.9, max_pages_per_step=1))
    assert one.page_refs(pages) == (PageRef(0, 0, 0),)


def test_full_recall_gate_takes_every_live_page() -> None:
    pages, query, head_to_owner = _two_owner_step()
    live = torch.tensor([False, True, True, True])
    bound = bound_omitted_mass(pages, query, torch.zeros(1, 4), head_to_owner, live=live)
    policy = RecallPolicy(threshold=0.5, max_pages_per_step=1, full_recall_threshold=0.99)
    choice = choose_pages(bound, policy)
    assert choice.full_recall and choice.pages.tolist() == [1, 2, 3]


def test_nothing_is_recalled_when_the_visible_rows_dominate() -> None:
    pages, query, head_to_owner = _two_owner_step()
    bound = bound_omitted_mass(pages, query, torch.full((1, 4), 60.0), head_to_owner)
    choice = choose_pages(bound, RecallPolicy(threshold=1e-6, max_pages_per_step=4))
    assert not choice.triggered and choice.pages.numel() == 0
    assert 0.0 < choice.max_mass_bound < 1e-6


def test_a_head_without_visible_rows_has_mass_bound_one() -> None:
    pages, query, head_to_owner = _two_owner_step()
    r = torch.tensor([[-math.inf, 0.0, 0.0, 0.0]])
    bound = bound_omitted_mass(pages, query, r, head_to_owner)
    assert float(bound.head_mass_bound[0, 0]) == 1.0
    assert not bool(torch.isnan(bound.page_share).any())


def test_owners_as_query_heads_read_only_their_own_pages() -> None:
    keys = torch.arange(16.0).reshape(1, 1, 8, 2)  # [L, H_kv, T, d_h]
    pages = summarize_pages(keys, [[[0, 1], [6, 7]]], page_size=8, owner_to_kv_head=[0, 0])
    bounds = page_logit_bounds(pages, torch.ones(1, 2, 2), head_to_owner=[0, 1])
    assert bounds[0, 1] == -math.inf and bounds[1, 0] == -math.inf
    assert bounds[0, 0] > (14.0 + 15.0) / math.sqrt(2) - 1e-3  # row 7 of owner 0's page


def test_policy_comes_from_a_recallable_contract() -> None:
    contract = RecoverabilityContract(
        mode="recallable_remote",  # type: ignore[arg-type]
        recall_threshold=0.05,
        page_size=16,
        max_pages_per_step=4,
        recall_cadence_steps=3,
        recall_timeout_ms=200,
        timeout_fallback="continue_lossy",  # type: ignore[arg-type]
        full_recall_on_quality_gate=0.5,
    )
    policy = RecallPolicy.from_contract(contract)
    assert (policy.threshold, policy.max_pages_per_step) == (0.05, 4)
    assert (policy.full_recall_threshold, policy.cadence_steps) == (0.5, 3)
    assert [policy.due(step) for step in range(5)] == [True, False, False, True, False]
    lossy = RecoverabilityContract("omitted_irrecoverable")  # type: ignore[arg-type]
    with pytest.raises(BoundInputInvalid) as info:
        RecallPolicy.from_contract(lossy)
    assert info.value.field == "recoverability.mode"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"threshold": 1.0}, "threshold"),
        ({"threshold": -0.1}, "threshold"),
        ({"max_pages_per_step": 0}, "max_pages_per_step"),
        ({"full_recall_threshold": 0.1}, "full_recall_threshold"),
        ({"full_recall_threshold": 1.0}, "full_recall_threshold"),
        ({"cadence_steps": 0}, "cadence_steps"),
    ],
)
def test_policy_rejects_bad_values(kwargs: dict[str, float], field: str) -> None:
    values: dict[str, float] = {"threshold": 0.2, "max_pages_per_step": 2, **kwargs}
    with pytest.raises(BoundInputInvalid) as info:
        RecallPolicy(**values)  # type: ignore[arg-type]
    assert info.value.field == field


def test_bound_inputs_are_checked() -> None:
    pages, query, head_to_owner = _two_owner_step()
    r = torch.zeros(1, 4)
    bad = [
        ("query", lambda: page_logit_bounds(pages, query[:, :3], head_to_owner)),
        ("query", lambda: page_logit_bounds(pages, query * math.nan, head_to_owner)),
        ("head_to_owner", lambda: page_logit_bounds(pages, query, [0, 0, 1, 2])),
        ("head_to_owner", lambda: page_logit_bounds(pages, query, [0, 0, 0, 0])),
        ("scale", lambda: page_logit_bounds(pages, query, head_to_owner, scale=-1.0)),
        ("retained_lse", lambda: bound_omitted_mass(pages, query, r[:, :3], head_to_owner)),
        ("retained_lse", lambda: bound_omitted_mass(pages, query, r * math.nan, head_to_owner)),
        ("live", lambda: bound_omitted_mass(pages, query, r, head_to_owner, live=torch.ones(4))),
    ]
    for field, call in bad:
        with pytest.raises(BoundInputInvalid) as info:
            call()
        assert info.value.field == field


# --- midpoint ranking --------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(cases())
def test_midpoint_estimate_is_the_box_centre_logit_on_both_product_paths(case: Case) -> None:
    pages = case.pages
    estimate = page_midpoint_logits(pages, case.query, case.head_to_owner)  # [P, H_q]
    bounds = page_logit_bounds(pages, case.query, case.head_to_owner)
    scale = pages.head_dim**-0.5
    for p in range(pages.num_pages):
        ref = pages.page_ref(p)
        centre = (pages.page_min[p].double() + pages.page_max[p].double()) / 2  # [d_h]
        for head, owner in enumerate(case.head_to_owner):
            if owner != ref.owner:
                assert estimate[p, head] == -math.inf
                continue
            expected = float(case.query[ref.layer, head].double() @ centre) * scale
            assert float(estimate[p, head]) == pytest.approx(expected, rel=1e-5, abs=1e-5)  # float32
            assert estimate[p, head] <= bounds[p, head]  # the centre lies in the box


def _even_and_uneven() -> tuple[PageSummaries, PageSummaries, torch.Tensor]:
    """The same keys paged with every layer holding as many pages, and not."""
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(3, 2, 16, 4, generator=generator)  # [L, H_kv, T, d_h]
    even = [[[0, 1], [0, 2]] for _ in range(3)]
    uneven = [[[0, 1], [0, 2]], [[0, 1, 2, 3, 4, 5], [0]], [[0], [0, 9]]]
    query = torch.randn(3, 4, 4, generator=generator)  # [L, H_q, d_h]
    return summarize_pages(keys, even, 3), summarize_pages(keys, uneven, 3), query


def test_batched_and_per_layer_products_agree() -> None:
    even, uneven, query = _even_and_uneven()
    heads = [0, 0, 1, 1]
    assert len({end - start for start, end in even.layer_ranges}) == 1
    assert len({end - start for start, end in uneven.layer_ranges}) > 1
    for pages in (even, uneven):
        scale = pages.head_dim**-0.5
        bounds = page_logit_bounds(pages, query, heads)
        for p in range(pages.num_pages):
            ref = pages.page_ref(p)
            low, high = pages.page_min[p].double(), pages.page_max[p].double()
            for head in (2 * ref.owner, 2 * ref.owner + 1):
                q = query[ref.layer, head].double()
                raw = float(q.clamp(min=0) @ high + q.clamp(max=0) @ low) * scale
                assert float(bounds[p, head]) == pytest.approx(raw, rel=1e-4, abs=1e-4)
                assert float(bounds[p, head]) >= raw


def test_midpoint_ranking_prefers_a_tight_hot_page_over_a_wide_box() -> None:
    keys = torch.zeros(1, 1, 8, 2)  # [L, H_kv, T, d_h]
    keys[0, 0, 2] = torch.tensor([2.0, 0.0])  # page 0 (2, 3): tight, centre logit high
    keys[0, 0, 3] = torch.tensor([2.0, 0.0])
    keys[0, 0, 4] = torch.tensor([5.0, 0.0])  # page 1 (4, 5): wide, one far key each way
    keys[0, 0, 5] = torch.tensor([-5.0, 0.0])
    pages = summarize_pages(keys, [[[0, 1, 6, 7]]], page_size=2)
    query = torch.tensor([[[1.0, 0.0]]])  # [L, H_q, d_h]
    r = torch.zeros(1, 1)
    bound = bound_omitted_mass(pages, query, r, [0], estimate=True)
    policy = RecallPolicy(threshold=0.0, max_pages_per_step=1)
    assert choose_pages(bound, policy).pages.tolist() == [1]  # the bound: the wide box
    assert choose_pages(bound, policy, Ranking.MIDPOINT).pages.tolist() == [0]
    assert bound.page_estimate is not None
    floor = float(bound.page_estimate[0]) + 1e-6  # above every page: nothing passes
    assert choose_pages(bound, policy, Ranking.MIDPOINT, floor).pages.numel() == 0
    dead = bound_omitted_mass(pages, query, r, [0], live=torch.tensor([False, True]),
                              estimate=True)
    assert choose_pages(dead, policy, Ranking.MIDPOINT).pages.tolist() == [1]


def test_midpoint_ranking_needs_the_estimate_and_the_floor_needs_the_midpoint() -> None:
    pages, query, head_to_owner = _two_owner_step()
    bound = bound_omitted_mass(pages, query, torch.zeros(1, 4), head_to_owner)
    policy = RecallPolicy(threshold=0.0, max_pages_per_step=1)
    with pytest.raises(BoundInputInvalid) as info:
        choose_pages(bound, policy, Ranking.MIDPOINT)
    assert info.value.field == "ranking"
    with pytest.raises(BoundInputInvalid) as info:
        choose_pages(bound, policy, Ranking.BOUND, -1.0)
    assert info.value.field == "min_estimate"
