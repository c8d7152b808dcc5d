"""Allocation: exact PyramidKV / ZigZagKV values, Ada-KV and HeadKV, apportionment properties."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.kvpolicy import allocation
from services.kvpolicy.errors import AllocationError
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)

torch.set_num_threads(1)

TENSOR = TensorContract(
    num_layers=3,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=4,
    k_dtype=DType.FLOAT16,
    v_dtype=DType.FLOAT16,
)


def test_pyramidkv_example() -> None:
    targets = allocation.pyramid_layer_targets(12, 3, 2.0)
    assert targets == [6, 4, 2]
    assert allocation.apportion(targets, 12) == (6, 4, 2)
    assert allocation.pyramid_layer_targets(7, 1, 20.0) == [7]


def test_zigzagkv_example() -> None:
    b_mean, m = 4, 3
    targets = allocation.zigzag_layer_targets(b_mean * m, [6, 4, 2], b_min=1)
    assert targets == [Fraction(11, 2), 4, Fraction(5, 2)]
    assert [float(t) for t in targets] == [5.5, 4.0, 2.5]
    assert allocation.apportion(targets, 12) == (6, 4, 2)


def test_zigzagkv_rejects_floors_above_total() -> None:
    with pytest.raises(AllocationError) as info:
        allocation.zigzag_layer_targets(5, [1, 1, 1], b_min=2)
    assert info.value.field == "selection.allocation.b_min"


def test_layer_min_budget_counts_rows_to_cover_the_mass() -> None:
    scores = torch.tensor(
        [
            [[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]],
            [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
        ]
    )
    assert allocation.layer_min_budget(scores, 0.8) == [(2 + 4) / 2, (1 + 0) / 2]


def test_adakv_raw_counts_and_safeguard() -> None:
    layer = torch.tensor([[0.9, 0.8, 0.7, 0.0], [0.1, 0.1, 0.1, 0.1]])  # [H, T_p]
    assert allocation.adakv_raw_counts(layer, 4) == [3, 1]  # ties at 0.1: lowest position first
    assert allocation.adakv_layer_budgets(layer, 4, uniform_share=0.0) == (3, 1)
    assert allocation.adakv_layer_budgets(layer, 4, uniform_share=1.0) == (2, 2)
    assert allocation.adakv_layer_budgets(layer, 4, uniform_share=0.5) == (
        3,
        1,
    )  # 2.5 / 1.5: tie -> lower index
    assert allocation.adakv_layer_budgets(layer, 4, uniform_share=0.0, floor=2) == (2, 2)


def test_adakv_worked_example_uniform_share_is_one_minus_the_papers_alpha() -> None:
    """Raw counts [[2,4],[3,1],[2,0]] for layer totals [6,4,2], uniform share 0.25 (the Ada-KV
    paper's alpha 0.75), a one-row floor, exact integer conservation: [[2,4],[3,1],[1,1]]."""
    raw, totals, share = [[2, 4], [3, 1], [2, 0]], [6, 4, 2], 0.25
    budgets = [
        allocation.adakv_budgets_from_counts(counts, total, uniform_share=share, floor=1)
        for counts, total in zip(raw, totals, strict=True)
    ]
    assert budgets == [(2, 4), (3, 1), (1, 1)]
    assert [sum(b) for b in budgets] == totals
    # The paper's targets alpha B_i* + (1 - alpha) B/H with alpha = 1 - share: layer 0
    # [2.25, 3.75], layer 1 [2.75, 1.25], layer 2 [1.75, 0.25] (the floor lifts it to [1, 1]).
    alpha = Fraction(1) - Fraction(share)
    for counts, total in zip(raw, totals, strict=True):
        paper = [alpha * r + (1 - alpha) * Fraction(total, len(counts)) for r in counts]
        for floor in (0, 1):
            assert allocation.adakv_budgets_from_counts(
                counts, total, uniform_share=share, floor=floor
            ) == allocation.apportion(paper, total, [floor] * len(counts))
    assert allocation.adakv_budgets_from_counts([2, 0], 2, uniform_share=share) == (2, 0)


def test_headkv_base_plus_pool_share() -> None:
    profile = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    # b = 4, beta = 2: base 2 each, pool 8 split 1/4, 0, 0, 3/4.
    assert allocation.headkv_budgets(profile, base=4, beta=2.0) == ((4, 2), (2, 8))
    assert allocation.headkv_budgets(torch.zeros(2, 2), base=4, beta=2.0) == ((4, 4), (4, 4))


def test_apportion_floors_caps_and_zero_weights() -> None:
    assert allocation.apportion([1, 1, 1], 10) == (4, 3, 3)
    assert allocation.apportion([5, 1, 1], 9, caps=[3, None, None]) == (3, 3, 3)
    assert allocation.apportion([0, 0, 1], 5, floors=[1, 1, 0], caps=[2, 2, 1]) == (2, 2, 1)
    assert allocation.apportion([0, 0, 0], 4) == (2, 1, 1)
    assert allocation.apportion([], 0) == ()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"weights": [1, 1], "total": 3, "floors": [2, 2]}, "floors"),
        ({"weights": [1, 1], "total": 5, "caps": [2, 2]}, "caps"),
        ({"weights": [1, 1], "total": 2, "floors": [2, 0], "caps": [1, 4]}, "caps"),
        ({"weights": [1, -1], "total": 2}, "weights"),
        ({"weights": [1, float("inf")], "total": 2}, "weights"),
        ({"weights": [1, 1], "total": -1}, "total"),
        ({"weights": [1, 1], "total": 2, "floors": [0]}, "floors"),
        ({"weights": [1, 1], "total": 2, "floors": [-1, 0]}, "floors"),
        ({"weights": [], "total": 2}, "total"),
    ],
)
def test_apportion_rejects_impossible_requests(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(AllocationError) as info:
        allocation.apportion(**kwargs)
    assert info.value.field == field


def reference_targets(
    weights: list[int], total: int, floors: list[int], caps: list[int]
) -> list[float]:
    """Brute-force water level by bisection (all caps finite, at least one positive weight)."""

    def level_sum(lam: float) -> float:
        return sum(min(max(lam * w, f), c) for w, f, c in zip(weights, floors, caps, strict=True))

    lo, hi = 0.0, float(max(caps) + 1)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if level_sum(mid) < total else (lo, mid)
    return [min(max(hi * w, f), c) for w, f, c in zip(weights, floors, caps, strict=True)]


@st.composite
def apportion_case(draw: st.DrawFn) -> tuple[list[int], int, list[int], list[int]]:
    n = draw(st.integers(1, 8))
    weights = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    floors = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    caps = [f + draw(st.integers(0, 10)) for f in floors]
    total = draw(st.integers(sum(floors), sum(caps)))
    return weights, total, floors, caps


@settings(max_examples=50, deadline=None)
@given(apportion_case())
def test_apportion_conserves_and_respects_bounds(
    case: tuple[list[int], int, list[int], list[int]],
) -> None:
    weights, total, floors, caps = case
    result = allocation.apportion(weights, total, floors, caps)
    assert sum(result) == total
    assert all(f <= x <= c for x, f, c in zip(result, floors, caps, strict=True))
    for x, t in zip(result, reference_targets(weights, total, floors, caps), strict=True):
        assert (
            abs(x - t) < 1 + 1e-6
        )  # largest remainder never moves an entry a whole unit off its target


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=10),
    st.integers(0, 60),
    st.integers(0, 3),
)
def test_apportion_with_floors_only_is_exact_and_monotone(
    weights: list[float], total: int, floor: int
) -> None:
    assume(floor * len(weights) <= total)
    result = allocation.apportion(weights, total, [floor] * len(weights))
    assert sum(result) == total and min(result) >= floor
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] > weights[j]:
                assert result[i] >= result[j]


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(0, 200), st.floats(1, 30, allow_nan=False))
def test_pyramid_targets_conserve_and_descend(layers: int, total: int, beta: float) -> None:
    targets = allocation.pyramid_layer_targets(total, layers, beta)
    assert sum(targets) == total
    assert all(a >= b for a, b in zip(targets, targets[1:], strict=False))
    assert sum(allocation.apportion(targets, total)) == total


