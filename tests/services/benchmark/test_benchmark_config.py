"""Bench options, the plan's skip rule and the per-phase peak-RSS probe."""

from __future__ import annotations

import sys

import pytest
import torch

from services.benchmark.config import Overrides, parse_budgets, parse_ints, preset, resolve
from services.benchmark.errors import InvalidBenchConfig, MissingBenchDependency
from services.benchmark.harness import prompt_ids, require_packages, skip_reason
from services.benchmark.memory import ModelDims, PeakProbe, estimate_peak, kv_bytes

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
