"""`kvrelay bench tls`: a plaintext and a mutual-TLS stack serve the same prompts in one run."""

from __future__ import annotations

import pytest

from services.launcher.tls_bench import (
    RequestTiming,
    TlsE2EConfig,
    TransportResult,
    pooled,
    render_markdown,
    report_rows,
    run_tls_e2e_bench,
)
from services.model.default import DEMO_CHECKPOINT


def timing(ttft: float, tpot: float) -> RequestTiming:
    return RequestTiming(ttft, tpot, ttft - 1, tpot, output_tokens=4)


def test_rows_are_p50s_and_the_ratio_divides_them() -> None:
    plain = TransportResult(
        "plaintext", 1, 10.0, 50.0, (timing(10, 2), timing(30, 4), timing(20, 3))
    )
    mtls = TransportResult("mtls", 1, 12.0, 60.0, (timing(22, 3.3), timing(40, 9), timing(21, 3)))
    rows = report_rows([plain, mtls])
    assert [r["stack"] for r in rows] == [
        "plaintext #1",
        "mtls #1",
        "mtls/plaintext #1",
        "mtls/plaintext (geomean of pairs)",
    ]
    assert {**rows[2], "stack": ""} == {**rows[3], "stack": ""}  # one pair: its own ratio
    assert (rows[0]["client_ttft_ms_p50"], rows[1]["client_ttft_ms_p50"]) == (20, 22)
    assert rows[2]["client_ttft_ms_p50"] == 1.1 and rows[2]["client_tpot_ms_p50"] == 1.1
    assert rows[2]["first_request_ttft_ms"] == 1.2


def test_the_summary_ratio_is_the_geometric_mean_of_the_pairs() -> None:
    results = [
        TransportResult("plaintext", 1, 10.0, 50.0, (timing(10, 2),)),
        TransportResult("mtls", 1, 10.0, 50.0, (timing(20, 2),)),
        TransportResult("plaintext", 2, 10.0, 50.0, (timing(40, 2),)),
        TransportResult("mtls", 2, 10.0, 50.0, (timing(20, 2),)),
    ]
    rows = report_rows(results + [pooled(results, "plaintext"), pooled(results, "mtls")])
    assert rows[-1]["stack"] == "mtls/plaintext (geomean of pairs)"
    assert rows[-1]["client_ttft_ms_p50"] == 1.0  # sqrt(2 * 0.5)
    assert rows[-1]["client_tpot_ms_p50"] == 1.0


def test_pooling_joins_the_pairs_requests() -> None:
    first = TransportResult("mtls", 1, 10.0, 50.0, (timing(10, 2),))
    second = TransportResult("mtls", 2, 14.0, 70.0, (timing(30, 4), timing(20, 3)))
    both = pooled([first, second], "mtls")
    assert (both.pair, both.label, both.startup_s, both.first_ttft_ms) == (
        0,
        "mtls (all)",
        12.0,
        60.0,
    )
    assert both.p50("client_ttft_ms") == 20


def test_config_bounds_the_prompt_count() -> None:
    with pytest.raises(ValueError, match="prompts"):
        TlsE2EConfig(DEMO_CHECKPOINT, prompts=0)


@pytest.mark.slow
def test_both_stacks_serve_the_same_prompts() -> None:
    config = TlsE2EConfig(
        DEMO_CHECKPOINT, prompts=2, pairs=1, warmup=1, context=32, max_tokens=4, start_timeout_s=120
    )
    results = run_tls_e2e_bench(config)
    assert [r.label for r in results] == [
        "plaintext #1",
        "mtls #1",
        "plaintext (all)",
        "mtls (all)",
    ]
    for result in results:
        assert len(result.requests) == 2
        assert all(
            r.output_tokens == 4
            and r.client_ttft_ms > 0
            and r.client_tpot_ms > 0
            and r.gateway_ttft_ms > 0
            for r in result.requests
        )
    text = render_markdown(config, results, "kvrelay bench tls", "test")
    labels = (
        "plaintext #1",
        "mtls #1",
        "mtls/plaintext #1",
        "plaintext (all)",
        "mtls (all)",
        "mtls/plaintext (geomean of pairs)",
    )
    for label in labels:
        assert f"| {label} |" in text
