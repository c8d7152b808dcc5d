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
    # The receiver checked every warm view against the sender's payload digest (a mismatch
    # would have ended the bench); both digests are timed apart from the transfer.
    assert len(result.digest_send_s) == len(result.digest_recv_s) == 2
    assert result.digest_recv_fraction > 0 and result.digest_send_fraction > 0

    out = tmp_path / "bench.json"
    print_transfer_report(result, out)
    printed = capsys.readouterr().out
    assert "gloo / TCP" in printed and "payload digest (xxh3-128" in printed
    numbers = json.loads(out.read_text())
    assert numbers["bytes_per_transfer"] == result.bytes_per_transfer
    assert numbers["digest_recv_fraction"] == result.digest_recv_fraction
