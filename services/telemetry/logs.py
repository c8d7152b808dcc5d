"""Structured logs: every record carries the trace id, span id and request id it was logged
under, and `--log-format json` (`KVRELAY_LOG_FORMAT=json`) writes one JSON object per line:

    {"ts": "2025-01-01T12:00:00.123Z", "level": "WARNING", "service": "kvrelay-decode",
     "logger": "decode_worker.service", "message": "transfer ... rejected: ...",
     "trace_id": "4bf92f35...", "span_id": "00f067aa...", "request_id": "req-1"}

The ids come from the current OpenTelemetry span (absent when tracing is off or the record
was logged outside any span) and from the request id a `span(..., request_id=...)` or
`bound_request_id` bound; `logger.info(..., extra={"request_id": rid})` overrides it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvrelay_request_id", default=None)


@contextmanager
def bound_request_id(request_id: str | None) -> Iterator[None]:
    """Records logged inside the block carry `request_id` (None keeps the outer one)."""
    if request_id is None:
        yield
        return
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


class TraceContextFilter(logging.Filter):
    """Stamps `trace_id`, `span_id` and `request_id` on each record (None where unknown).
    Attached to the handler, so it runs in the thread and context that logged the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = trace.get_current_span().get_span_context()
        record.trace_id = trace.format_trace_id(ids.trace_id) if ids.is_valid else None
        record.span_id = trace.format_span_id(ids.span_id) if ids.is_valid else None
        if getattr(record, "request_id", None) is None:
            record.request_id = _REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record; fields that are None are left out."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
            "trace_id": getattr(record, "trace_id", None),
            "span_id": getattr(record, "span_id", None),
            "request_id": getattr(record, "request_id", None),
        }
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps({key: value for key, value in payload.items() if value is not None}, default=str)


def log_handler(log_format: str, service: str) -> logging.Handler:
    """A stderr handler writing `log_format` ("text" or "json") with trace and request ids."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: {log_format!r} is not one of {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    return handler


def configure_logging(level: str, log_format: str, service: str) -> None:
    """Replace the root logger's handlers with one `log_handler` at `level`."""
    logging.basicConfig(level=level.upper(), handlers=[log_handler(log_format, service)], force=True)
