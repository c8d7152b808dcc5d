"""The client side of `PolicyService.Session`: per-request policy calls multiplexed on a few
long-lived streams (why: `policy_service.session`).

`Sessions(open_stream, streams)` keeps up to `streams` streams open, opened on first use and
again after one breaks, and spreads calls over them in turn. A stream is a gRPC Session call
on one channel (with round-robin load balancing each new stream goes to the next replica) or
a connection to the framed Session listener (`services.policy.framed`, each to the next
replica in turn; without gRPC's per-message cost). A call is one SessionCall carrying its
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

Streams are replaced, so that they keep spreading over the replicas: a stream sits on the
replica round robin picked when it opened, for as long as it lives. One opened before the
channel was READY went to whichever replica connected first (the first calls of a new client
open every stream within a millisecond), so it is replaced after `SETTLE_S`, when the others
have connected too. Any other lives `max_age_s` (jittered down by up to a fifth, so that a
client's streams do not turn over together): a replica added, or back after a restart, gets
streams within that. A replaced stream takes no new call; it is half-closed after the calls
already written on it, the service answers those and ends it (or it is cancelled after
`RETIRE_GRACE_S`, which fails what it still had as UNAVAILABLE: sent again by the retry loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from services.policy.framed import STATUS_CODES, StreamFailed
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2
from services.telemetry.spans import inject_context, rpc_span
from services.telemetry.tracing import tracing_enabled

# SessionCall's oneof fields and the unary method each stands for.
METHODS = {"begin_request": "BeginRequest", "publish_state": "PublishState", "get_fence": "GetFence",
           "end_request": "EndRequest"}
_SERVICE = "/kvrelay.v1.PolicyService/"
_STREAM_REFUSALS = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                              grpc.StatusCode.UNIMPLEMENTED})
_WRITE_ERRORS = (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError, StreamFailed)
SETTLE_S = 0.5  # life of a stream opened before the channel was READY
RETIRE_GRACE_S = 30.0  # a replaced stream's calls in flight have this long to be answered


class SessionFailure(Exception):
    """A session call that failed with `code`; `stream_failed`: the stream itself did."""

    def __init__(self, code: grpc.StatusCode, detail: common_pb2.ErrorDetail, *, stream_failed: bool = False) -> None:
        super().__init__(f"{code.name}: {detail.message}")
        self.code = code
        self.detail = detail
        self.stream_failed = stream_failed


@dataclass(eq=False)  # hashed by identity: a set holds those being replaced
class _Stream:
    call: Any  # grpc.aio.StreamStreamCall, or services.policy.framed.FramedStream
    pending: dict[int, asyncio.Future[policy_pb2.SessionReply]] = field(default_factory=dict)
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_reply: float = 0.0
    reader: asyncio.Task[None] | None = None
    broken: bool = False
    replace_at: float = float("inf")  # loop time after which no new call is sent on it
    retirement: asyncio.Task[None] | None = None


class Sessions:
    """Up to `streams` streams from `open_stream()`, each replaced after `max_age_s` (or
    `SETTLE_S` if `channel_ready()` was false when it opened; see the module doc)."""

    def __init__(self, open_stream: Callable[[], Any], streams: int, *, max_age_s: float,
                 channel_ready: Callable[[], bool], rng: random.Random | None = None) -> None:
        if streams < 1:
            raise ValueError(f"streams: {streams} must be >= 1")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s: {max_age_s} must be positive")
        self._open_stream = open_stream
        self._streams: list[_Stream | None] = [None] * streams
        self._retiring: set[_Stream] = set()
        self._max_age_s = max_age_s
        self._channel_ready = channel_ready
        self._rng = rng or random.Random()
        self._turn = itertools.count()
        self._call_ids = itertools.count(1)
        self._closed = False
        self.opened = 0  # streams opened so far

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
            code = STATUS_CODES.get(reply.error.code, grpc.StatusCode.UNKNOWN)
            raise SessionFailure(code, reply.error.detail)
        return getattr(reply, kind)

    def _stream(self) -> _Stream:
        loop = asyncio.get_running_loop()
        slot = next(self._turn) % len(self._streams)
        stream = self._streams[slot]
        if stream is not None and not stream.broken and loop.time() >= stream.replace_at:
            self._retire(stream)
            stream = None
        if stream is None or stream.broken:
            life = self._max_age_s * (1 - 0.2 * self._rng.random()) if self._channel_ready() else SETTLE_S
            stream = _Stream(self._open_stream(), replace_at=loop.time() + life)
            self.opened += 1
            stream.reader = loop.create_task(self._read(stream))
            self._streams[slot] = stream
        return stream

    def _retire(self, stream: _Stream) -> None:
        """Half-close `stream` after the calls already queued on it (FIFO write lock)."""
        self._retiring.add(stream)

        async def retire() -> None:
            try:
                async with stream.write_lock:
                    with contextlib.suppress(*_WRITE_ERRORS):
                        await stream.call.done_writing()
                assert stream.reader is not None
                done, _ = await asyncio.wait({stream.reader}, timeout=RETIRE_GRACE_S)
                if not done:
                    self._drop(stream)
            finally:
                self._retiring.discard(stream)

        stream.retirement = asyncio.get_running_loop().create_task(retire())

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
        except (grpc.aio.AioRpcError, StreamFailed) as exc:
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
        streams = [s for s in self._streams if s is not None] + list(self._retiring)
        for stream in streams:
            self._drop(stream)
        tasks = [t for s in streams for t in (s.reader, s.retirement) if t is not None]
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def _stream_failure(exc: grpc.aio.AioRpcError | StreamFailed) -> SessionFailure:
    """A stream's own end, as its calls in flight see it. Refusals of the stream itself keep
    their status (credentials, roles, a service without Session); anything else (the peer
    gone: UNAVAILABLE, CANCELLED, or INTERNAL "Internal error from Core" when the connection
    dies under a read) is UNAVAILABLE: none of those calls was answered, all may be sent again."""
    if isinstance(exc, StreamFailed):
        code, detail = exc.code, exc.detail
    else:
        code = exc.code()
        detail = error_detail(exc) or common_pb2.ErrorDetail(message=exc.details() or "")
    if code not in _STREAM_REFUSALS:
        detail.message = f"{code.name}: {detail.message}"
        code = grpc.StatusCode.UNAVAILABLE
    return SessionFailure(code, detail, stream_failed=True)
