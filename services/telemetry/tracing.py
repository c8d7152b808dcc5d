"""OpenTelemetry tracing of one service process, configured by the standard `OTEL_*` variables.

    tracing = configure_tracing("kvrelay-prefill")   # once, at the `kvrelay serve` entry point
    ...                                              # spans, gRPC context propagation
    tracing.shutdown()                               # flush what is still batched

Tracing is on when `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`; a comma list
is allowed) or, with it unset, when an OTLP endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, e.g. Jaeger's `http://jaeger:4317`). `OTEL_SDK_DISABLED=true`
or `OTEL_TRACES_EXPORTER=none` turn it off. Off means no SDK provider and no gRPC interceptors:
the API's no-op spans are all a request pays. On, the SDK reads the rest of the standard
variables itself: `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (resource),
`OTEL_TRACES_SAMPLER(_ARG)` (sampler), `OTEL_BSP_*` (batching), `OTEL_EXPORTER_OTLP_*`
(endpoint, headers, TLS, timeout, compression). Only OTLP over gRPC is exported.

Context crosses every gRPC hop in metadata (W3C `traceparent`): `server_interceptors()`
(opentelemetry-instrumentation-grpc) for `services.rpc.server`, and on the client side every
grpc.aio channel of the process (`services.telemetry.client_tracing`, patched in globally, so
channels created anywhere — policy client, worker pools, handoff — carry it). Health checks
and reflection are not traced. Across the torch.distributed transfer the context travels in
the `TransferDescriptor` (`services.telemetry.spans.inject_context`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from services.telemetry.client_tracing import ChannelInstrumentation, instrument_channels

log = logging.getLogger(__name__)

EXPORTERS = ("otlp", "console")
GRPC_PROTOCOL = "grpc"
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# gRPC services whose calls are never traced: probes and tooling, not requests.
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                     "grpc.reflection.v1.ServerReflection")
# Long-lived streams that carry calls of their own: each call is traced, the stream is not.
UNTRACED_METHODS = ("/kvrelay.v1.PolicyService/Session",)


@dataclass(frozen=True)
class TracingConfig:
    """What `configure_tracing` installs: `exporters` empty means tracing is off."""

    service_name: str
    exporters: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.service_name:
            raise ValueError("service_name: must not be empty")
        unknown = [name for name in self.exporters if name not in EXPORTERS]
        if unknown:
            raise ValueError(f"OTEL_TRACES_EXPORTER: {unknown} not among none, {', '.join(EXPORTERS)}")

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def tracing_config(default_service_name: str, environ: Mapping[str, str]) -> TracingConfig:
    """Decide from the `OTEL_*` variables in `environ` (pure; see the module docstring)."""
    service_name = environ.get("OTEL_SERVICE_NAME") or default_service_name
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingConfig(service_name)
    named = [name.strip().lower() for name in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if not named:
        named = ["otlp"] if any(environ.get(variable) for variable in _ENDPOINT_VARIABLES) else []
    exporters = tuple(dict.fromkeys(name for name in named if name != "none"))
    if "otlp" in exporters:
        _check_protocol(environ)
    return TracingConfig(service_name, exporters)


def _check_protocol(environ: Mapping[str, str]) -> None:
    for variable in _PROTOCOL_VARIABLES:
        protocol = environ.get(variable, "").strip().lower()
        if protocol:
            if protocol != GRPC_PROTOCOL:
                raise ValueError(f"{variable}: {protocol!r} is not supported; kvrelay exports OTLP over grpc")
            return


class Tracing:
    """The tracing of this process: `provider` is None when tracing is off."""

    def __init__(self, config: TracingConfig, provider: Any = None,
                 channels: ChannelInstrumentation | None = None) -> None:
        self.config = config
        self.provider = provider
        self._channels = channels

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def shutdown(self) -> None:
        """Export every span still batched (bounded by the exporter's timeout), stop tracing."""
        if self.provider is None:
            return
        global _active
        if self._channels is not None:
            self._channels.remove()
        self.provider.shutdown()
        self.provider = None
        _active = None


_active: Tracing | None = None


def configure_tracing(service_name: str, environ: Mapping[str, str] | None = None) -> Tracing:
    """Install the SDK tracer provider, its exporters and gRPC client instrumentation when
    the environment asks for tracing (once per process); otherwise install nothing."""
    global _active
    config = tracing_config(service_name, os.environ if environ is None else environ)
    if not config.enabled:
        return Tracing(config)
    if _active is not None:
        raise RuntimeError("configure_tracing: tracing is already configured in this process")
    provider = _provider(config)
    trace.set_tracer_provider(provider)
    _active = Tracing(config, provider, instrument_channels(traced_method))
    log.info("tracing on: service %s, exporters %s", config.service_name, ",".join(config.exporters))
    return _active


def server_interceptors() -> list[Any]:
    """gRPC server interceptors that continue the caller's trace (none when tracing is off)."""
    if _active is None:
        return []
    from opentelemetry.instrumentation.grpc import __version__ as version

    from services.telemetry.server_tracing import ClosingAioServerInterceptor

    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", version,
                              schema_url="https://opentelemetry.io/schemas/1.11.0")
    return [ClosingAioServerInterceptor(tracer, filter_=_traced)]


def _provider(config: TracingConfig) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The provider picks the sampler from OTEL_TRACES_SAMPLER; the resource merges
    # OTEL_RESOURCE_ATTRIBUTES; exporters and processors read their own OTEL_* variables.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: config.service_name}))
    for name in config.exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return provider


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def traced_method(method: str) -> bool:
    """False for the methods of `UNTRACED_SERVICES` and for `UNTRACED_METHODS`
    ("/package.Service/Method")."""
    return method.lstrip("/").split("/", 1)[0] not in UNTRACED_SERVICES and method not in UNTRACED_METHODS


def tracing_enabled() -> bool:
    """Whether this process exports traces (`configure_tracing` found an exporter)."""
    return _active is not None


def _traced(handler_call_details: Any) -> bool:
    return traced_method(handler_call_details.method)
