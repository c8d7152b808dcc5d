"""Tracing helpers over the OpenTelemetry API, used by every pipeline stage.

    with span("kv.verify", parent, request_id=rid, state_generation=3) as current:
        ...
        current.set_attribute("retained_rows", rows)

Without a configured tracer provider (`services.telemetry.tracing`) the API hands out no-op
spans, so services and tests pay nothing until an exporter is installed. Attribute values
that are None are dropped; other non-primitive values are recorded as strings. A span given
a `request_id` also binds it for log records (`services.telemetry.logs`), and a span left by
an exception records it with its status code and the field it names (kvrelay's typed errors).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.util.types import AttributeValue

from services.telemetry.logs import bound_request_id

TRACER_NAME = "kvrelay"
# A proxy until a provider is installed, then it delegates to that provider's tracer.
_TRACER = trace.get_tracer(TRACER_NAME)
_PRIMITIVE = (bool, str, int, float)


# `parent` is positional-only in span/start_span so that an attribute mapping passed as
# `**attributes` can never bind it.
@contextmanager
def span(name: str, parent: context.Context | None = None, /, **attributes: object) -> Iterator[trace.Span]:
    """Start a span named `name` (child of the current span, or of `parent` when given) as
    the current span, record an exception that leaves it, and end it on exit."""
    request_id = attributes.get("request_id")
    with (
        bound_request_id(request_id if isinstance(request_id, str) else None),
        _TRACER.start_as_current_span(name, context=parent, attributes=_attributes(attributes)) as current,
    ):
        try:
            yield current
        except Exception as exc:
            record_error(current, exc)
            raise


def start_span(name: str, parent: context.Context | None = None, /,
               **attributes: object) -> trace.Span:
    """Start a span that the caller ends (`span.end()`), without making it current: for work
    that spans many iterations of a loop on another thread (decode step batches)."""
    return _TRACER.start_span(name, context=parent, attributes=_attributes(attributes))


def start_server_span(name: str, headers: Mapping[str, str], /, **attributes: object) -> trace.Span:
    """Start (not make current) the SERVER span of a request that arrived over HTTP,
    continuing the caller's trace when `headers` carry W3C `traceparent`. The caller ends it:
    a streamed response outlives its handler, so the span is entered with `trace.use_span`."""
    parent = propagate.extract({key.lower(): value for key, value in headers.items()})
    return _TRACER.start_span(name, context=parent, kind=trace.SpanKind.SERVER,
                              attributes=_attributes(attributes))


@contextmanager
def rpc_span(name: str, kind: trace.SpanKind, carrier: Mapping[str, str] | None = None, /) -> Iterator[trace.Span]:
    """The span of one RPC-like call that is not a gRPC call of its own (a call inside a policy
    Session stream), named and shaped like opentelemetry-instrumentation-grpc's spans: `name`
    is "/package.Service/Method"; a SERVER span continues the trace of the caller's W3C
    `carrier`, a CLIENT span is a child of the current span. Current while the call runs; a
    typed error leaving it is recorded."""
    parent = propagate.extract(dict(carrier)) if carrier is not None else None
    service, _, method = name.lstrip("/").partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
    with _TRACER.start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as current:
        try:
            yield current
        except Exception as exc:
            record_error(current, exc)
            raise


def record_span(name: str, parent: context.Context | None, duration_s: float, /,
                error: str | None = None, **attributes: object) -> None:
    """Record a span for work that another component ran and timed: it ends now and lasted
    `duration_s`; `error`, when given, marks it failed with that description."""
    end = time.time_ns()
    start = end - max(0, int(duration_s * 1e9))
    recorded = _TRACER.start_span(name, context=parent, attributes=_attributes(attributes), start_time=start)
    if error is not None:
        recorded.set_status(trace.Status(trace.StatusCode.ERROR, error))
    recorded.end(end_time=end)


def annotate(**attributes: object) -> None:
    """Set attributes on the current span (e.g. the server span of an RPC)."""
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(_attributes(attributes))


def record_error(current: trace.Span, exc: BaseException) -> None:
    """Name the error on `current`: its type, and for kvrelay's typed errors the status code
    they map to at the RPC edge and the field they name."""
    code = getattr(exc, "code", None)
    current.set_attributes(_attributes({
        "error.type": type(exc).__name__,
        "error.status": getattr(code, "name", None),
        "error.field": getattr(exc, "field", None) or None,
    }))


def extract_context(carrier: Mapping[str, str]) -> context.Context:
    """The trace context of a W3C text-map carrier (traceparent, tracestate); the current
    context when the carrier holds none, so an empty carrier never starts a new trace."""
    return propagate.extract(dict(carrier), context=context.get_current())


def inject_context() -> dict[str, str]:
    """The current trace context as a W3C text-map carrier, to send to another service."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def _attributes(values: Mapping[str, object]) -> dict[str, AttributeValue]:
    return {
        key: value if isinstance(value, _PRIMITIVE) else str(value)
        for key, value in values.items()
        if value is not None
    }
