"""`kvrelay bench policy --tls` runs both transports in one run (tiny settings) and reports both."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy_service.tls_bench import (
    Identities,
    TlsBenchConfig,
    pooled,
    render_markdown,
    report_rows,
    run_tls_bench,
)
from services.security.certs import default_bundle


def test_mtls_identities_are_the_bundles_certificates(tmp_path: Path) -> None:
    default_bundle(tmp_path)
    mtls = Identities.for_transport("mtls", tmp_path)
    assert mtls.server_args[:2] == ("--tls-cert", str(tmp_path / "policy.pem"))
    assert {mtls.gateway.mode, mtls.prefill.mode, mtls.operator.mode} == {"mtls"}
    assert mtls.prefill.cert_chain == (tmp_path / "prefill.pem").read_bytes()
    assert Identities.for_transport("plaintext", tmp_path).server_args == ("--plaintext",)


def test_rounds_pool_into_one_run() -> None:
    assert pooled([(3, 0.5, [0.2, 0.1]), (2, 0.5, [0.15])]) == (5, 1.0, [0.1, 0.15, 0.2])


def test_config_refuses_unknown_transports() -> None:
    with pytest.raises(ValueError, match="transports"):
        TlsBenchConfig(transports=("plaintext", "tls"))


@pytest.mark.slow
async def test_both_transports_run_and_the_report_has_both() -> None:
    config = TlsBenchConfig(
        concurrency=(1, 2), seconds=0.25, warmup_s=0.1, rounds=2, handshake_channels=2
    )
    result = await run_tls_bench(config)
    assert {(m.path, m.clients) for m in result.throughput} == {
        (t, c) for t in ("plaintext", "mtls") for c in (1, 2)
    }
    assert all(m.ops > 0 and m.p50_ms > 0 and m.seconds == 0.5 for m in result.throughput)
    assert [h.transport for h in result.handshakes] == ["plaintext", "mtls"]
    assert all(
        h.channels == 2 and h.first_call_ms > 0 and h.next_call_ms > 0 for h in result.handshakes
    )
    rows = report_rows(result)
    assert [r["clients"] for r in rows] == [1, 2]
    assert all(
        r["mtls_ops_per_s"] and r["plaintext_ops_per_s"] and r["mtls_over_plaintext_ops"]
        for r in rows
    )
    text = render_markdown(config, result, "kvrelay bench policy --tls", "test")
    assert "| plaintext | 2 |" in text and "| mtls | 2 |" in text and "mTLS/plaintext" in text
