"""SnapKV scoring and selection: the issue's exact example, brute-force equivalence, and errors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kvpolicy import allocation, snapkv
from services.kvpolicy.errors import SelectionError
from services.kvpolicy.ledger import ledger_for
from services.kvpolicy.manifest import (
    DType,
    GQAOrder,
    GQAReduction,
    KVVisibilityPolicyManifest,
    Pooling,
    ScoreAggregation,
    TensorContract,
    TieRule,
    default_manifests,
)
from services.kvpolicy.packing import pack

torch.set_num_threads(1)

TENSOR = TensorContract(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=3,
    k_dtype=DType.FLOAT16,
    v_dtype=DType.FLOAT16,
)
# Two observation queries (positions 4 and 5) over a 6-token prompt; the prefix vote of
# columns 0..3 is [0.175, 0.125, 1.000, 0.150].
QUERY_4 = [0.1, 0.05, 0.5, 0.05, 0.3, 0.0]
QUERY_5 = [0.075, 0.075, 0.5, 0.1, 0.1, 0.15]


def example_manifest(reduction: str = "mean") -> KVVisibilityPolicyManifest:
    data = default_manifests(TENSOR)["snapkv"].to_dict()
    data["selection"]["budget"] = {"scope": "owner", "rows_per_owner": 4, "fraction": None}
    data["selection"]["snapkv"] = {
        "observation_window": 2,
        "pooling": "avg",
        "pooling_kernel": 3,
        "aggregation": "sum",
        "gqa_reduction": reduction,
    }
    return KVVisibilityPolicyManifest.from_dict(data)


def example_obs_attn() -> torch.Tensor:
    per_head = torch.tensor([QUERY_4, QUERY_5])  # [W, T]
    return per_head.expand(2, 4, 2, 6).clone()  # [L, H_q, W, T]


def test_pooling_example_avg_kernel_3() -> None:
    vote = torch.tensor([0.175, 0.125, 1.000, 0.150])
    pooled = snapkv.pool_scores(vote, Pooling.AVG, 3)
    assert pooled.tolist() == pytest.approx([0.100000, 0.433333, 0.425000, 0.383333], abs=1e-6)
    assert snapkv.top_k_positions(pooled, 2) == [1, 2]


def test_max_pooling_ignores_padding() -> None:
    vote = torch.tensor([-1.0, -2.0, -3.0])
    assert snapkv.pool_scores(vote, Pooling.MAX, 3).tolist() == [-1.0, -1.0, -2.0]
    assert snapkv.pool_scores(vote, Pooling.AVG, 3).tolist() == pytest.approx(
        [-1.0, -2.0, -5.0 / 3]
    )


def test_avg_pooling_adds_each_window_left_to_right_at_every_size() -> None:
    # torch's strided window sum picks its summation order by the tensor's size; the pooling
    # must not: each output is (((v[t-2] + v[t-1]) + v[t]) + v[t+1]) + v[t+2] in float32
    # (zeros outside the row), at any shape, so equal inputs score equal everywhere.
    for shape in [(7,), (3, 4, 50), (24, 16, 16368)]:
        vote = torch.rand(shape, generator=torch.Generator().manual_seed(len(shape))) * 3
        padded = torch.nn.functional.pad(vote, (2, 2))
        length = shape[-1]
        columns = [padded[..., j : j + length] for j in range(5)]
        total = columns[0]
        for column in columns[1:]:
            total = total + column
        assert torch.equal(snapkv.pool_scores(vote, Pooling.AVG, 5), total / 5)


@pytest.mark.parametrize("n", [1, 2, 17, 1024, 16368])
def test_kth_largest_is_what_kthvalue_selects(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    rows = [
        torch.rand(n, generator=generator),
        torch.randint(0, 3, (n,), generator=generator).float(),  # ties everywhere
        torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), 2.5] * n)[:n],
    ]
    for row in rows:
        for k in sorted({1, max(1, n // 4), max(1, n // 2), n}):
            expected = torch.kthvalue(row, n - k + 1).values
            assert snapkv.kth_largest(row, k) == expected
            kept = snapkv.top_k_mask(row, k) if k < n else None
            if kept is not None:
                assert int(kept.count_nonzero()) == k
    half = torch.rand(64, generator=generator).to(torch.bfloat16)  # numpy has no bfloat16
    assert snapkv.kth_largest(half, 5) == torch.kthvalue(half, 60).values


def test_issue_example_end_to_end() -> None:
    manifest = example_manifest()
    scores = snapkv.score(manifest, example_obs_attn(), 6)
    assert tuple(scores.shape) == (2, 2, 4)
    assert scores[0, 0].tolist() == pytest.approx(
        [0.100000, 0.433333, 0.425000, 0.383333], abs=1e-6
    )
    budgets = allocation.allocate(manifest, 6, scores)
    assert budgets == ((2, 2), (2, 2))
    selected = snapkv.select(manifest, scores, budgets, 6)
    assert selected == (((1, 2, 4, 5),) * 2,) * 2
    k = torch.arange(2 * 2 * 6 * 3, dtype=torch.float16).view(2, 2, 6, 3)
    view = pack(k, k + 1, selected)
    assert view.original_position_map.tolist() == [1, 2, 4, 5] * 4
    assert snapkv.protected_positions(manifest, 6) == (4, 5)
    ledger = ledger_for(manifest, 6, selected)
    assert (ledger.full_payload_bytes, ledger.visible_payload_bytes) == (288, 192)


def test_issue_example_stored_at_query_head_width() -> None:
    manifest = example_manifest("expand")
    scores = snapkv.score(manifest, example_obs_attn(), 6)
    assert tuple(scores.shape) == (2, 4, 4)
    budgets = allocation.allocate(manifest, 6, scores)
    selected = snapkv.select(manifest, scores, budgets, 6)
    assert selected == (((1, 2, 4, 5),) * 4,) * 2
    ledger = ledger_for(manifest, 6, selected)
    assert ledger.owners_are_query_heads
    assert (ledger.full_payload_bytes, ledger.visible_payload_bytes) == (576, 384)
    assert ledger.unique_kv_rows == 2 * 2 * 4  # query heads of one K/V head chose the same rows
    k = torch.zeros(2, 2, 6, 3, dtype=torch.float16)
    assert pack(k, k, selected, owner_to_kv_head=manifest.owner_to_kv_head()).total_rows == 32


def test_observation_attention_is_causal_fp32_softmax() -> None:
    torch.manual_seed(0)
    q = torch.randn(4, 3, 5, dtype=torch.float16)  # [H_q, W, d_h]
    k = torch.randn(2, 7, 5, dtype=torch.float16)  # [H_kv, T, d_h]
    head_map = [0, 0, 1, 1]
    attn = snapkv.observation_attention(q, k, head_map)
    assert attn.dtype == torch.float32 and tuple(attn.shape) == (4, 3, 7)
    for h in range(4):
        for i in range(3):
            visible = 7 - 3 + i + 1
            logits = (q[h, i].double() @ k[head_map[h], :visible].double().T) / math.sqrt(5)
            expected = torch.softmax(logits, dim=0)
            assert attn[h, i, :visible].double().tolist() == pytest.approx(
                expected.tolist(), abs=1e-6
            )
            assert attn[h, i, visible:].tolist() == [0.0] * (7 - visible)


def test_tie_rules() -> None:
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert snapkv.top_k_positions(scores, 2, TieRule.POSITION_ASCENDING) == [0, 1]
    assert snapkv.top_k_positions(scores, 2, TieRule.POSITION_DESCENDING) == [1, 2]
    assert snapkv.top_k_positions(scores, 0) == []
    assert snapkv.top_k_positions(scores, 9) == [0, 1, 2, 3]


def test_sinks_and_suffix_are_retained_outside_the_budget() -> None:
    scores = torch.tensor([[[9.0, 0.0, 5.0, 1.0, 4.0]]])  # [1, 1, T_p = 5]
    selected = snapkv.select_snapkv(scores, [[2]], window=3, prompt_len=8, sinks=1)
    assert selected == (((0, 2, 4, 5, 6, 7),),)


def test_short_prompt_is_kept_whole() -> None:
    manifest = example_manifest()  # capacity 4
    attn = example_obs_attn()[..., 2:]  # T = 4, window 2
    scores = snapkv.score(manifest, attn, 4)
    budgets = allocation.allocate(manifest, 4, scores)
    assert budgets == ((2, 2), (2, 2))
    assert snapkv.select(manifest, scores, budgets, 4) == (((0, 1, 2, 3),) * 2,) * 2


def test_prompt_shorter_than_the_window_is_kept_whole() -> None:
    manifest = example_manifest()
    attn = torch.full((2, 4, 1, 1), 1.0)  # T = 1: the window is the whole prompt
    scores = snapkv.score(manifest, attn, 1)
    assert tuple(scores.shape) == (2, 2, 0)
    budgets = allocation.allocate(manifest, 1, scores)
    assert snapkv.select(manifest, scores, budgets, 1) == (((0,),) * 2,) * 2
    assert snapkv.protected_positions(manifest, 1) == (0,)


# --- brute force ----------------------------------------------------------------------


def brute_force(
    raw: list[list[list[list[Fraction]]]],  # [L][H_q][W][T]
    prompt_len: int,
    window: int,
    pooling: Pooling,
    kernel: int,
    aggregation: ScoreAggregation,
    reduction: GQAReduction,
    head_map: list[int],
    budgets: list[list[int]],
    tie_rule: TieRule,
    sinks: int,
    order: GQAOrder = GQAOrder.POOL_THEN_REDUCE,
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    prefix = prompt_len - window
    owner_score = brute_force_scorer(
        raw, prompt_len, window, pooling, kernel, aggregation, reduction, head_map, order
    )
    first = min(sinks, prefix)
    out = []
    for layer, layer_budgets in enumerate(budgets):
        row = []
        for owner, budget in enumerate(layer_budgets):
            sign = 1 if tie_rule is TieRule.POSITION_ASCENDING else -1

            def rank(
                p: int, layer: int = layer, owner: int = owner, sign: int = sign
            ) -> tuple[Fraction, int]:
                return -owner_score(layer, owner, p), sign * p

            ranked = sorted(range(first, prefix), key=rank)
            row.append(
                tuple(
                    sorted(list(range(first)) + ranked[:budget] + list(range(prefix, prompt_len)))
                )
            )
        out.append(tuple(row))
    return tuple(out)


def brute_force_scorer(
    raw: list[list[list[list[Fraction]]]],  # [L][H_q][W][T]
    prompt_len: int,
    window: int,
    pooling: Pooling,
    kernel: int,
    aggregation: ScoreAggregation,
    reduction: GQAReduction,
    head_map: list[int],
    order: GQAOrder,
) -> Callable[[int, int, int], Fraction]:
    """score(layer, owner, t) in exact arithmetic, one formula per step, in `order`."""
    prefix = prompt_len - window
    pad = kernel // 2

    def vote(layer: int, q: int, t: int) -> Fraction:
        total = sum((raw[layer][q][w][t] for w in range(window)), Fraction(0))
        return total if aggregation is ScoreAggregation.SUM else total / window

    def pool(series: Callable[[int], Fraction], t: int) -> Fraction:
        if pooling is Pooling.NONE:
            return series(t)
        near = [series(j) for j in range(t - pad, t + pad + 1) if 0 <= j < prefix]
        return sum(near, Fraction(0)) / kernel if pooling is Pooling.AVG else max(near)

    def reduce(members: list[Fraction]) -> Fraction:
        if reduction is GQAReduction.MEAN:
            return sum(members, Fraction(0)) / len(members)
        return max(members)

    def group(owner: int) -> list[int]:
        return [owner] if reduction is GQAReduction.EXPAND else [
            q for q, kv in enumerate(head_map) if kv == owner]

    def pool_then_reduce(layer: int, owner: int, t: int) -> Fraction:
        return reduce([pool(lambda j, q=q: vote(layer, q, j), t) for q in group(owner)])

    def reduce_then_pool(layer: int, owner: int, t: int) -> Fraction:
        return pool(lambda j: reduce([vote(layer, q, j) for q in group(owner)]), t)

    return pool_then_reduce if order is GQAOrder.POOL_THEN_REDUCE else reduce_then_pool


@st.composite
def snapkv_case(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 3))
    q_heads = draw(st.integers(kv_heads, 6))
    extra = draw(
        st.lists(
            st.integers(0, kv_heads - 1), min_size=q_heads - kv_heads, max_size=q_heads - kv_heads
        )
    )
    head_map = draw(st.permutations(list(range(kv_heads)) + extra))
    prompt_len = draw(st.integers(2, 10))
    window = draw(st.integers(1, prompt_len - 1))
    pooling = draw(st.sampled_from(list(Pooling)))
    kernel = 1 if pooling is Pooling.NONE else draw(st.sampled_from([1, 3, 5]))
    reduction = draw(st.sampled_from(list(GQAReduction)))
    owners = q_heads if reduction is GQAReduction.EXPAND else kv_heads
    ints = st.integers(0, 3)  # few distinct values: ties are common
    raw = [
        [[[draw(ints) for _ in range(prompt_len)] for _ in range(window)] for _ in range(q_heads)]
        for _ in range(layers)
    ]
    return {
        "layers": layers,
        "head_map": list(head_map),
        "prompt_len": prompt_len,
        "window": window,
        "pooling": pooling,
        "kernel": kernel,
        "aggregation": draw(st.sampled_from(list(ScoreAggregation))),
        "reduction": reduction,
        "tie_rule": draw(st.sampled_from(list(TieRule))),
        "order": draw(st.sampled_from(list(GQAOrder))),
        "sinks": draw(st.integers(0, 2)),
        "budgets": [
            [draw(st.integers(0, prompt_len)) for _ in range(owners)] for _ in range(layers)
        ],
        "raw": raw,
    }


@settings(max_examples=50, deadline=None)
@given(snapkv_case())
def test_selection_equals_brute_force_including_gqa_and_ties(case: dict[str, Any]) -> None:
    head_map = case["head_map"]
    group_sizes = [head_map.count(kv) for kv in set(head_map)]
    # Scale so every float32 operation in the pipeline is exact: ties stay ties.
    scale = Fraction(case["kernel"] * case["window"] * math.lcm(*group_sizes), 64)
    exact = [
        [[[scale * x for x in row] for row in head] for head in layer] for layer in case["raw"]
    ]
    attn = torch.tensor(
        [[[[float(x) for x in row] for row in head] for head in layer] for layer in exact]
    )
    scores = snapkv.snapkv_scores(
        attn,
        case["prompt_len"],
        case["window"],
        case["pooling"],
        case["kernel"],
        case["aggregation"],
        case["reduction"],
        head_map,
        case["order"],
    )
    selected = snapkv.select_snapkv(
        scores, case["budgets"], case["window"], case["prompt_len"], case["tie_rule"], case["sinks"]
    )
    expected = brute_force(
        exact,
        case["prompt_len"],
        case["window"],
        case["pooling"],
        case["kernel"],
        case["aggregation"],
        case["reduction"],
        head_map,
        case["budgets"],
        case["tie_rule"],
        case["sinks"],
        case["order"],
    )
    assert selected == expected


ORDER_CASES = [
    (GQAReduction.MEAN, Pooling.AVG, False),
    (GQAReduction.MAX, Pooling.MAX, False),
    (GQAReduction.MAX, Pooling.AVG, True),
    (GQAReduction.MEAN, Pooling.MAX, True),
]


@pytest.mark.parametrize(("reduction", "pooling", "differ"), ORDER_CASES)
def test_gqa_order_both_orders_match_brute_force_and_differ_exactly_where_declared(
    reduction: GQAReduction, pooling: Pooling, differ: bool
) -> None:
    """Two query heads per K/V head with votes peaked at adjacent positions: max pooling of
    the group mean is not the mean of the max-pooled heads, and the max over the group of the
    avg-pooled heads is not the avg pooling of the group max."""
    head_map, window, prompt_len, kernel = [0, 0, 1, 1], 1, 9, 3
    peaks = [1, 2, 5, 6]  # the query heads' peak positions: a group's two peaks are adjacent
    exact = [[[[Fraction(8 if t == peak else t % 3, 8) for t in range(prompt_len)]]
              for peak in peaks]]  # [L=1][H_q][W=1][T], multiples of 1/8: float32-exact
    attn = torch.tensor([[[[float(x) for x in row] for row in head] for head in exact[0]]])
    scores = {
        order: snapkv.snapkv_scores(attn, prompt_len, window, pooling, kernel,
                                    ScoreAggregation.SUM, reduction, head_map, order)
        for order in GQAOrder
    }
    prefix = prompt_len - window
    for order, got in scores.items():
        reference = brute_force_scorer(exact, prompt_len, window, pooling, kernel,
                                       ScoreAggregation.SUM, reduction, head_map, order)
        want = [[[float(reference(0, owner, t)) for t in range(prefix)] for owner in range(2)]]
        torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)
    orders_differ = not torch.allclose(*scores.values())
    assert orders_differ is differ
    params = example_manifest(reduction.value).selection.snapkv
    assert params is not None
    assert dataclasses.replace(params, pooling=pooling).orders_differ is differ


# --- errors ----------------------------------------------------------------------------


def test_scores_reject_wrong_shapes_and_values() -> None:
    attn = example_obs_attn()
    head_map = [0, 0, 1, 1]
    args = (Pooling.AVG, 3, ScoreAggregation.SUM, GQAReduction.MEAN)
    cases = [
        (lambda: snapkv.snapkv_scores(attn[0], 6, 2, *args, head_map), "obs_attn"),
        (lambda: snapkv.snapkv_scores(attn, 7, 2, *args, head_map), "obs_attn"),
        (lambda: snapkv.snapkv_scores(attn, 6, 3, *args, head_map), "obs_attn"),
        (
            lambda: snapkv.snapkv_scores(attn, 6, 0, *args, head_map),
            "selection.snapkv.observation_window",
        ),
        (lambda: snapkv.snapkv_scores(-attn, 6, 2, *args, head_map), "obs_attn"),
        (lambda: snapkv.snapkv_scores(attn * float("nan"), 6, 2, *args, head_map), "obs_attn"),
        (lambda: snapkv.snapkv_scores(attn, 6, 2, *args, [0, 0, 1]), "q_to_kv_head_map"),
        (lambda: snapkv.snapkv_scores(attn, 6, 2, *args, [0, 0, 2, 2]), "q_to_kv_head_map"),
        (
            lambda: snapkv.snapkv_scores([attn[0], attn[1, :, :1]], 6, 2, *args, head_map),
            "obs_attn",
        ),
        (lambda: snapkv.snapkv_scores([], 6, 2, *args, head_map), "obs_attn"),
        (
            lambda: snapkv.pool_scores(torch.zeros(4), Pooling.AVG, 2),
            "selection.snapkv.pooling_kernel",
        ),
        (
            lambda: snapkv.observation_attention(
                torch.zeros(4, 3, 2), torch.zeros(2, 2, 2), head_map
            ),
            "q_window",
        ),
        (
            lambda: snapkv.observation_attention(
                torch.zeros(4, 1, 2), torch.zeros(2, 2, 2), [0, 1, 2, 3]
            ),
            "q_to_kv_head_map",
        ),
    ]
    for call, field in cases:
        with pytest.raises(SelectionError) as info:
            call()
        assert info.value.field == field


def test_select_rejects_bad_scores_and_budgets() -> None:
    scores = torch.zeros(1, 2, 4)
    cases = [
        (lambda: snapkv.select_snapkv(scores, [[1, 1]], 2, 7), "scores"),
        (
            lambda: snapkv.select_snapkv(scores, [[1, 1]], 0, 4),
            "selection.snapkv.observation_window",
        ),
        (lambda: snapkv.select_snapkv(scores * float("nan"), [[1, 1]], 2, 6), "scores"),
        (lambda: snapkv.select_snapkv(scores, [[1]], 2, 6), "budgets"),
        (lambda: snapkv.select_snapkv(scores, [[1, -1]], 2, 6), "budgets"),
        (lambda: snapkv.select_snapkv(scores, [[1, 1.5]], 2, 6), "budgets"),  # type: ignore[list-item]
    ]
    for call, field in cases:
        with pytest.raises(SelectionError) as info:
            call()
        assert info.value.field == field


def test_manifest_helpers_refuse_non_snapkv_policies() -> None:
    window = default_manifests(TENSOR)["window"]
    with pytest.raises(SelectionError) as info:
        snapkv.score(window, example_obs_attn(), 6)
    assert info.value.field == "selection.method"
