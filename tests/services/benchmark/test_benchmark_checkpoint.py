"""`kvrelay bench --checkpoint PATH` end to end through the CLI on a tiny GGUF file (written the
way llama.cpp writes one, by the GGUF tests' recipe): the file is converted once, every engine
(kvrelay, transformers, kvpress) measures that one model, the prompt that overshoots its
positions is cut to fit, and the goals move onto it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from kvrelay.cli import app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from gguf_checkpoints import gguf_weights, llama_recipe, tiny_hf_model  # noqa: E402

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(240)
STEPS, WARMUP = 2, 1  # --steps, and the smoke preset's warm-up


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    root = tmp_path_factory.mktemp("bench-checkpoint")
    hf = tiny_hf_model("llama", seed=3)  # 256 positions
    gguf = llama_recipe(hf.config, gguf_weights(hf.state_dict(), hf.config, permute=True)).write(
        root / "tiny.gguf"
    )
    out = root / "out"
    args = ["bench", "--preset", "smoke", "--checkpoint", str(gguf), "--contexts", "128,256",
            "--budgets", "full,25%", "--steps", str(STEPS), "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    return out, json.loads((out / "bench.json").read_text()), result.output


def test_every_engine_measures_the_checkpoint_at_the_contexts_that_fit(
    bench: tuple[Path, dict[str, Any], str],
) -> None:
    out, data, _ = bench
    cut = 256 - (STEPS + WARMUP) - 1
    assert [m["name"] for m in data["models"]] == ["tiny"]
    assert data["models"][0]["num_layers"] == 2 and data["models"][0]["num_kv_heads"] == 2
    cells = {(r["engine"], r["context"], r["budget"]) for r in data["runs"]}
    expected = set()
    for context in (128, cut):
        expected |= {("kvrelay-full", context, 1.0), ("transformers", context, 1.0),
                     ("kvrelay-snapkv", context, 1.0), ("kvrelay-snapkv", context, 0.25),
                     ("kvpress-snapkv", context, 0.25)}
    assert cells == expected and not data["skips"]
    assert f"tiny: 256 -> {cut} prompt tokens" in data["environment"]["prompt lengths cut"]
    assert "prompt lengths cut" in (out / "bench.md").read_text()


def test_every_engine_reads_the_same_weights(bench: tuple[Path, dict[str, Any], str]) -> None:
    _, data, _ = bench
    for context in {r["context"] for r in data["runs"]}:
        by_engine = {(r["engine"], r["budget"]): r["tokens"] for r in data["runs"]
                     if r["context"] == context}
        full = by_engine[("kvrelay-full", 1.0)]
        assert len(full) == STEPS + WARMUP + 1
        assert by_engine[("transformers", 1.0)] == full  # greedy, float32, same converted files
        assert by_engine[("kvrelay-snapkv", 1.0)] == full


def test_the_goals_are_checked_on_the_checkpoint_at_its_longest_context(
    bench: tuple[Path, dict[str, Any], str],
) -> None:
    _, data, output = bench
    cut = 256 - (STEPS + WARMUP) - 1
    goals = data["goals"]
    assert f"T={cut}" in goals[0]["goal"] and "(tiny)" in goals[0]["goal"]
    assert goals[0]["status"] == "N/A"  # the goal's 10% budget was not asked for
    assert goals[1]["status"] in ("PASS", "FAIL") and "tiny" in goals[1]["goal"]
    assert goals[2]["status"] in ("PASS", "FAIL") and f"T={cut}" in goals[2]["goal"]
    assert len([line for line in output.splitlines() if line.startswith(("PASS ", "FAIL ", "N/A  "))]) == 4