# --- allocate(): the manifest-level entry point -----------------------------------------


def manifest_with(
    allocation_spec: dict[str, Any], scope: str, window: int = 2, rows: int = 6, sinks: int = 0
) -> KVVisibilityPolicyManifest:
    data = default_manifests(TENSOR)["snapkv"].to_dict()
    data["selection"]["budget"] = {"scope": scope, "rows_per_owner": rows, "fraction": None}
    data["selection"]["snapkv"]["observation_window"] = window
    data["selection"]["protected"]["sinks"] = sinks
    data["selection"]["allocation"] = allocation_spec
    return KVVisibilityPolicyManifest.from_dict(data)


def random_scores(prompt_len: int, window: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(3, 2, prompt_len - window, generator=generator)  # [L, H_kv, T_p]


@pytest.mark.parametrize(
    ("spec", "scope"),
    [
        ({"method": "uniform"}, "owner"),
        ({"method": "pyramidkv", "beta": 5.0}, "global"),
        ({"method": "adakv", "uniform_share": 0.2}, "layer"),
        ({"method": "zigzagkv", "b_min": 2, "coverage": 0.9}, "global"),
        ({"method": "pyramidkv", "beta": 5.0, "floor_rows": 1, "cap_rows": 5}, "global"),
    ],
)
def test_allocate_conserves_the_total_for_every_method(spec: dict[str, Any], scope: str) -> None:
    manifest = manifest_with(spec, scope, sinks=1)
    scores = random_scores(40, 2)
    budgets = allocation.allocate(manifest, 40, scores)
    per_owner = 6 - 2 - 1
    assert allocation.selection_budget_per_owner(manifest, 40) == per_owner
    assert sum(map(sum, budgets)) == 3 * 2 * per_owner
    assert all(0 <= b <= 40 - 2 - 1 for layer in budgets for b in layer)
    if scope == "owner":
        assert budgets == ((per_owner,) * 2,) * 3
    if scope == "layer":
        assert all(sum(layer) == 2 * per_owner for layer in budgets)


def test_allocate_pyramid_shape() -> None:
    manifest = manifest_with({"method": "pyramidkv", "beta": 2.0}, "global", rows=6)
    budgets = allocation.allocate(manifest, 40)
    # total 3 layers * 2 owners * 4 = 24; layer targets [12, 8, 4] split over 2 owners.
    assert budgets == ((6, 6), (4, 4), (2, 2))


def test_allocate_keeps_short_prompts_whole() -> None:
    manifest = manifest_with({"method": "pyramidkv", "beta": 2.0}, "global", rows=6, sinks=1)
    assert allocation.allocate(manifest, 6) == ((3, 3),) * 3
    assert allocation.allocate(manifest, 1) == ((0, 0),) * 3


def test_allocate_headkv_checks_the_profile_digest() -> None:
    profile = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]])
    spec = {
        "method": "headkv",
        "beta": 2.0,
        "headkv_profile_sha256": allocation.profile_sha256(profile),
    }
    manifest = manifest_with(spec, "global")
    budgets = allocation.allocate(manifest, 40, head_profile=profile)
    assert sum(map(sum, budgets)) == 24
    assert budgets[1][1] == max(b for layer in budgets for b in layer)
    with pytest.raises(AllocationError) as info:
        allocation.allocate(manifest, 40, head_profile=profile * 2)
    assert info.value.field == "selection.allocation.headkv_profile_sha256"
    with pytest.raises(AllocationError) as missing:
        allocation.allocate(manifest, 40)
    assert missing.value.field == "head_profile"
    with pytest.raises(AllocationError) as shape:
        allocation.allocate(manifest, 40, head_profile=profile[:2])
    assert shape.value.field == "head_profile"


