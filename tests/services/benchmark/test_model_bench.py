"""`kvrelay bench model` on a toy size: every number is produced, packed views hold the
budgeted rows, and our full-cache greedy tokens agree with transformers' generate."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from services.benchmark.model_bench import BenchConfig, run
from services.model import InvalidModelInput

torch.set_num_threads(1)


def test_bench_reports_every_configuration(tmp_path):
    config = BenchConfig(
        contexts=(40, 80), fractions=(0.5, 0.25), layers=2, hidden_size=64,
        intermediate_size=96, num_q_heads=4, num_kv_heads=2, vocab_size=128,
        decode_steps=3, obs_window=8, chunk_size=32,
    )
    console = Console(record=True, width=160)
    results = run(config, console, json_out=tmp_path / "bench.json")
    assert [r.context for r in results] == [40, 80]
    for r in results:
        assert set(r.decode_ms) == {"full", "keep 50%", "keep 25%"}
        assert all(ms > 0 for ms in r.decode_ms.values())
        owners = config.layers * config.num_kv_heads
        assert r.kept_rows["full"] == r.context * owners
        assert r.kept_rows["keep 50%"] == round(0.5 * r.context) * owners
        assert r.kept_rows["keep 25%"] == round(0.25 * r.context) * owners
        assert r.greedy_tokens_match is True
        assert r.prefill_tokens_per_s > 0 and r.reference_prefill_tokens_per_s
    text = console.export_text()
    assert "H_q=4, H_kv=2, d_h=16" in text and "10% / full" not in text and "25% / full" in text
    assert json.loads((tmp_path / "bench.json").read_text())["results"][1]["context"] == 80


def test_bench_config_is_validated():
    with pytest.raises(InvalidModelInput, match="bench.contexts"):
        BenchConfig(contexts=(16,), obs_window=32)
    with pytest.raises(InvalidModelInput, match="bench.fractions"):
        BenchConfig(fractions=(1.5,))
