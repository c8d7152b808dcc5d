"""The policy core demo (`kvrelay demo`) runs end to end and prints consistent tables."""

from __future__ import annotations

import io
import time

import torch
from rich.console import Console
from typer.testing import CliRunner

from kvrelay.cli import app
from services.demo.policy_demo import PROMPT_LEN, run_demo

torch.set_num_threads(1)


def test_run_demo_prints_positions_budgets_and_ledger() -> None:
    out = io.StringIO()
    started = time.perf_counter()
    result = run_demo(Console(file=out, width=160))
    assert time.perf_counter() - started < 5.0
    text = out.getvalue()
    assert "retained positions per layer / K/V head" in text
    assert "byte ledger" in text
    assert result.receipt.digest in text
    assert result.ledger.visible_rows == result.view.total_rows
    assert result.ledger.visible_payload_bytes == result.view.payload_bytes
    assert result.ledger.full_rows == 4 * 2 * PROMPT_LEN
    assert sum(map(sum, result.budgets)) == 4 * 2 * 4  # capacity 12 - window 8, conserved
    assert result.receipt.selected_positions == result.selected
    assert result.receipt.manifest_sha256 == result.manifest.sha256
    window = tuple(range(PROMPT_LEN - 8, PROMPT_LEN))
    assert all(owner[-8:] == window for layer in result.selected for owner in layer)


def test_demo_finds_the_needles_in_the_first_layer() -> None:
    result = run_demo(Console(file=io.StringIO()))
    retained = set(result.selected[0][0]) | set(result.selected[0][1])
    assert {5, 17} <= retained


def test_kvrelay_demo_command() -> None:
    outcome = CliRunner().invoke(app, ["demo", "--core"])
    assert outcome.exit_code == 0, outcome.output
    assert "byte ledger" in outcome.output
