"""`kvrelay demo` as `make demo` runs it: its own stack on the embedded defaults (SmolLM2 from
the installed wheel), the passphrase question over a few thousand tokens of real prose under
`full`, `snapkv` and `snapkv-recall`; the full cache must answer it, and every answer comes with
its timings and byte ledger. And `kvrelay bench e2e`: one cell against the session stack
measures both sides and reports the bytes that moved."""

from __future__ import annotations

import asyncio
import io

import pytest
from e2e_helpers import UpStack
from rich.console import Console

from services.gateway.client import GatewayClient
from services.launcher.bench import E2EBenchConfig, bench_manifests, measure, register_manifests
from services.launcher.demo import DEMO_POLICIES, run_stack_demo
from services.model import LoadedModel
from services.model.default import default_checkpoint


@pytest.mark.timeout(300)  # about 2 minutes on 2 shared cores: start-up, then 3 prompts of 3K tokens
def test_demo_asks_the_default_model_a_real_question_and_the_full_cache_answers_it() -> None:
    out = io.StringIO()
    result = run_stack_demo(default_checkpoint(), Console(file=out, width=200))
    text = out.getvalue()
    assert tuple(result.answers) == DEMO_POLICIES == ("full", "snapkv", "snapkv-recall")
    assert result.correct("full"), result.answers["full"].text
    assert result.question.answer in text and "byte ledger" in text and "stack stopped" in text
    summaries = {policy: answer.summary for policy, answer in result.answers.items()}
    full, snap, recall = summaries["full"], summaries["snapkv"], summaries["snapkv-recall"]
    assert full.prompt_tokens == snap.prompt_tokens == recall.prompt_tokens > 3000
    assert full.omitted_rows == 0 and snap.omitted_rows == recall.omitted_rows > 0
    assert snap.retained_rows * 3 < full.retained_rows  # 25% of the rows kept
    assert snap.bytes_moved < full.bytes_moved and recall.ledger.page_summary_bytes > 0
    assert full.ledger.full_payload_bytes == snap.ledger.full_payload_bytes == recall.ledger.full_payload_bytes
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
