"""Re-wrapping a grpc method handler's behaviour, for the server interceptors (authorization,
metrics, request parsing): one place that knows how a handler of each kind is rebuilt with the
same (de)serializers around a wrapped behaviour, and their common shape (`HandlerInterceptor`)."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]
Wrap = Callable[[Behavior], Behavior]


def rewrap(
    handler: grpc.RpcMethodHandler,
    *,
    unary: Wrap | None = None,
    stream: Wrap | None = None,
    bidi: Wrap | None = None,
    async_only: bool = True,
    keep_deserializer: bool = True,
) -> grpc.RpcMethodHandler | None:
    """`handler` rebuilt around `unary(handler.unary_unary)`, `stream(handler.unary_stream)` or
    `bidi(handler.stream_stream)`, whichever kind it is and has a wrapper here; None when it is
    a kind without one (the caller decides what such a handler becomes).

    `async_only` wraps only coroutine (unary) and async-generator (streaming) behaviours: a
    stream that writes instead of yielding (health's Watch) cannot be wrapped by iterating it.
    Without `keep_deserializer` the rebuilt handler hands the behaviour the raw request bytes
    (for a wrapper that parses them itself)."""
    deserializer = handler.request_deserializer if keep_deserializer else None
    kinds = (
        (handler.unary_unary, unary, inspect.iscoroutinefunction, grpc.unary_unary_rpc_method_handler),
        (handler.unary_stream, stream, inspect.isasyncgenfunction, grpc.unary_stream_rpc_method_handler),
        (handler.stream_stream, bidi, inspect.isasyncgenfunction,
         grpc.stream_stream_rpc_method_handler),
    )
    for behavior, wrap, is_async, build in kinds:
        if behavior is None or wrap is None or (async_only and not is_async(behavior)):
            continue
        rebuilt: grpc.RpcMethodHandler = build(
            wrap(behavior), request_deserializer=deserializer,
            response_serializer=handler.response_serializer)
        return rebuilt
    return None


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """A server interceptor that looks each method's handler up and hands it, with the method's
    name, to `wrap` (a method without a handler stays without one)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self.wrap(handler, handler_call_details.method)

    @abc.abstractmethod
    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """The handler that serves `method` in place of `handler`."""
