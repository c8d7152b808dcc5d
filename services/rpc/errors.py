"""Typed service errors and the one place that maps errors to gRPC status codes.

Servicers raise typed errors (these, the kvpolicy core's `KVPolicyError`, or Redis
connection errors) and decorate their methods with `@maps_errors`; the decorator aborts
the call with the mapped status code and a serialized `ErrorDetail` (reason, field,
message, and for stale generations the current fence) in the trailing metadata key
`kvrelay-error-bin`. Clients read it back with `error_detail(rpc_error)`. What the edge sends is
bounded (`MAX_MESSAGE_BYTES`, `MAX_FIELD_BYTES`) whatever a handler put in its message: gRPC
clients refuse trailers over 8 KB and would report RESOURCE_EXHAUSTED instead of the error.
A request that does not parse (corrupt wire format, a string field that is not UTF-8) is
INVALID_ARGUMENT naming the field when it can be told (`undecodable_request`).

| error                                   | status code          |
| --------------------------------------- | -------------------- |
| `KVPolicyError`, `InvalidArgument`      | INVALID_ARGUMENT     |
| `NotFound`                              | NOT_FOUND            |
| `AlreadyExists`                         | ALREADY_EXISTS       |
| `FailedPrecondition` (stale generation), `HeadProfileUnavailable` | FAILED_PRECONDITION |
| `Unavailable`, Redis connection errors  | UNAVAILABLE          |
| `ResourceExhausted` (capacity, budgets) | RESOURCE_EXHAUSTED   |
| `Internal` (a computation went wrong)   | INTERNAL             |
| `Unauthenticated` (no identity)         | UNAUTHENTICATED      |
| `PermissionDenied` (role, owner)        | PERMISSION_DENIED    |
| a request message that does not parse   | INVALID_ARGUMENT     |
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
import redis.exceptions
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.echo import echo
from services.kvpolicy.errors import HeadProfileUnavailable, KVPolicyError, ManifestInvalid
from services.rpc.kvrelay.v1 import common_pb2

ERROR_DETAIL_KEY = "kvrelay-error-bin"
# What one error may put in the trailers: the status message (field + message, percent-encoded
# by gRPC, up to 3x) and the detail (base64, 4/3x) stay well under the 8 KB metadata limit.
MAX_MESSAGE_BYTES = 1024
MAX_FIELD_BYTES = 256

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


class Internal(ServiceError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(ServiceError):
    """The caller proved no identity (services.security.access)."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = common_pb2.ERROR_REASON_UNAUTHENTICATED


