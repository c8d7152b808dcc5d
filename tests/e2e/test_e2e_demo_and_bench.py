"""`kvrelay demo` and `kvrelay bench e2e` against the session stack: the demo asks its needle
question under `full` and `snapkv` and prints both answers and the byte ledger; one bench cell
measures both sides and reports the bytes that moved."""

from __future__ import annotations

import asyncio
import io

import pytest
from e2e_helpers import UpStack
from rich.console import Console

from services.gateway.client import GatewayClient
from services.launcher.bench import E2EBenchConfig, bench_manifests, measure, register_manifests
from services.launcher.demo import ask, demo_prompt
from services.model import LoadedModel

pytestmark = pytest.mark.timeout(120)


def test_demo_prints_both_answers_and_the_ledger(stack: UpStack) -> None:
    out = io.StringIO()
    result = ask(stack.gateway_address, demo_prompt(512), Console(file=out, width=160))
    text = out.getvalue()
    assert set(result.answers) == {"full", "snapkv"}
    assert f"answers (expected: {result.prompt.answer})" in text and "byte ledger" in text
    full, snap = result.answers["full"].summary, result.answers["snapkv"].summary
    assert full.omitted_rows == 0 and snap.omitted_rows > 0
    assert snap.bytes_moved < full.bytes_moved
    assert full.ledger.full_payload_bytes == snap.ledger.full_payload_bytes


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
