"""The goal checker on synthetic numbers: each of the issue's four goals passes, fails and is
N/A exactly where its definition says (a pure function of the records)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.benchmark.config import GoalSpec
from services.benchmark.goals import FAIL, NOT_MEASURED, PASS, check_goals
from services.benchmark.results import (
    KVPRESS,
    KVRELAY_FULL,
    KVRELAY_SNAPKV,
    TRANSFORMERS,
    DecodeRun,
    PhaseMemory,
)

SPEC = GoalSpec(model="large", decode_context=16384, decode_budget=0.10, overhead_context=16384)
MEMORY = PhaseMemory(start=1, peak=2, scope="phase")


def run(
    engine: str,
    ms: float,
    context: int = 16384,
    budget: float = 1.0,
    model: str = "large",
    prefill_s: float = 10.0,
    compression_s: dict[str, float] | None = None,
) -> DecodeRun:
    # one slow warm-up step that the median must ignore, then three steps of `ms`
    return DecodeRun(
        model=model,
        engine=engine,
        context=context,
        budget=budget,
        prefill_s=prefill_s,
        step_s=(1.0, ms / 1000, ms / 1000, ms / 1000),
        warmup_steps=1,
        tokens=(1, 2, 3, 4, 5),
        kept_rows=10,
        kv_bytes=100,
        prefill_memory=MEMORY,
        decode_memory=MEMORY,
        compression_s=compression_s or {},
    )


def snapkv(
    ms: float, budget: float = 0.10, context: int = 16384, overhead_s: float = 0.1
) -> DecodeRun:
    stages = {
        "score": overhead_s / 2,
        "allocate": 0.0,
        "select": overhead_s / 4,
        "pack": overhead_s / 4,
    }
    return run(KVRELAY_SNAPKV, ms, context, budget, compression_s=stages)


def statuses(runs: list[DecodeRun], transfer: float | None = 0.8) -> list[str]:
    return [verdict.status for verdict in check_goals(SPEC, runs, transfer)]


def test_warmup_steps_are_left_out_of_the_median() -> None:
    assert run(KVRELAY_FULL, 40.0).ms_per_token == pytest.approx(40.0)
    assert run(KVRELAY_FULL, 40.0).tokens_per_s == pytest.approx(25.0)


def test_everything_met_passes_every_goal() -> None:
    runs = [
        run(KVRELAY_FULL, 100.0),
        snapkv(20.0),
        run(KVPRESS, 30.0, budget=0.10),
        run(TRANSFORMERS, 110.0),
        run(KVRELAY_FULL, 10.0, context=1024),
        run(TRANSFORMERS, 10.0, context=1024),
    ]
    verdicts = check_goals(SPEC, runs, 0.5)
    assert [v.status for v in verdicts] == [PASS] * 4
    assert "5.00x" in verdicts[0].detail and "1.50x" in verdicts[0].detail
    assert "T=1024: 1.00" in verdicts[1].detail and "T=16384: 0.91" in verdicts[1].detail
    assert "1.00%" in verdicts[2].detail and "0.50" in verdicts[3].detail


@pytest.mark.parametrize(
    ("snap_ms", "press_ms", "expected"),
    [
        (25.0, 30.0, PASS),
        (25.5, 30.0, FAIL),
        (20.0, 20.0, FAIL),
        (20.0, None, NOT_MEASURED),
        (30.0, None, FAIL),
    ],
)
def test_decode_goal_needs_the_speedup_and_to_beat_kvpress(
    snap_ms: float, press_ms: float | None, expected: str
) -> None:
    runs = [run(KVRELAY_FULL, 100.0), snapkv(snap_ms)]
    if press_ms is not None:
        runs.append(run(KVPRESS, press_ms, budget=0.10))
    assert statuses(runs)[0] == expected


def test_decode_goal_is_not_measured_without_the_goal_context_or_budget() -> None:
    runs = [
        run(KVRELAY_FULL, 100.0, context=4096),
        snapkv(10.0, context=4096),
        snapkv(10.0, budget=0.25),
    ]
    assert statuses(runs)[0] == NOT_MEASURED


def test_full_cache_goal_fails_when_any_context_is_slower_than_transformers() -> None:
    runs = [
        run(KVRELAY_FULL, 10.0, context=1024),
        run(TRANSFORMERS, 12.0, context=1024),
        run(KVRELAY_FULL, 101.0),
        run(TRANSFORMERS, 100.0),
    ]
    assert statuses(runs)[1] == FAIL
    other_model = [run(KVRELAY_FULL, 50.0, model="demo"), run(TRANSFORMERS, 10.0, model="demo")]
    assert statuses(other_model)[1] == NOT_MEASURED


def test_overhead_goal_takes_the_worst_budget_and_allows_exactly_the_limit() -> None:
    at_limit = [snapkv(20.0, budget=0.10, overhead_s=0.5), snapkv(20.0, budget=0.5, overhead_s=0.2)]
    assert statuses(at_limit)[2] == PASS  # 0.5 s of a 10 s prefill = 5%
    over = [snapkv(20.0, budget=0.10, overhead_s=0.2), snapkv(20.0, budget=0.5, overhead_s=0.51)]
    verdict = check_goals(SPEC, over, 0.8)[2]
    assert verdict.status == FAIL and "budget 50%" in verdict.detail
    full_view_only = [snapkv(20.0, budget=1.0, overhead_s=5.0)]
    assert statuses(full_view_only)[2] == NOT_MEASURED


def test_transfer_goal() -> None:
    assert statuses([], 0.5)[3] == PASS
    assert statuses([], 0.49)[3] == FAIL
    assert statuses([], None)[3] == NOT_MEASURED


def test_a_zero_context_means_the_goal_models_longest_measured_context() -> None:
    longest = GoalSpec(model="large", decode_context=0, decode_budget=0.10, overhead_context=0)
    runs = [run(KVRELAY_FULL, 100.0, context=4096), snapkv(20.0, context=4096),
            run(KVPRESS, 30.0, context=4096, budget=0.10), run(KVRELAY_FULL, 10.0, context=1024),
            run(KVRELAY_FULL, 10.0, context=8192, model="demo")]  # another model's context
    verdicts = check_goals(longest, runs, 0.8)
    assert [v.status for v in verdicts][:3] == [PASS, NOT_MEASURED, PASS]
    assert "T=4096" in verdicts[0].goal and "T=4096" in verdicts[2].goal
    unmeasured = check_goals(replace(longest, model="absent"), runs, 0.8)
    assert [v.status for v in unmeasured][:3] == [NOT_MEASURED] * 3
