"""Client side of gRPC trace propagation: every grpc.aio channel of the process gets two
interceptors that open a CLIENT span per call, send its context in the call's metadata (W3C
`traceparent`), and end the span when the call has finished, however it finished.

The span ends on the call's final status, not when the caller stops reading: a caller of a
server-streaming call that stops after the last message it needs (the gateway after the
decode worker's summary), cancels, or times out still closes the span with the right status.
`instrument_channels()` patches `grpc.aio.insecure_channel`/`secure_channel` (so channels
created anywhere carry context); the returned `ChannelInstrumentation.remove()` undoes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from opentelemetry import propagate, trace

from services.telemetry.spans import TRACER_NAME

Traced = Callable[[str], bool]
_TRACER = trace.get_tracer(TRACER_NAME)


def _method(details: grpc.aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else method


class _CallSpans:
    """Opens a CLIENT span per call and ends it once the call's status is known."""

    def __init__(self, traced: Traced) -> None:
        self._traced = traced
        self._finishing: set[asyncio.Task[None]] = set()

    def traced(self, details: grpc.aio.ClientCallDetails) -> bool:
        return self._traced(_method(details))

    def start(self, details: grpc.aio.ClientCallDetails) -> tuple[trace.Span, grpc.aio.ClientCallDetails]:
        method = _method(details)
        service, _, name = method.lstrip("/").partition("/")
        span = _TRACER.start_span(
            method, kind=trace.SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
        return span, details._replace(metadata=metadata)

    def end_when_done(self, span: trace.Span, call: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._finish(span, call))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    @staticmethod
    async def _finish(span: trace.Span, call: Any) -> None:
        try:
            code = await call.code()
        except asyncio.CancelledError:  # the event loop is closing
            code = grpc.StatusCode.CANCELLED
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
        span.end()


class _Intercepting:
    def __init__(self, spans: _CallSpans) -> None:
        self._spans = spans

    async def _intercept(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        if not self._spans.traced(client_call_details):
            return await continuation(client_call_details, request)
        span, details = self._spans.start(client_call_details)
        call = await continuation(details, request)
        self._spans.end_when_done(span, call)
        return call


class _UnaryUnary(_Intercepting, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_Intercepting, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class ChannelInstrumentation:
    """The patch `instrument_channels` applied; `remove()` restores grpc.aio."""

    def __init__(self, insecure: Any, secure: Any) -> None:
        self._insecure = insecure
        self._secure = secure

    def remove(self) -> None:
        grpc.aio.insecure_channel = self._insecure
        grpc.aio.secure_channel = self._secure


def instrument_channels(traced: Traced) -> ChannelInstrumentation:
    """Make every grpc.aio channel created from now on propagate the current trace for the
    methods `traced(method)` accepts (client interceptors go first)."""
    spans = _CallSpans(traced)
    interceptors = [_UnaryUnary(spans), _UnaryStream(spans)]
    original = ChannelInstrumentation(grpc.aio.insecure_channel, grpc.aio.secure_channel)

    def insecure_channel(*args: Any, **kwargs: Any) -> Any:
        kwargs["interceptors"] = [*interceptors, *(kwargs.get("interceptors") or ())]
        return original._insecure(*args, **kwargs)

    def secure_channel(*args: Any, **kwargs: Any) -> Any:
        kwargs["interceptors"] = [*interceptors, *(kwargs.get("interceptors") or ())]
        return original._secure(*args, **kwargs)

    grpc.aio.insecure_channel = insecure_channel
    grpc.aio.secure_channel = secure_channel
    return original
