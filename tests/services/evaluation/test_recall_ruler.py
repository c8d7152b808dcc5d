"""`kvrelay eval recall --suite ruler`: the summary's arithmetic on hand-made rows, and a smoke
run on the real SmolLM2-135M checkpoint (256-token prompts, two recall strategies)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvrelay.cli import app
from services.evaluation import recall_ruler
from services.evaluation.recall_ruler import (
    CODES,
    CODES_SKETCH,
    PRESETS,
    TODAY,
    RecallVariant,
    Row,
    goal_lines,
    load_rows,
    report_tables,
    run,
    summarize,
)
from services.evaluation.recall_tpot import TpotConfig, measure, render, task_index, write_plot
from services.evaluation.ruler_suite import REPORT_SEED, TUNE_SEED
from services.model.default import default_checkpoint
from services.offload.recall import RecallKnobs, RecallStrategy

torch.set_num_threads(1)


def row(policy: str, budget: float | None, score: float, batch: int = 2, **kwargs: object) -> Row:
    return Row(engine=str(kwargs.pop("engine", "kvrelay")), policy=policy, budget=budget,
               task="niah_single/noise", length=4096, index=int(kwargs.pop("index", 0)), seed=1,
               batch=batch, score=score, output=str(kwargs.pop("output", "")),
               **kwargs)  # type: ignore[arg-type]


def test_summary_gap_closed_recalled_share_tpot_and_best_press() -> None:
    steps = {"step_s": (0.1, 0.1), "step_cpu_s": (0.1, 0.1)}
    rows = [
        row("full", None, 1.0, **steps), row("full", None, 1.0, index=1, **steps),
        row("snapkv", 0.25, 0.0, omitted_rows=1000, **steps),
        row("snapkv", 0.25, 0.5, index=1, omitted_rows=1000, **steps),
        row("snapkv+today", 0.25, 1.0, omitted_rows=1000, recalled_rows=30, recalls=3,
            recalled_bytes=3072, fetch_s=(0.002,), step_s=(0.12, 0.12), step_cpu_s=(0.2, 0.2)),
        row("snapkv+today", 0.25, 1.0, index=1, omitted_rows=1000, recalled_rows=10,
            step_s=(0.12, 0.12), step_cpu_s=(0.2, 0.2)),
        row("snapkv", 0.25, 0.0, batch=1, step_s=(0.1,), step_cpu_s=(0.1,)),
        row("snapkv+today", 0.25, 1.0, batch=1, step_s=(0.11,), step_cpu_s=(0.12,)),
        row("kvpress:snapkv", 0.25, 0.5, batch=1, engine="kvpress"),
        row("kvpress:expected_attention", 0.25, 0.75, batch=1, engine="kvpress"),
    ]
    cells = {(c.policy, c.budget): c for c in summarize(rows, batch=2)}
    recall = cells["snapkv+today", 0.25]
    assert recall.requests == 2 and recall.accuracy == 1.0
    assert recall.recalled_share == pytest.approx(40 / 2000)
    assert recall.recalled_kib == pytest.approx(1.5) and recall.recalls == 1.5
    assert recall.tpot_ms == pytest.approx(120) and recall.tpot1_ms == pytest.approx(110)
    assert recall.cpu_ms == pytest.approx(200) and recall.cpu1_ms == pytest.approx(120)
    assert cells["kvpress:expected_attention", 0.25].tpot_ms is None
    tables = report_tables(list(cells.values()), ["today"], batch=2)
    assert "| niah_single/noise | 4096 | 25% | 100% | 25% | 100% | 100% | -, - | " \
        "expected_attention 75% |" in tables  # no full-cache answer names a number
    goals = goal_lines(list(cells.values()), "today")
    assert goals[0].startswith("- gap closed >= 90%: 1 of 1")
    assert "recalled <= 5% of omitted rows: 1 of 1" in goals[1]
    # TPOT is wall time; CPU time (every thread of the process) is its own line
    assert "(wall time per answer step): batch 1 1 of 1 cells (worst 1.10x), batch b 1 of 1 " \
        "(worst 1.20x)" in goals[2]
    assert goals[3].endswith("batch 1 1.20-1.20x, batch b 2.00-2.00x")
    assert goals[4].endswith("1 of 1 cells")


def test_the_summary_counts_answers_naming_the_full_caches_number_right_or_wrong() -> None:
    """Where the full cache names a wrong key's number, the accuracy has no gap to close; the
    share of answers naming the full cache's number still tells a cache that answers as the
    full one does from one that does not."""
    rows = [
        row("full", None, 0.0, output=" 2187945."), row("full", None, 0.0, index=1, output=" 2046742."),
        row("full", None, 0.0, index=2, output=" The number is hidden."),
        row("snapkv", 0.1, 0.0, output=" 21."), row("snapkv", 0.1, 0.0, index=1, output=" 2046742"),
        row("snapkv", 0.1, 0.0, index=2, output=" 7."),
        row("snapkv+codes", 0.1, 0.0, output=" 2187945.\n"),
        row("snapkv+codes", 0.1, 0.0, index=1, output=" 2046742. Then 5."),
        row("snapkv+codes", 0.1, 0.0, index=2, output=" 2046742."),
        row("snapkv+codes", 0.1, 0.0, batch=1, output=" 9."),  # batch 1: timed, not counted
    ]
    cells = {(c.policy, c.budget): c for c in summarize(rows, batch=2)}
    assert cells["snapkv", 0.1].same_as_full == pytest.approx(0.5)
    assert cells["snapkv+codes", 0.1].same_as_full == 1.0
    assert cells["full", None].same_as_full == 1.0
    tables = report_tables(list(cells.values()), ["codes"], batch=2)
    assert "| no gap | 50%, 100% | - |" in tables
    goals = goal_lines(list(cells.values()), "codes")
    assert goals[-1].endswith("(not a goal): 2 of 2 requests")


def test_rows_round_trip_through_the_results_file(tmp_path: Path) -> None:
    rows = [row("snapkv+today", 0.25, 1.0, fetch_s=(0.001, 0.002), step_s=(0.1,),
                step_cpu_s=(0.2,)), row("full", None, 0.5, engine="kvpress")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    assert load_rows(path) == rows


def test_tune_runs_the_preset_on_the_tuning_prompts_only(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`--tune` with `--suite ruler`: the preset's cells on prompts from TUNE_SEED (never the
    reported seed), and the report says which prompts it ran."""
    seen = []
    monkeypatch.setattr(recall_ruler, "run", lambda _c, config, out, *_a: seen.append((config, out)))
    for extra, seed in (([], REPORT_SEED), (["--tune"], TUNE_SEED)):
        result = CliRunner().invoke(app, ["eval", "recall", "--suite", "ruler", "--preset", "scoring",
                                          "--no-kvpress", "--out", str(tmp_path), *extra])
        assert result.exit_code == 0, result.output
        config, out = seen.pop()
        assert config.seed == seed and out == tmp_path
        assert config.variants == (CODES, CODES_SKETCH) == PRESETS["scoring"].variants
        assert config.specs(config.tasks[0], 4096)[0].seed != \
            replace(config, seed=REPORT_SEED if seed == TUNE_SEED else TUNE_SEED).specs(
                config.tasks[0], 4096)[0].seed
    assert CODES_SKETCH.strategy.sketch_candidates and CODES.strategy.sketch_candidates is None
    assert "Tuning prompts" in recall_ruler._seeds(TUNE_SEED)
    assert "(reported)" in recall_ruler._seeds(REPORT_SEED)


