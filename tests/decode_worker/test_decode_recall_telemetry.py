"""What a recall leaves in telemetry: one `kv.recall` span per fetch with pages, rows, bytes,
latency and outcome (an error status when the rows did not come back), and the decode role's
Prometheus families — recalls by outcome, rows, bytes, the latency histogram, fallbacks by
kind. The decode loop runs in a fresh interpreter (`recall_telemetry_probe.py`) so that its
in-memory span exporter, a process-global tracer provider, touches no other test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("recall_telemetry_probe.py"))],
                          capture_output=True, text=True, timeout=100, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_merged_recall_is_one_span_with_its_pages_rows_bytes_and_latency(probe: dict) -> None:
    local = probe["finished"]["local"]
    assert local["recall_count"] == 1 and local["recalled_rows"] > 0 and local["fallbacks"] == []
    ok = [s for s in probe["spans"] if s["attributes"]["request_id"] == "probe-local"]
    assert len(ok) == 1
    span = ok[0]["attributes"]
    assert ok[0]["status"] == "UNSET" and span["outcome"] == "ok" and span["full_recall"] is True
    assert span["rows"] == local["recalled_rows"] and span["bytes"] == local["recalled_bytes"] > 0
    assert span["pages"] >= span["rows"] / 4 and span["latency_ms"] >= 0
    assert span["state_generation"] == 2 and span["step"] == 0
    # The session counts the recall and every decoded row; the summary reports that generation.
    assert local["cache_generation"] == 1 + (local["output_tokens"] - 1) + 1


def test_rows_that_cannot_come_back_are_error_spans_and_counted_fallbacks(probe: dict) -> None:
    gone = probe["finished"]["gone"]
    assert gone["recall_count"] == 0 and gone["recalled_rows"] == 0
    assert gone["fallbacks"] and set(gone["fallbacks"]) == {"recall_unavailable:continue_lossy"}
    failed = [s for s in probe["spans"] if s["attributes"]["request_id"] == "probe-gone"]
    assert len(failed) == len(gone["fallbacks"]) == gone["output_tokens"] - 1  # one per evaluated step
    for span in failed:
        assert span["status"] == "ERROR" and span["attributes"]["outcome"] == "unavailable"
        assert span["attributes"]["rows"] == 0 and "UNAVAILABLE" in span["attributes"]["reason"]


def test_the_decode_role_exposes_recall_counts_rows_bytes_latency_and_fallbacks(probe: dict) -> None:
    metrics, finished = probe["metrics"], probe["finished"]
    fallbacks = len(finished["gone"]["fallbacks"])
    assert metrics["kvrelay_recalls_total{outcome=ok}"] == 1
    assert metrics["kvrelay_recalls_total{outcome=unavailable}"] == fallbacks
    assert metrics["kvrelay_recall_rows_total{}"] == finished["local"]["recalled_rows"]
    assert metrics["kvrelay_recall_bytes_total{}"] == finished["local"]["recalled_bytes"]
    assert metrics["kvrelay_recall_seconds_count{}"] == 1 + fallbacks
    assert metrics["kvrelay_recall_fallbacks_total{kind=recall_unavailable:continue_lossy}"] == fallbacks
