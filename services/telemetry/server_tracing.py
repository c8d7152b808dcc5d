"""The gRPC server span of every traced call: OpenTelemetry's aio server interceptor, except
that a response stream closes the handler's generator itself.

Upstream iterates the handler's generator with `async for` and never closes it; when the call
is cancelled, Python finalises that generator later in a task of its own, whose contextvars
Context is not the call's, so the handler's `with` blocks (spans, a bound request id) cannot
reset their context tokens there and log `... was created in a different Context` at ERROR.
Closing it here, in the call's task, unwinds them where they were entered. The outer layer,
`services.telemetry.metrics`, closes this one the same way. Imported only when tracing is on.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry.instrumentation.grpc import _aio_server


class ClosingAioServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
    """`opentelemetry.instrumentation.grpc.aio_server_interceptor`, whose response streams
    close the handler's generator in the call's own task (see the module docstring)."""

    def _intercept_aio_server_stream(
        self,
        behavior: Callable[..., AsyncGenerator[Any, None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with (
                self._set_remote_context(context),
                self._start_span(
                    handler_call_details, context, set_status_on_exception=False
                ) as span,
            ):
                traced = _aio_server._OpenTelemetryAioServicerContext(context, span)
                try:
                    async with contextlib.aclosing(behavior(request, traced)) as responses:
                        async for response in responses:
                            yield response
                except Exception as error:
                    # A bare Exception is grpc's abort, which the context wrapper records.
                    if type(error) is not Exception:
                        span.record_exception(error)
                    raise

        return stream
