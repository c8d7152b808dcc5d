"""Telemetry of one service process, set up once at its `kvrelay serve <role>` entry point:

    with observed(TelemetryConfig("decode", log_format="json", metrics_port=9094)):
        asyncio.run(serve(config))

logs (`services.telemetry.logs`: text or JSON, with trace and request ids), tracing
(`services.telemetry.tracing`: OTLP when the `OTEL_*` environment asks for it, nothing
otherwise) and the Prometheus endpoint of the role (`services.telemetry.metrics`). On exit
the metrics endpoint closes and every batched span is exported.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from services.telemetry.logs import LOG_FORMATS, configure_logging
from services.telemetry.metrics import ROLES, serve_metrics
from services.telemetry.tracing import configure_tracing

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class TelemetryConfig:
    """`role` is one of gateway, policy, prefill, decode; `metrics_port` 0 turns the metrics
    endpoint off; it listens on `metrics_host` (the service's own interface)."""

    role: str
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: {self.role!r} is not one of {ROLES}")
        if self.log_level.upper() not in _LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {_LEVELS}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: {self.log_format!r} is not one of {LOG_FORMATS}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: {self.metrics_port} is not in [0, 65535]")

    @property
    def service_name(self) -> str:
        """The default OpenTelemetry service name (OTEL_SERVICE_NAME overrides it)."""
        return f"kvrelay-{self.role}"


@contextmanager
def observed(config: TelemetryConfig) -> Iterator[None]:
    """Logs, tracing and metrics for the block (the whole life of a service process)."""
    configure_logging(config.log_level, config.log_format, config.service_name)
    tracing = configure_tracing(config.service_name)
    endpoint = serve_metrics(config.role, config.metrics_host, config.metrics_port)
    try:
        yield
    finally:
        if endpoint is not None:
            endpoint.stop()
        tracing.shutdown()
