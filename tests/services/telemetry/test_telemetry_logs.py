"""Structured logs: JSON lines carry the trace and span ids of the span they were logged
under and the request id bound by a kvrelay span; text logs keep the plain format."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.telemetry.logs import JsonFormatter, TraceContextFilter, bound_request_id, log_handler
from services.telemetry.spans import span


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(TraceContextFilter())
    handler.setFormatter(JsonFormatter("kvrelay-test"))
    logger = logging.getLogger("kvrelay.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, stream
    logger.removeHandler(handler)


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_current_span_and_bound_request_id(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    # A private SDK provider: its spans become current through the API's context, which is
    # all the log filter reads (the process-global provider stays untouched).
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("outer") as outer, bound_request_id("req-7"):
        logger.info("inside %s", "the span")
    logger.warning("outside")
    inside, outside = _records(stream)
    ids = outer.get_span_context()
    assert inside["message"] == "inside the span" and inside["level"] == "INFO"
    assert inside["trace_id"] == trace.format_trace_id(ids.trace_id)
    assert inside["span_id"] == trace.format_span_id(ids.span_id)
    assert inside["request_id"] == "req-7" and inside["service"] == "kvrelay-test"
    assert inside["logger"] == "kvrelay.test.logs" and str(inside["ts"]).endswith("Z")
    assert set(outside) == {"ts", "level", "service", "logger", "message"}


def test_a_kvrelay_span_binds_its_request_id_and_extra_overrides_it(
    captured: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = captured
    with span("kv.verify", request_id="req-8", state_generation=1):
        logger.info("verified")
        logger.info("other", extra={"request_id": "req-9"})
    logger.info("after")
    verified, other, after = _records(stream)
    assert (verified["request_id"], other["request_id"]) == ("req-8", "req-9")
    assert "request_id" not in after


def test_exceptions_are_one_json_field(captured: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = captured
    try:
        raise ValueError("bad field")
    except ValueError:
        logger.exception("failed")
    (record,) = _records(stream)
    assert record["message"] == "failed" and "ValueError: bad field" in str(record["exception"])


def test_text_format_and_unknown_formats() -> None:
    handler = log_handler("text", "kvrelay-test")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    assert handler.format(record).endswith("INFO x: hello there")
    with pytest.raises(ValueError, match="log_format"):
        log_handler("xml", "kvrelay-test")
