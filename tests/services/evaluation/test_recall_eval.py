"""`kvrelay eval recall` on the bundled demo checkpoint: the smoke preset end to end, and the
evaluator's protocol against the runtime's full-cache generation."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvrelay.cli import app
from services.evaluation.recall_eval import (
    POLICIES,
    RECALL_POLICIES,
    Evaluator,
    RecallEvalConfig,
    RequestResult,
    eval_prompts,
    evaluate_prompt,
    goal_markdown,
    goal_rows,
)
from services.model import generate, load
from services.model.default import DEMO_CHECKPOINT
from services.offload.recall import RecallKnobs

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def loaded():
    return load(DEMO_CHECKPOINT)


def test_smoke_preset_writes_the_report_and_the_goal_check(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["eval", "recall", "--preset", "smoke", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    report = (tmp_path / "report.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:  # a dependency from issue 8 on
        assert (tmp_path / "recall.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "![recall](recall.png)" in report
    assert "## Goal check" in report and "Goal " in report
    for policy in POLICIES:
        assert f"| {policy} |" in report
    data = json.loads((tmp_path / "results.json").read_text())
    rows = data["results"]
    assert len(rows) == 2 * 2 * len(POLICIES)  # two prompts per placement, one budget
    for row in rows:
        retained = row["retained_rows"] / (row["retained_rows"] + row["omitted_rows"])
        if row["policy"] == "full":
            assert row["omitted_rows"] == 0 and row["agrees_with_full"]
        else:  # every compressed policy keeps ceil(25% of the context) rows per owner
            per_owner = math.ceil(0.25 * row["context_tokens"])
            assert retained == pytest.approx(per_owner / row["context_tokens"])
        if row["policy"] in RECALL_POLICIES:
            knobs = data["config"]["knobs"]
            most = 2 * knobs["max_pages_per_step"] * knobs["page_size"]  # two cue steps
            assert row["recalled_rows"] <= most and len(row["fetch_s"]) == row["recalls"]
        else:
            assert row["recalled_rows"] == 0


def test_the_cue_decoded_on_any_cache_that_sees_everything_answers_like_full_prefill(
    loaded,
) -> None:
    # threshold 0 with no page limit recalls every omitted row at the first cue step
    knobs = RecallKnobs(threshold=0.0, page_size=8, max_pages_per_step=100_000, cadence_steps=1)
    config = RecallEvalConfig(
        context_lengths=(256,),
        budgets=(0.1,),
        prompts=3,
        policies=("full", "snapkv", "snapkv-recall"),
        knobs=knobs,
    )
    evaluator = Evaluator(loaded, config)
    tokenizer = loaded.require_tokenizer()
    for prompt in eval_prompts(config, 256, config.placements[1], seed=123):
        results = {r.policy: r for r in evaluate_prompt(evaluator, prompt)}
        reference = generate(loaded, tokenizer.encode(prompt.text), max_new_tokens=1)[0]
        assert results["full"].answer == reference
        assert results["snapkv-recall"].answer == reference
        assert results["snapkv-recall"].recalled_rows == results["snapkv-recall"].omitted_rows
    assert evaluator.store.used_bytes == 0


def request(
    policy: str,
    correct: bool,
    recalled: int = 0,
    placement: str = "before_filler",
    budget: float = 0.25,
) -> RequestResult:
    return RequestResult(
        placement=placement,
        context_tokens=100,
        budget=budget,
        policy=policy,
        depth=0.5,
        answer=int(correct),
        correct=correct,
        agrees_with_full=correct,
        retained_rows=25,
        omitted_rows=75,
        recalled_rows=recalled,
    )


def test_goal_check_measures_the_gap_closed_and_the_recalled_share() -> None:
    full = [request("full", True)] * 4
    lossy = [request("snapkv", c) for c in (True, False, False, False)]
    closes = [request("snapkv-recall", c, recalled=10) for c in (True, True, True, True)]
    elsewhere = [
        request("snapkv-recall", False, placement="end"),
        request("snapkv", True, budget=0.1),
    ]
    (row,) = goal_rows(full + lossy + closes + elsewhere)
    assert (row.full_accuracy, row.lossy_accuracy, row.recall_accuracy) == (1.0, 0.25, 1.0)
    assert row.gap_closed == 1.0 and row.recalled_share == pytest.approx(10 / 75) and row.met
    assert "**Goal met**" in goal_markdown([row])
    partial = [request("snapkv-recall", c, recalled=10) for c in (True, True, False, False)]
    (row,) = goal_rows(full + lossy + partial)
    assert row.gap_closed == pytest.approx(1 / 3) and row.met is False
    greedy = [request("snapkv-recall", True, recalled=20)] * 4  # 26.7% of the omitted rows
    (row,) = goal_rows(full + lossy + greedy)
    assert row.gap_closed == 1.0 and row.met is False
    no_gap = [request("snapkv", True)] * 4
    (row,) = goal_rows(full + no_gap + closes)
    assert row.gap_closed is None and row.met is None
    assert "undetermined" in goal_markdown([row])
