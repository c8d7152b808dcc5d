"""The client side of `PolicyService.Session`: per-request policy calls multiplexed on a few
long-lived streams (why: `policy_service.session`).

`Sessions(stub, streams)` keeps up to `streams` streams open on one channel, opened on first
use and again after one breaks, and spreads calls over them in turn (with round-robin load
balancing each new stream goes to the next replica). A call is one SessionCall carrying its
call id, what is left of its deadline and the caller's trace context; its reply resolves it.

What a caller sees is what the unary call would have raised, as a `SessionFailure` (status code
and ErrorDetail): the call's own error from its reply; DEADLINE_EXCEEDED when its deadline
passes first; UNAVAILABLE for every call in flight on a stream that broke or that the service
ended (it drains before stopping: those calls are sent again, to a replica that is up, by the
policy client's retry loop; every policy call is safe to repeat, `services.policy.client`).
`stream_failed` tells the stream's own status apart from a call's, so that a service without
Session (UNIMPLEMENTED, an older release) sends the client back to unary calls.

A stream that answered nothing since a call was sent, until that call's deadline, is presumed
dead (a peer gone without a reset) and dropped, so the next call opens a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.telemetry.spans import inject_context, rpc_span
from services.telemetry.tracing import tracing_enabled

# SessionCall's oneof fields and the unary method each stands for.
METHODS = {"begin_request": "BeginRequest", "publish_state": "PublishState", "get_fence": "GetFence",
           "end_request": "EndRequest"}
_SERVICE = "/kvrelay.v1.PolicyService/"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_STREAM_REFUSALS = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.UNIMPLEMENTED})
_WRITE_ERRORS = (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError)


class SessionFailure(Exception):
    """A session call that failed with `code`; `stream_failed`: the stream itself did."""

    def __init__(self, code: grpc.StatusCode, detail: common_pb2.ErrorDetail, *, stream_failed: bool = False) -> None:
        super().__init__(f"{code.name}: {detail.message}")
        self.code = code
        self.detail = detail
        self.stream_failed = stream_failed


@dataclass
class _Stream:
    call: Any  # grpc.aio.StreamStreamCall
    pending: dict[int, asyncio.Future[policy_pb2.SessionReply]] = field(default_factory=dict)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_reply: float = 0.0
    reader: asyncio.Task[None] | None = None
    broken: bool = False


class Sessions:
    """Up to `streams` Session streams of `stub` (see the module doc)."""

    def __init__(self, stub: policy_pb2_grpc.PolicyServiceStub, streams: int) -> None:
        if streams < 1:
            raise ValueError(f"streams: {streams} must be >= 1")
        self._stub = stub
        self._streams: list[_Stream | None] = [None] * streams
        self._turn = itertools.count()
        self._call_ids = itertools.count(1)
        self._closed = False

    async def call(self, kind: str, request: Any, timeout_s: float) -> Any:
        """The response of the call `kind` (a SessionCall field) with `request`; SessionFailure."""
        name = _SERVICE + METHODS[kind]
        if not tracing_enabled():
            return await self._call(kind, request, timeout_s, {})
        with rpc_span(name, SpanKind.CLIENT):
            return await self._call(kind, request, timeout_s, inject_context())

    async def _call(self, kind: str, request: Any, timeout_s: float, carrier: dict[str, str]) -> Any:
        if self._closed:
            raise SessionFailure(grpc.StatusCode.CANCELLED, common_pb2.ErrorDetail(message="the policy client is closed"))
        loop = asyncio.get_running_loop()
        stream = self._stream()
        call_id = next(self._call_ids)
        message = policy_pb2.SessionCall(call_id=call_id, timeout_ms=max(1, int(timeout_s * 1000)),
                                         trace_context=carrier)
        getattr(message, kind).CopyFrom(request)
        reply_future: asyncio.Future[policy_pb2.SessionReply] = loop.create_future()
        stream.pending[call_id] = reply_future
        sent_at = loop.time()
        try:
            async with asyncio.timeout(timeout_s):
                # A write to a stream that broke fails: its reader fails what was pending on it.
                async with stream.write_lock:
                    with contextlib.suppress(*_WRITE_ERRORS):
                        await stream.call.write(message)
                reply = await reply_future
        except TimeoutError:
            if stream.last_reply < sent_at:  # nothing came back since: presumed dead
                self._drop(stream)
            raise SessionFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 common_pb2.ErrorDetail(message="the policy call's deadline passed")) from None
        finally:
            stream.pending.pop(call_id, None)
        if reply.HasField("error"):
            code = _CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            raise SessionFailure(code, reply.error.detail)
        return getattr(reply, kind)

    def _stream(self) -> _Stream:
        slot = next(self._turn) % len(self._streams)
        stream = self._streams[slot]
        if stream is None or stream.broken:
            stream = _Stream(self._stub.Session())
            stream.reader = asyncio.get_running_loop().create_task(self._read(stream))
            self._streams[slot] = stream
        return stream

    async def _read(self, stream: _Stream) -> None:
        loop = asyncio.get_running_loop()
        failure = SessionFailure(grpc.StatusCode.UNAVAILABLE,
                                 common_pb2.ErrorDetail(message="the policy service ended the session"),
                                 stream_failed=True)
        try:
            async for reply in stream.call:
                stream.last_reply = loop.time()
                waiting = stream.pending.get(reply.call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(reply)
        except grpc.aio.AioRpcError as exc:
            failure = _stream_failure(exc)
        except asyncio.CancelledError:
            failure = SessionFailure(grpc.StatusCode.UNAVAILABLE,
                                     common_pb2.ErrorDetail(message="the policy session was dropped"),
                                     stream_failed=True)
            raise
        finally:
            stream.broken = True
            for waiting in stream.pending.values():
                if not waiting.done():
                    waiting.set_exception(failure)

    def _drop(self, stream: _Stream) -> None:
        stream.broken = True
        stream.call.cancel()  # the reader ends and fails what else was pending on it

    async def close(self) -> None:
        """Cancel every stream; calls still in flight fail (CANCELLED: the client is closed)."""
        self._closed = True
        streams = [s for s in self._streams if s is not None]
        for stream in streams:
            self._drop(stream)
        readers = [s.reader for s in streams if s.reader is not None]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*readers, return_exceptions=True)


def _stream_failure(exc: grpc.aio.AioRpcError) -> SessionFailure:
    """A stream's own end, as its calls in flight see it. Refusals of the stream itself keep
    their status (credentials, roles, a service without Session); anything else (the peer
    gone: UNAVAILABLE, CANCELLED, or INTERNAL "Internal error from Core" when the connection
    dies under a read) is UNAVAILABLE: none of those calls was answered, all may be sent again."""
    code = exc.code()
    detail = error_detail(exc) or common_pb2.ErrorDetail(message=exc.details() or "")
    if code not in _STREAM_REFUSALS:
        detail.message = f"{code.name}: {detail.message}"
        code = grpc.StatusCode.UNAVAILABLE
    return SessionFailure(code, detail, stream_failed=True)
