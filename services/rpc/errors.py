"""Typed service errors and the one place that maps errors to gRPC status codes.

Servicers raise typed errors (these, the kvpolicy core's `KVPolicyError`, or Redis
connection errors) and decorate their methods with `@maps_errors`; the decorator aborts
the call with the mapped status code and a serialized `ErrorDetail` (reason, field,
message, and for stale generations the current fence) in the trailing metadata key
`kvrelay-error-bin`. Clients read it back with `error_detail(rpc_error)`.

| error                                   | status code          |
| --------------------------------------- | -------------------- |
| `KVPolicyError`, `InvalidArgument`      | INVALID_ARGUMENT     |
| `NotFound`                              | NOT_FOUND            |
| `AlreadyExists`                         | ALREADY_EXISTS       |
| `FailedPrecondition` (stale generation) | FAILED_PRECONDITION  |
| `Unavailable`, Redis connection errors  | UNAVAILABLE          |
| `ResourceExhausted` (capacity, budgets) | RESOURCE_EXHAUSTED   |
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
import redis.exceptions
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.kvpolicy.errors import KVPolicyError, ManifestInvalid
from services.rpc.kvrelay.v1 import common_pb2

ERROR_DETAIL_KEY = "kvrelay-error-bin"

_REDIS_UNAVAILABLE = (
    redis.exceptions.ConnectionError,  # includes AuthenticationError
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
)


class ServiceError(Exception):
    """An error that crosses the RPC edge: a status code, a reason and the field it names."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN
    reason: ClassVar[common_pb2.ErrorReason] = common_pb2.ERROR_REASON_UNSPECIFIED

    def __init__(self, message: str, *, field: str = "") -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def detail(self) -> common_pb2.ErrorDetail:
        """The ErrorDetail sent next to the status code."""
        return common_pb2.ErrorDetail(reason=self.reason, field=self.field, message=self.message)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = common_pb2.ERROR_REASON_REQUEST_INVALID


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND
    reason = common_pb2.ERROR_REASON_NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = common_pb2.ERROR_REASON_MANIFEST_CONFLICT


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = common_pb2.ERROR_REASON_STALE_GENERATION


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = common_pb2.ERROR_REASON_BACKEND_UNAVAILABLE


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = common_pb2.ERROR_REASON_CAPACITY


@dataclass(frozen=True)
class RpcStatus:
    """What the edge sends for one error."""

    code: grpc.StatusCode
    detail: common_pb2.ErrorDetail

    @property
    def message(self) -> str:
        field = self.detail.field
        return f"{field}: {self.detail.message}" if field else self.detail.message


def status_for(exc: BaseException) -> RpcStatus | None:
    """The status code and detail for a known error type; None lets grpc report UNKNOWN."""
    if isinstance(exc, ServiceError):
        return RpcStatus(exc.code, exc.detail())
    if isinstance(exc, KVPolicyError):
        reason = (
            common_pb2.ERROR_REASON_MANIFEST_INVALID
            if isinstance(exc, ManifestInvalid)
            else common_pb2.ERROR_REASON_REQUEST_INVALID
        )
        detail = common_pb2.ErrorDetail(reason=reason, field=exc.field, message=exc.reason)
        return RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, detail)
    if isinstance(exc, _REDIS_UNAVAILABLE):
        detail = common_pb2.ErrorDetail(
            reason=common_pb2.ERROR_REASON_BACKEND_UNAVAILABLE,
            message=f"redis unavailable: {type(exc).__name__}: {exc}",
        )
        return RpcStatus(grpc.StatusCode.UNAVAILABLE, detail)
    return None


def error_detail(error: grpc.aio.AioRpcError) -> common_pb2.ErrorDetail | None:
    """The ErrorDetail a kvrelay server attached to a failed call, if any."""
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_DETAIL_KEY and isinstance(value, bytes):
            return common_pb2.ErrorDetail.FromString(value)
    return None


async def abort_with(context: grpc.aio.ServicerContext, status: RpcStatus) -> None:
    """Abort the call with `status`, its detail in the trailing metadata."""
    metadata = ((ERROR_DETAIL_KEY, status.detail.SerializeToString()),)
    await context.abort(status.code, status.message, trailing_metadata=metadata)


Handler = TypeVar("Handler", bound=Callable[..., Any])


def maps_errors(method: Handler) -> Handler:
    """Decorate an async servicer method (unary or server-streaming) so that typed errors
    become status codes through `status_for`; unknown errors propagate (UNKNOWN)."""
    if inspect.isasyncgenfunction(method):
        return _wrap_stream(method)  # type: ignore[return-value]
    return _wrap_unary(method)  # type: ignore[return-value]


def _wrap_unary(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await method(self, request, context)
        except Exception as exc:
            status = status_for(exc)
            if status is None:
                raise
        await abort_with(context, status)

    return unary


def _wrap_stream(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(method)
    async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in method(self, request, context):
                yield item
            return
        except Exception as exc:
            status = status_for(exc)
            if status is None:
                raise
        await abort_with(context, status)

    return stream


def reject_unknown_fields(message: Message, path: str = "") -> None:
    """Raise InvalidArgument if `message` (or a nested message) carries fields this schema
    does not define, including a known field number sent with the wrong wire type (e.g. a
    string where an integer generation belongs), which protobuf would otherwise drop and
    leave at its default."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        number = unknown[0].field_number
        known = message.DESCRIPTOR.fields_by_number.get(number)
        name = _join(path, known.name if known else f"#{number}")
        problem = "wrong wire type for this field" if known else "unknown field"
        raise InvalidArgument(f"{problem} (field number {number})", field=name)
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        values = value if descriptor.is_repeated else [value]
        for index, item in enumerate(values):
            suffix = f"[{index}]" if descriptor.is_repeated else ""
            reject_unknown_fields(item, _join(path, descriptor.name) + suffix)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
