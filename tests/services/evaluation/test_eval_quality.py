"""`kvrelay eval`: the policy grid (valid manifests, equal rows per budget), the sweep protocol
(the `full` policy answers what full-cache generation of the whole prompt answers) and the smoke
preset end to end through the CLI (Markdown, PNG heat maps, trials.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvrelay.cli import app
from services.demo import needle
from services.evaluation.calibrate import CalibrationConfig, calibrate
from services.evaluation.needle_eval import SweepConfig, evaluate_prompt, split_cue, sweep_prompts
from services.evaluation.policies import policy_grid
from services.evaluation.quality import PRESETS
from services.kvpolicy.manifest import AllocationMethod, GQAReduction, KVVisibilityPolicyManifest
from services.model import LoadedModel, generate

SMOKE = PRESETS["smoke"]
ONE_PROMPT = CalibrationConfig(context_lengths=(200,), prompts=1)


def test_grid_holds_every_policy_as_a_valid_manifest(needle_model: LoadedModel) -> None:
    profile = calibrate(needle_model, ONE_PROMPT, "0" * 64)
    cells = policy_grid(needle_model.tensor_contract, 254, (0.1, 0.25), tuple(AllocationMethod),
                        tuple(GQAReduction), profile)
    assert len(cells) == 1 + 2 * (2 + 5 * 3)
    manifests = [cell.manifest for cell in cells]
    assert len({m.sha256 for m in manifests}) == len(manifests)
    for manifest in manifests:  # each survives its own canonical JSON: a complete contract
        assert KVVisibilityPolicyManifest.from_json(manifest.canonical_json()) == manifest
    headkv = {c.reduction: c.manifest.selection.allocation for c in cells
              if c.allocation is AllocationMethod.HEADKV and c.budget == 0.1}
    assert headkv[GQAReduction.MEAN].headkv_profile_sha256 == profile.sha256
    assert headkv[GQAReduction.EXPAND].headkv_profile_sha256 == profile.query_head_sha256
    no_profile = policy_grid(needle_model.tensor_contract, 254, (0.1,), tuple(AllocationMethod),
                             tuple(GQAReduction))
    assert not any(c.allocation is AllocationMethod.HEADKV for c in no_profile)


def test_every_policy_of_a_budget_keeps_the_same_rows_and_full_answers_like_generate(
    needle_model: LoadedModel,
) -> None:
    config = SweepConfig(context_lengths=(220,), depths=(0.5,), budgets=(0.25,), prompts_per_cell=1)
    profile = calibrate(needle_model, ONE_PROMPT, "0" * 64)
    group = needle_model.config.num_q_heads // needle_model.config.num_kv_heads
    for prompt in sweep_prompts(config, 220):
        trials = evaluate_prompt(needle_model, config, prompt, profile)
        full = next(t for t in trials if t.policy == "full")
        ids = needle_model.require_tokenizer().encode(prompt.text)
        assert full.answer == generate(needle_model, ids, max_new_tokens=1)[0]
        assert full.retained_rows == full.full_rows
        rows = {t.policy: t.retained_rows for t in trials if t.policy != "full"}
        owner_rows = {p: r // group if p.endswith("/expand") else r for p, r in rows.items()}
        assert len(set(owner_rows.values())) == 1, owner_rows
        assert next(iter(owner_rows.values())) < full.full_rows
        prefix, cue, code = split_cue(needle_model, prompt)
        assert len(prefix) + len(cue) == len(prompt.words) and cue == ids[-2:] and code == ids[
            prompt.needle_start + 5]


def test_smoke_preset_writes_the_report(needle_checkpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="heat maps need matplotlib (a kvrelay dependency)")
    out = tmp_path / "eval"
    command = ["eval", "--checkpoint", str(needle_checkpoint), "--preset", "smoke",
               "--out", str(out), "--no-kvpress"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    report = (out / "eval.md").read_text()
    trials = json.loads((out / "trials.json").read_text())
    policies = {t["policy"] for t in trials}
    assert len(policies) == 1 + 2 + 5 * 3  # full, window, sink-recent, 5 allocations x 3 reductions
    assert len(trials) == SMOKE.total_prompts * len(policies)
    for policy in policies:
        assert f"| {policy} |" in report
    for placement in needle.Placement:
        assert f"25% {placement.value}" in report
        image = out / f"heatmap_{placement.value}_25pct.png"
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"({image.name})" in report
    assert "calibrated in memory" in report
