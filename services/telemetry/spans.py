"""Tracing helper: one context manager over the OpenTelemetry API.

    with span("kv.verify", request_id=rid, state_generation=3) as current:
        ...
        current.set_attribute("retained_rows", rows)

Without a configured tracer provider the API hands out no-op spans, so services and tests
pay nothing until the observability setup installs an exporter. Attribute values that are
None are dropped; other non-primitive values are recorded as strings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.util.types import AttributeValue

TRACER_NAME = "kvrelay"
_PRIMITIVE = (bool, str, int, float)


@contextmanager
def span(name: str, parent: context.Context | None = None, **attributes: object) -> Iterator[trace.Span]:
    """Start a span named `name` (child of the current span, or of `parent` when given),
    record exceptions on it, and end it on exit."""
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(name, context=parent, attributes=_attributes(attributes)) as current:
        yield current


def extract_context(carrier: Mapping[str, str]) -> context.Context:
    """The trace context of a W3C text-map carrier (traceparent, tracestate)."""
    return propagate.extract(dict(carrier))


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