@pytest.mark.slow
def test_smoke_run_on_smollm2_writes_the_report(tmp_path: Path) -> None:
    deferred = RecallVariant("deferred", RecallKnobs(0.99, 8, 8, 1), RecallStrategy(1))
    config = replace(PRESETS["smoke"], variants=(TODAY, deferred))
    report = run(default_checkpoint(), config, tmp_path, threads=1, kvpress=False)
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    # policies: full + snapkv + 2 recall variants at one budget; 2 prompts as one batch, the
    # first alone again
    assert len(rows) == len(report.rows) == 4 * 3
    full = [r for r in rows if r["policy"] == "full"]
    assert all(r["score"] == 1.0 for r in full), full  # SmolLM2 finds a needle at 256 tokens
    for name in ("snapkv+today", "snapkv+deferred"):
        recalled = [r for r in rows if r["policy"] == name]
        assert all(0 < r["recalled_rows"] < r["omitted_rows"] for r in recalled), recalled
        assert all(r["recalled_bytes"] > 0 and len(r["fetch_s"]) == r["recalls"] for r in recalled)
    assert all(r["recalled_rows"] == 0 for r in rows if r["policy"] in ("full", "snapkv"))
    text = (tmp_path / "report.md").read_text()
    assert "## Goals (this run)" in text and "+deferred" in text and "snapkv / recall" in text


@pytest.mark.slow
def test_paired_tpot_rounds_on_smollm2_report_per_round_ratios(tmp_path: Path) -> None:
    """`kvrelay bench recall-tpot`'s measurement: every round decodes the irrecoverable batch
    and each variant's, in alternating order; the ratios are of the same round."""
    config = TpotConfig(length=256, budget=0.25, batch=2, rounds=2, prompts=1,
                        variants=(CODES,), filler_tokens=32)
    result = measure(default_checkpoint(), config)
    assert result.policies == ("snapkv", "snapkv+codes") and len(result.rounds) == 2
    for measured in result.rounds:
        assert set(measured) == set(result.policies)
        assert all(m.wall_ms > 0 and m.cpu_ms > 0 and len(m.outputs) == 1
                   for m in measured.values())
    assert result.ratios("snapkv+codes") == [
        r["snapkv+codes"].wall_ms / r["snapkv"].wall_ms for r in result.rounds]
    assert result.consistent("snapkv")  # greedy: the same answer every round
    text = render(result, "kvrelay bench recall-tpot", "host", 1.0)
    assert "| snapkv+codes |" in text and "median" in text
    assert write_plot(result, tmp_path / "tpot.png").stat().st_size > 0


def test_recall_tpot_refuses_unknown_variants_and_tasks() -> None:
    result = CliRunner().invoke(app, ["bench", "recall-tpot", "--variants", "codes,nope"])
    assert result.exit_code == 2 and "nope" in result.output
    result = CliRunner().invoke(app, ["bench", "recall-tpot", "--task", "niah_nothing"])
    assert result.exit_code == 2 and "niah_nothing" in result.output
    assert task_index("niah_multikey") == 1 == task_index("niah_multikey/noise")