@pytest.mark.parametrize(
    ("spec", "scope", "field"),
    [
        ({"method": "pyramidkv", "beta": 5.0, "floor_rows": 5}, "global",
         "selection.allocation.floor_rows"),
        ({"method": "pyramidkv", "beta": 5.0, "cap_rows": 2}, "global",
         "selection.allocation.cap_rows"),
    ],
)
def test_allocate_reports_infeasible_floors_and_caps(
    spec: dict[str, Any], scope: str, field: str
) -> None:
    with pytest.raises(AllocationError) as info:
        allocation.allocate(manifest_with(spec, scope), 40)
    assert info.value.field == field


def test_allocate_needs_scores_for_score_driven_methods() -> None:
    manifest = manifest_with({"method": "adakv", "uniform_share": 0.2}, "layer")
    with pytest.raises(AllocationError) as missing:
        allocation.allocate(manifest, 40)
    assert missing.value.field == "scores"
    with pytest.raises(AllocationError) as wrong:
        allocation.allocate(manifest, 40, random_scores(41, 2))
    assert wrong.value.field == "scores"


def test_allocate_refuses_static_policies() -> None:
    with pytest.raises(AllocationError) as info:
        allocation.allocate(default_manifests(TENSOR)["window"], 40)
    assert info.value.field == "selection.method"


def test_pyramid_and_headkv_reject_beta_below_one() -> None:
    with pytest.raises(AllocationError):
        allocation.pyramid_layer_targets(10, 2, 0.5)
    with pytest.raises(AllocationError):
        allocation.headkv_budgets(torch.ones(1, 2), base=2, beta=0.5)