class PermissionDenied(ServiceError):
    """The caller's identity lacks the role, or does not own the request id."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = common_pb2.ERROR_REASON_PERMISSION_DENIED


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
    if _is_non_finite_logits(exc):  # this request's own computation; nobody else's
        detail = common_pb2.ErrorDetail(field="logits", message=str(exc))
        return RpcStatus(grpc.StatusCode.INTERNAL, detail)
    if isinstance(exc, HeadProfileUnavailable):  # valid request; this worker lacks the profile
        detail = common_pb2.ErrorDetail(field=exc.field, message=exc.reason)
        return RpcStatus(grpc.StatusCode.FAILED_PRECONDITION, detail)
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
            message=f"redis unavailable: {type(exc).__name__}: {echo(str(exc), 200)}",
        )
        return RpcStatus(grpc.StatusCode.UNAVAILABLE, detail)
    return None


def _is_non_finite_logits(exc: BaseException) -> bool:
    """Whether `exc` is the model runtime's NonFiniteLogits. Looked up where it was loaded, not
    imported here: importing services.model loads torch, which the policy service and the
    policy client never need (2 s of start-up and hundreds of MB); no instance can exist
    before its module is loaded."""
    errors = sys.modules.get("services.model.errors")
    return errors is not None and isinstance(exc, errors.NonFiniteLogits)


def error_detail(error: grpc.aio.AioRpcError) -> common_pb2.ErrorDetail | None:
    """The ErrorDetail a kvrelay server attached to a failed call, if any."""
    for key, value in error.trailing_metadata() or ():
        if key == ERROR_DETAIL_KEY and isinstance(value, bytes):
            return common_pb2.ErrorDetail.FromString(value)
    return None


async def abort_with(context: grpc.aio.ServicerContext, status: RpcStatus) -> None:
    """Abort the call with `status`, its detail in the trailing metadata (both bounded)."""
    status = bounded(status)
    metadata = ((ERROR_DETAIL_KEY, status.detail.SerializeToString()),)
    await context.abort(status.code, status.message, trailing_metadata=metadata)


def bounded(status: RpcStatus) -> RpcStatus:
    """`status` with its field and message cut to MAX_FIELD_BYTES / MAX_MESSAGE_BYTES of UTF-8."""
    detail = common_pb2.ErrorDetail()
    detail.CopyFrom(status.detail)
    detail.field = _utf8_prefix(detail.field, MAX_FIELD_BYTES)
    detail.message = _utf8_prefix(detail.message, MAX_MESSAGE_BYTES)
    return RpcStatus(status.code, detail)


def _utf8_prefix(text: str, max_bytes: int) -> str:
    data = text.encode("utf-8", errors="replace")
    if len(data) <= max_bytes:
        return text
    cut = data[: max_bytes - len("…".encode())].decode("utf-8", errors="ignore")
    return f"{cut}…"


def undecodable_request(descriptor: Descriptor | None, data: bytes, error: DecodeError) -> RpcStatus:
    """INVALID_ARGUMENT for request bytes that `descriptor`'s message type could not parse,
    naming the string field that is not UTF-8 when there is one (else field `request`)."""
    field = _non_utf8_field(descriptor, data) if descriptor is not None else None
    if field is not None:
        message = "is not valid UTF-8"
    else:
        field = "request"
        message = f"the request message could not be parsed: {echo(str(error), 300)}"
    detail = common_pb2.ErrorDetail(
        reason=common_pb2.ERROR_REASON_REQUEST_INVALID, field=field, message=message
    )
    return RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, detail)


def _non_utf8_field(descriptor: Descriptor, data: bytes, path: str = "", depth: int = 0) -> str | None:
    """The dotted path of the first string field in the wire bytes `data` that is not UTF-8;
    None when there is none or the bytes are too corrupt to walk."""
    try:
        for number, chunk in _length_delimited(data):
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = _join(path, field.name)
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 32:
                found = _non_utf8_field(field.message_type, chunk, name, depth + 1)
                if found is not None:
                    return found
    except (IndexError, ValueError):
        return None
    return None


def _length_delimited(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(field number, payload) of each length-delimited field; others are skipped."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, position = _varint(data, position)
        elif wire_type in (1, 5):
            position += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, position = _varint(data, position)
            if position + length > len(data):
                raise ValueError("truncated field")
            yield number, data[position : position + length]
            position += length
        else:
            raise ValueError(f"wire type {wire_type}")


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while shift < 64:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    raise ValueError("varint too long")


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


def _wrap_stream(method: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncIterator[Any]]:
    @functools.wraps(method)
    async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            # Closed here, in the call's task: left to the garbage collector, the servicer's
            # generator would unwind in another Context (see services.telemetry.metrics).
            async with contextlib.aclosing(method(self, request, context)) as items:
                async for item in items:
                    yield item
            return
        except Exception as exc:
            status = status_for(exc)
            if status is None:
                raise
        await abort_with(context, status)

    return stream


def reject_unknown_fields(message: Message, path: str = "", *, nested: bool = True) -> None:
    """Raise InvalidArgument if `message` (or, with `nested`, a nested message) carries fields
    this schema does not define, including a known field number sent with the wrong wire type
    (e.g. a string where an integer generation belongs), which protobuf would otherwise drop and
    leave at its default. Without `nested` only the envelope's own fields are checked (a
    policy SessionCall: the request inside checks its own, naming fields from its own root)."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        number = unknown[0].field_number
        known = message.DESCRIPTOR.fields_by_number.get(number)
        name = _join(path, known.name if known else f"#{number}")
        problem = "wrong wire type for this field" if known else "unknown field"
        raise InvalidArgument(f"{problem} (field number {number})", field=name)
    if not nested:
        return
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        values = value if descriptor.is_repeated else [value]
        for index, item in enumerate(values):
            suffix = f"[{index}]" if descriptor.is_repeated else ""
            reject_unknown_fields(item, _join(path, descriptor.name) + suffix)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
