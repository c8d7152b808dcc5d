"""Bench options, the plan's skip rule and the per-phase peak-RSS probe."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from services.benchmark.config import (
    DEMO_CHECKPOINT,
    Overrides,
    parse_budgets,
    parse_ints,
    preset,
    resolve,
)
from services.benchmark.errors import InvalidBenchConfig, MissingBenchDependency
from services.benchmark.harness import (
    fit_context,
    make_plan,
    prompt_ids,
    require_packages,
    skip_reason,
)
from services.benchmark.memory import ModelDims, PeakProbe, estimate_peak, kv_bytes
from services.model.default import default_checkpoint

torch.set_num_threads(1)

DIMS = ModelDims(
    num_layers=24,
    hidden_size=512,
    intermediate_size=1024,
    num_q_heads=8,
    num_kv_heads=4,
    head_dim=128,
    weight_bytes=300 * 2**20,
)


def test_options_parse_into_the_preset() -> None:
    assert parse_ints("1K,4k,512", "contexts") == (1024, 4096, 512)
    assert parse_budgets("0.1,full,50%,0.25") == (1.0, 0.5, 0.25, 0.1)
    config = resolve(
        "full",
        Overrides(
            contexts="4K,1K",
            budgets="full,10%",
            models="large",
            threads=2,
            kvpress=False,
            memory_budget_gib=2.0,
            steps=8,
        ),
    )
    assert config.contexts == (1024, 4096) and config.budgets == (1.0, 0.1)
    assert [m.name for m in config.models] == ["large"] and config.models[0].shape is not None
    assert (config.threads, config.kvpress, config.decode_steps) == (2, False, 8)
    assert config.memory_budget_bytes == 2 * 2**30 and config.compressed_budgets == (0.1,)
    assert resolve("smoke", Overrides()) == preset("smoke")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (Overrides(contexts="1K,abc"), "contexts"),
        (Overrides(contexts="16"), "contexts"),
        (Overrides(budgets="1.5"), "budgets"),
        (Overrides(budgets="most"), "budgets"),
        (Overrides(models="demo,huge"), "models"),
        (Overrides(memory_budget_gib=-1.0), "memory_budget"),
    ],
)
def test_bad_options_name_the_field(overrides: Overrides, field: str) -> None:
    with pytest.raises(InvalidBenchConfig) as raised:
        resolve("smoke", overrides)
    assert raised.value.field == field


def test_unknown_preset_is_rejected() -> None:
    with pytest.raises(InvalidBenchConfig, match="preset"):
        preset("huge")


def test_missing_kvpress_fails_with_its_name_unless_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "kvpress", None)  # blocks the import like an absent package
    with pytest.raises(MissingBenchDependency, match="kvpress") as raised:
        require_packages(preset("smoke"))
    assert raised.value.package == "kvpress" and "--no-kvpress" in str(raised.value)
    require_packages(resolve("smoke", Overrides(kvpress=False)))


def test_cells_over_the_memory_budget_or_the_position_limit_are_skipped_with_the_reason() -> None:
    config = preset("full")
    assert kv_bytes(DIMS, 16384) == 16384 * 96 * 1024  # 96 KiB/token
    assert skip_reason(DIMS, 40000, "kvrelay", 16384, config, budget=8 * 2**30) is None
    reason = skip_reason(DIMS, 40000, "transformers", 32768, config, budget=4 * 2**30)
    assert reason is not None and "exceeds the memory budget 4.0 GiB" in reason
    reason = skip_reason(DIMS, 32768, "kvrelay", 32768, config, budget=2**40)
    assert reason is not None and "max_position_embeddings 32768" in reason
    for process in ("kvrelay", "transformers"):
        short, long = (estimate_peak(DIMS, process, t, 1024, 64) for t in (4096, 16384))
        assert DIMS.weight_bytes + kv_bytes(DIMS, 16384) < long and short < long


def test_prompts_are_the_same_for_every_engine_and_avoid_special_ids() -> None:
    assert prompt_ids(1154, 300, 0) == prompt_ids(1154, 300, 0) != prompt_ids(1154, 300, 1)
    assert min(prompt_ids(1154, 300, 0)) >= 3 and max(prompt_ids(1154, 300, 0)) < 1154


def test_peak_probe_sees_a_phase_allocation_and_forgets_it_in_the_next_phase() -> None:
    probe = PeakProbe()
    probe.start()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    first = probe.stop()
    del block
    probe.start()
    second = probe.stop()
    assert first.scope == second.scope == "phase"
    assert first.peak - first.start >= 60 * 2**20
    assert second.peak - second.start < 16 * 2**20


def test_a_checkpoint_is_measured_alone_or_beside_named_models_and_takes_the_goals(
    tmp_path: Path,
) -> None:
    gguf = tmp_path / "My Model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    alone = resolve("full", Overrides(checkpoint=gguf))
    assert [(m.name, m.checkpoint) for m in alone.models] == [("My-Model.Q4_1", gguf)]
    assert (alone.goals.model, alone.goals.decode_context, alone.goals.overhead_context) == (
        "My-Model.Q4_1", 0, 0)
    beside = resolve("full", Overrides(checkpoint=DEMO_CHECKPOINT, models="large"))
    assert [m.name for m in beside.models] == ["large", "demo_checkpoint"]
    assert beside.goals == preset("full").goals  # the goal model still runs
    with pytest.raises(InvalidBenchConfig) as raised:
        resolve("full", Overrides(checkpoint=tmp_path / "absent.gguf"))
    assert raised.value.field == "checkpoint"
    (tmp_path / "demo").mkdir()
    with pytest.raises(InvalidBenchConfig, match="duplicate"):
        resolve("full", Overrides(checkpoint=tmp_path / "demo", models="demo"))


def test_a_prompt_a_little_over_the_positions_is_cut_to_fit_and_a_long_one_is_kept() -> None:
    assert fit_context(8192, 8192, 34) == 8157  # "8K" on an 8192-position model
    assert fit_context(4096, 8192, 34) == 4096
    assert fit_context(16384, 8192, 34) == 16384  # skipped later, with the reason


def test_a_gguf_checkpoint_is_converted_once_and_planned_at_the_contexts_that_fit(
    tmp_path: Path,
) -> None:
    config = resolve("full", Overrides(checkpoint=default_checkpoint(), contexts="1K,8K", steps=4))
    plan = make_plan(config, tmp_path)
    converted = tmp_path / "model-SmolLM2-135M-Instruct.Q4_1"
    assert (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()
    for job in plan.jobs:
        (model,) = job.models
        assert model.checkpoint == converted
        assert [context for context, _ in model.prompts] == [1024, 8192 - 6 - 1]
        assert all(len(ids) == context and max(ids) < 49152 for context, ids in model.prompts)
    assert plan.fitted == ("SmolLM2-135M-Instruct.Q4_1: 8192 -> 8185 prompt tokens, so that 6 "
                           "decode steps fit its 8192 positions",)
