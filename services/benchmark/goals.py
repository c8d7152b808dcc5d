"""The issue's four goals, checked on measured numbers (pure: records in, verdicts out).

1. decode at `decode_context` with `decode_budget`: >= `min_speedup_vs_full` x faster per
   token than kvrelay's own full-cache decode, and faster than kvpress at the same ratio;
2. kvrelay full-cache decode no slower than transformers' generation (every measured context);
3. compression overhead (score+allocate+select+pack over prefill) at `overhead_context`
   at most `max_compression_overhead` (worst budget);
4. gloo transfer at least `min_transfer_ratio` of the loopback socket copy's bytes/s.
A goal whose numbers were not measured in this run is N/A, never PASS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from services.benchmark.config import GoalSpec
from services.benchmark.results import (
    KVPRESS,
    KVRELAY_FULL,
    KVRELAY_SNAPKV,
    TRANSFORMERS,
    DecodeRun,
    GoalVerdict,
)

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "N/A"


def check_goals(
    spec: GoalSpec, runs: Sequence[DecodeRun], transfer_ratio: float | None
) -> tuple[GoalVerdict, ...]:
    spec = at_measured_contexts(spec, runs)
    return (
        decode_speed(spec, runs),
        full_cache_vs_transformers(spec, runs),
        compression_overhead(spec, runs),
        transfer(spec, transfer_ratio),
    )


def at_measured_contexts(spec: GoalSpec, runs: Sequence[DecodeRun]) -> GoalSpec:
    """`spec` with each context of 0 replaced by the goal model's longest measured context
    (unchanged when that model was not measured: its goals stay N/A)."""
    contexts = [r.context for r in runs if r.model == spec.model]
    if not contexts:
        return spec
    longest = max(contexts)
    return replace(
        spec,
        decode_context=spec.decode_context or longest,
        overhead_context=spec.overhead_context or longest,
    )


def find(
    runs: Sequence[DecodeRun], model: str, engine: str, context: int, budget: float
) -> DecodeRun | None:
    """The run of (model, engine, context, budget), if measured."""
    for run in runs:
        if (run.model, run.engine, run.context) == (model, engine, context) and math.isclose(
            run.budget, budget
        ):
            return run
    return None


def decode_speed(spec: GoalSpec, runs: Sequence[DecodeRun]) -> GoalVerdict:
    name = (
        f"decode at T={spec.decode_context}, budget {spec.decode_budget:.0%} ({spec.model}): "
        f">= {spec.min_speedup_vs_full:g}x kvrelay full cache, faster than kvpress"
    )
    snap = find(runs, spec.model, KVRELAY_SNAPKV, spec.decode_context, spec.decode_budget)
    full = find(runs, spec.model, KVRELAY_FULL, spec.decode_context, 1.0)
    if snap is None or full is None:
        return GoalVerdict(
            name, NOT_MEASURED, "kvrelay full or SnapKV decode not measured at this point"
        )
    speedup = full.ms_per_token / snap.ms_per_token
    detail = (
        f"kvrelay SnapKV {snap.ms_per_token:.2f} ms/token vs full cache {full.ms_per_token:.2f} "
        f"= {speedup:.2f}x"
    )
    fast_enough = speedup >= spec.min_speedup_vs_full
    press = find(runs, spec.model, KVPRESS, spec.decode_context, spec.decode_budget)
    if press is None:
        status = NOT_MEASURED if fast_enough else FAIL
        return GoalVerdict(name, status, detail + "; kvpress not measured")
    beats_press = snap.ms_per_token < press.ms_per_token
    detail += (
        f"; kvpress {press.ms_per_token:.2f} ms/token = "
        f"{press.ms_per_token / snap.ms_per_token:.2f}x kvrelay's time"
    )
    return GoalVerdict(name, PASS if fast_enough and beats_press else FAIL, detail)


def full_cache_vs_transformers(spec: GoalSpec, runs: Sequence[DecodeRun]) -> GoalVerdict:
    name = f"kvrelay full-cache decode no slower than transformers ({spec.model}, every context)"
    ratios = []
    for full in (r for r in runs if r.model == spec.model and r.engine == KVRELAY_FULL):
        hf = find(runs, spec.model, TRANSFORMERS, full.context, 1.0)
        if hf is not None:
            ratios.append((full.context, full.ms_per_token / hf.ms_per_token))
    if not ratios:
        return GoalVerdict(name, NOT_MEASURED, "no context with both engines measured")
    detail = ", ".join(f"T={context}: {ratio:.2f}" for context, ratio in sorted(ratios))
    status = PASS if all(ratio <= 1.0 for _, ratio in ratios) else FAIL
    return GoalVerdict(name, status, f"kvrelay / transformers ms per token: {detail}")


def compression_overhead(spec: GoalSpec, runs: Sequence[DecodeRun]) -> GoalVerdict:
    name = (
        f"compression overhead at T={spec.overhead_context} ({spec.model}) "
        f"<= {spec.max_compression_overhead:.0%} of prefill"
    )
    measured = [
        r
        for r in runs
        if (r.model, r.engine, r.context) == (spec.model, KVRELAY_SNAPKV, spec.overhead_context)
        and r.budget < 1.0
        and r.compression_overhead is not None
    ]
    if not measured:
        return GoalVerdict(name, NOT_MEASURED, "no compressed kvrelay view at this context")
    worst = max(measured, key=lambda r: r.compression_overhead or 0.0)
    overhead = worst.compression_overhead or 0.0
    stages = ", ".join(
        f"{stage} {seconds * 1000:.1f} ms" for stage, seconds in worst.compression_s.items()
    )
    detail = (
        f"worst {overhead:.2%} (budget {worst.budget:.0%}: {stages}; "
        f"prefill {worst.prefill_s:.2f} s)"
    )
    return GoalVerdict(name, PASS if overhead <= spec.max_compression_overhead else FAIL, detail)


def transfer(spec: GoalSpec, ratio: float | None) -> GoalVerdict:
    name = f"gloo transfer >= {spec.min_transfer_ratio:.0%} of loopback socket bytes/s"
    if ratio is None:
        return GoalVerdict(name, NOT_MEASURED, "transfer not measured")
    status = PASS if ratio >= spec.min_transfer_ratio else FAIL
    return GoalVerdict(name, status, f"gloo / socket = {ratio:.2f}")
