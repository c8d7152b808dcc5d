"""`kvrelay eval retention --generate-tokens`: bounded decode memory on the decode worker's path
(paged `DecodeCache` + `decode_worker.retention.RetentionSession`) on the demo checkpoint.
Resident rows are checked at every step against the budget and the allocated bytes against the
pages that the budget plus the step's candidate row need; a session that never evicts fails
both checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from decode_worker.retention import RetentionSession
from services.evaluation.retention_generate import (
    PNG,
    Generation,
    SessionFactory,
    budgeted_manifest,
    generate,
)
from services.evaluation.retention_report import RetentionEvalOptions, run
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.kvpolicy.retention import Retained
from services.kvpolicy.retention_contract import RetentionContract
from services.kvpolicy.state import KVPolicyState
from services.model.default import DEMO_CHECKPOINT
from services.model.kvcache import DecodeCache
from services.model.loader import LoadedModel, load
from services.model.paged import DEFAULT_PAGE_ROWS, POSITION_BYTES
from services.model.row_attention import RowContract

BUDGET, SINKS, PROMPT = 16, 2, 8


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    torch.set_num_threads(1)
    return load(DEMO_CHECKPOINT, dtype="float32")


def prompt(model: LoadedModel) -> list[int]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(3, model.config.vocab_size, (PROMPT,), generator=generator).tolist()


def budget_bytes(model: LoadedModel, rows: int) -> int:
    """Independent of the cache: every (layer, K/V head) in whole pages for `rows` rows."""
    config = model.config
    pages = -(-rows // DEFAULT_PAGE_ROWS)
    row_bytes = 2 * config.head_dim * 4 + POSITION_BYTES  # float32 K and V, int32 position
    return config.num_layers * config.num_kv_heads * pages * DEFAULT_PAGE_ROWS * row_bytes


class NoEviction:
    """The decode worker's session that decides but never commits: the cache keeps every row."""

    def __init__(self, manifest: KVVisibilityPolicyManifest, contract: RetentionContract,
                 state: KVPolicyState) -> None:
        self.inner = RetentionSession(manifest, contract, state)

    @property
    def row_contract(self) -> RowContract:
        return self.inner.row_contract

    def admitted(self, cache: DecodeCache) -> None:
        self.inner.admitted(cache)

    def decide(self, cache: DecodeCache) -> Retained:
        return self.inner.decide(cache)

    def commit(self, cache: DecodeCache, retained: Retained, last: bool = False) -> object:
        return None


def run_generation(model: LoadedModel, session: SessionFactory) -> Generation:
    manifest = budgeted_manifest(model, "sink-recent-local", BUDGET, SINKS)
    return generate(model, manifest, prompt(model), 3 * BUDGET, session, sample_every=4)


def test_resident_rows_and_allocated_bytes_stay_flat_past_the_budget(demo: LoadedModel) -> None:
    one = run_generation(demo, RetentionSession)
    assert one.steps == 3 * BUDGET and one.budget == BUDGET
    assert all(rows <= BUDGET for rows in one.resident)  # every step, not only the samples
    assert one.over_budget_steps == 0 and max(one.resident) == BUDGET
    assert one.budget_reached == BUDGET - PROMPT and one.steady_from == BUDGET - PROMPT + 1
    steady = one.allocated[one.steady_from - 1:] if one.steady_from else ()
    assert set(steady) == {budget_bytes(demo, BUDGET + 1)}  # budget + the candidate's room
    assert one.steady() == (budget_bytes(demo, BUDGET + 1),) * 2
    assert one.allocated[0] == budget_bytes(demo, PROMPT + 1)  # it grew until then
    assert [s.step for s in one.samples] == list(range(4, 3 * BUDGET + 1, 4))
    assert all(s.allocated_bytes == one.allocated[s.step - 1] for s in one.samples)


def test_without_eviction_the_checks_fail(demo: LoadedModel) -> None:
    one = run_generation(demo, NoEviction)
    assert max(one.resident) == PROMPT + 3 * BUDGET
    assert one.over_budget_steps == 3 * BUDGET - (BUDGET - PROMPT)
    steady = one.steady()
    assert steady is not None and steady[1] > steady[0]
    assert one.allocated[-1] > budget_bytes(demo, BUDGET + 1)


def test_the_command_writes_its_report(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    options = RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path / "out", text=text, skip_lines=0,
                                   tokens=0, sinks=SINKS, dtype="float32",
                                   generate_tokens=3 * BUDGET, generate_budget=BUDGET,
                                   generate_prompt=PROMPT, generate_sample_every=4)
    summary = run(options, RetentionSession)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [PNG, "results.json", "retention.md"]
    written = json.loads((out / "results.json").read_text())["generate"]
    assert written == json.loads(json.dumps(summary["generate"]))
    assert written["steps"] == 3 * BUDGET and written["bounded_every_step"]
    assert written["resident_max"] == BUDGET and written["steady_ratio"] == 1.0
    report = (out / "retention.md").read_text()
    assert f"## Generation: {3 * BUDGET} of {3 * BUDGET} tokens (" in report
    assert "at every step: yes" in report and f"]({PNG})" in report


def test_max_minutes_bounds_the_loop_and_the_report_says_where(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    options = RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path, text=text, skip_lines=0,
                                   tokens=0, sinks=SINKS, dtype="float32", max_minutes=0.0,
                                   generate_tokens=10_000, generate_budget=BUDGET,
                                   generate_prompt=PROMPT)
    summary = run(options, RetentionSession)
    assert summary["generate"]["steps"] < 10_000
    assert "stopped by the 0-minute limit at step" in (tmp_path / "retention.md").read_text()


def test_bad_options_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="generate_method"):
        RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path, tokens=0, generate_tokens=4,
                             generate_method="lru")
    with pytest.raises(ValueError, match="generate_budget"):
        RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path, tokens=0, generate_tokens=4,
                             generate_budget=0)
    options = RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path, tokens=0, generate_tokens=4)
    with pytest.raises(ValueError, match="generate_tokens"):
        run(options)
