"""`kvrelay bench transfer` end to end on a tiny view (a real decode-side process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.transfer.bench import (
    TransferBenchConfig,
    bench_view,
    print_transfer_report,
    run_transfer_bench,
)
from services.transfer.layout import ViewLayout

pytestmark = pytest.mark.timeout(120)


def test_bench_moves_the_view_both_ways_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = TransferBenchConfig(num_layers=3, num_kv_heads=2, rows_per_head=16, head_dim=8, repeats=2)
    result = run_transfer_bench(config)
    view = bench_view(config)
    assert result.bytes_per_transfer == ViewLayout.of(view).nbytes == view.payload_bytes + view.metadata_bytes
    assert len(result.gloo_s) == len(result.tcp_s) == len(result.first_layer_s) == 2
    assert all(first <= full for first, full in zip(result.first_layer_s, result.full_view_s, strict=True))
    assert result.ratio == pytest.approx(result.gloo_bytes_per_s / result.tcp_bytes_per_s)

    out = tmp_path / "bench.json"
    print_transfer_report(result, out)
    assert "gloo / TCP" in capsys.readouterr().out
    assert json.loads(out.read_text())["bytes_per_transfer"] == result.bytes_per_transfer
