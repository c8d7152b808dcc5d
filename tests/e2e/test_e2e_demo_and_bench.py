"""`kvrelay demo` as `make demo` runs it: its own stack on the embedded defaults (SmolLM2 from
the installed wheel), the passphrase question over a few thousand tokens of real prose under
`full`, `snapkv`, `snapkv-recall` and `snapkv-recall-codes`; the full cache must answer it, and every answer comes with
its timings and byte ledger. `kvrelay bench e2e`: one cell against the session stack
measures both sides and reports the bytes that moved. `kvrelay bench recall`: its summary
pairs each question with its own baseline, and one question through a served stack of the
default model."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import pytest
from e2e_helpers import UpStack
from rich.console import Console

from services.gateway.client import GatewayClient
from services.launcher.bench import E2EBenchConfig, bench_manifests, measure, register_manifests
from services.launcher.demo import DEMO_POLICIES, run_stack_demo
from services.launcher.recall_bench import (
    Answer,
    ServedRecallConfig,
    render_markdown,
    run_served_recall,
    summarize,
    write_plot,
)
from services.model import LoadedModel
from services.model.default import default_checkpoint


@pytest.mark.timeout(360)  # about 2.5 minutes on 2 shared cores: start-up, then 4 prompts of 3K tokens
def test_demo_asks_the_default_model_a_real_question_and_the_full_cache_answers_it() -> None:
    out = io.StringIO()
    result = run_stack_demo(default_checkpoint(), Console(file=out, width=200))
    text = out.getvalue()
    assert tuple(result.answers) == DEMO_POLICIES == ("full", "snapkv", "snapkv-recall", "snapkv-recall-codes")
    assert result.correct("full"), result.answers["full"].text
    assert result.question.answer in text and "byte ledger" in text and "stack stopped" in text
    summaries = {policy: answer.summary for policy, answer in result.answers.items()}
    full, snap, recall = summaries["full"], summaries["snapkv"], summaries["snapkv-recall"]
    codes = summaries["snapkv-recall-codes"]
    assert full.prompt_tokens == snap.prompt_tokens == recall.prompt_tokens == codes.prompt_tokens > 3000
    assert full.omitted_rows == 0 and snap.omitted_rows == recall.omitted_rows == codes.omitted_rows > 0
    assert snap.retained_rows * 3 < full.retained_rows  # 25% of the rows kept
    assert snap.bytes_moved < full.bytes_moved and recall.ledger.page_summary_bytes > 0
    # The codes travel with the summaries and the decode host keeps their table: both charged.
    assert codes.ledger.page_summary_bytes > recall.ledger.page_summary_bytes and recall.ledger.code_table_bytes == 0
    assert codes.ledger.code_table_bytes > 0
    assert {s.ledger.full_payload_bytes for s in summaries.values()} == {full.ledger.full_payload_bytes}
    for summary in summaries.values():
        assert summary.ttft_ms > 0 and summary.output_tokens > 0


@pytest.mark.timeout(120)
def test_one_bench_cell_measures_gateway_and_one_process(stack: UpStack, loaded: LoadedModel) -> None:
    config = E2EBenchConfig(checkpoint=stack.config.checkpoint, contexts=(256,), budgets=(0.10,), max_tokens=6,
                            repeats=1)
    manifests = bench_manifests(loaded, config.budgets)
    assert sorted(manifests) == ["full", "snapkv-10pct"]
    asyncio.run(register_manifests(stack.policy_address, manifests))
    with GatewayClient(stack.gateway_address, timeout_s=60) as client:
        row = measure(client, loaded, "snapkv-10pct", manifests["snapkv-10pct"], 256, config)
    assert row.gateway_ttft_ms > 0 and row.local_ttft_ms > 0 and row.local_tokens_per_s > 0
    assert row.full_rows == 2 * 2 * 256
    assert row.retained_rows == 2 * 2 * manifests["snapkv-10pct"].selection.capacity(256)  # uniform: every owner
    assert 0 < row.bytes_moved < row.full_payload_bytes


def _answer(seed: int, policy: str, correct: bool, tpot_ms: float, recalled: int = 0) -> Answer:
    omitted = 0 if policy == "full" else 1000
    return Answer(seed=seed, policy=policy, correct=correct, text="The passphrase is | a-b-1", ttft_ms=10.0,
                  tpot_ms=tpot_ms, output_tokens=12, omitted_rows=omitted, recalled_rows=recalled,
                  recalled_bytes=recalled * 512, bytes_moved=250 if omitted else 1000, full_payload_bytes=1000,
                  code_table_bytes=(1 << 20) * recalled // 10)


def test_the_served_recall_summary_pairs_each_question_with_its_own_baseline(tmp_path: Path) -> None:
    answers = [
        _answer(1, "snapkv", False, 100.0), _answer(1, "snapkv-recall-codes", True, 120.0, recalled=10),
        _answer(2, "snapkv", True, 50.0), _answer(2, "snapkv-recall-codes", True, 75.0, recalled=30),
        _answer(3, "snapkv", False, 80.0), _answer(3, "snapkv-recall-codes", False, 80.0, recalled=20),
    ]
    snap, codes = summarize(answers)
    assert (snap.policy, snap.correct, snap.questions, snap.tpot_ratio) == ("snapkv", 1, 3, 1.0)
    assert (codes.correct, codes.tpot_p50_ms) == (2, 80.0)
    assert codes.tpot_ratio == pytest.approx(1.2)  # the median of 1.2, 1.5, 1.0: not 80 / 80
    assert codes.recalled_share_max == pytest.approx(0.03) and codes.recalled_kib_p50 == pytest.approx(10.0)
    assert codes.moved_share_p50 == pytest.approx(0.25) and codes.code_table_mib_p50 == pytest.approx(2.0)
    config = ServedRecallConfig(checkpoint=tmp_path / "m.gguf", seeds=(1, 2, 3), policies=("snapkv", "snapkv-recall-codes"))
    text = render_markdown(config, answers, "kvrelay bench recall", "2 CPUs")
    assert "| snapkv-recall-codes | 2/3 | 80.0 | 1.20x | 3.00% |" in text and "a-b-1" in text and "\\|" in text
    assert write_plot(config, answers, tmp_path / "r.png").stat().st_size > 0
    with pytest.raises(ValueError, match="include 'snapkv'"):
        ServedRecallConfig(checkpoint=tmp_path, policies=("full", "snapkv-recall"))


@pytest.mark.timeout(300)
def test_bench_recall_asks_the_served_stack_under_each_policy() -> None:
    config = ServedRecallConfig(checkpoint=default_checkpoint(), seeds=(301,), policies=("snapkv", "snapkv-recall-codes"),
                                context_tokens=1000, max_tokens=8, threads=1)
    seen: list[str] = []
    answers = run_served_recall(config, lambda answer: seen.append(answer.policy))
    assert seen == ["snapkv", "snapkv-recall-codes"] == [a.policy for a in answers]
    snap, codes = answers
    assert snap.omitted_rows == codes.omitted_rows > 0 and snap.recalled_rows == 0 == snap.code_table_bytes
    assert codes.code_table_bytes > 0 and codes.tpot_ms > 0 and snap.tpot_ms > 0
    assert 0 < snap.bytes_moved < codes.bytes_moved < snap.full_payload_bytes  # the codes travel too
