"""The client side of the policy service's framed Session listener (`services.policy.framing`):
a stream with the interface of a grpc.aio Session call, for `services.policy.session.Sessions`.

`FramedConnector(target, security)` opens each new stream to the next replica `target` names
(comma-separated host:port; a DNS name with several addresses counts each), so that streams
spread over the replicas and one that broke is opened again on another. A connection has
`connect_timeout_s` for TCP, TLS and the welcome; a refusal in the welcome keeps its status
(UNAUTHENTICATED, PERMISSION_DENIED), anything else that ends a connection fails its calls in
flight as UNAVAILABLE (none was answered: the policy client's retry loop sends them again).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc

from services.policy.framing import END_OF_CALLS, STREAM_LIMIT, FrameError, frame, parse, read_frame
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2
from services.security.roles import Role
from services.security.transport import TransportSecurity, server_name, target_host

STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # a SessionError's code
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class StreamFailed(Exception):
    """A framed stream that ended or could not open: `code` and `detail`, as its calls see it."""

    def __init__(self, code: grpc.StatusCode, message: str, detail: common_pb2.ErrorDetail | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.detail = detail or common_pb2.ErrorDetail(message=message)


def split_target(target: str) -> list[tuple[str, int]]:
    """(host, port) of each comma-separated address ([v6]:port for IPv6); ValueError naming
    `target` for one without a port."""
    addresses = []
    for address in target.split(","):
        address = address.strip()
        host, port = target_host(address), address.rpartition(":")[2]
        if not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"session_target: {address[:200]!r} is not host:port")
        addresses.append((host, int(port)))
    return addresses


class FramedConnector:
    """Opens framed streams to the replicas of `target`, in turn."""

    def __init__(self, target: str, security: TransportSecurity, *, max_frame_bytes: int,
                 connect_timeout_s: float) -> None:
        self.addresses = split_target(target)
        if security.plaintext:
            for host, _ in self.addresses:
                security.check_plaintext(host, "policy sessions to", "address")
        self.security = security
        self.max_frame_bytes = max_frame_bytes
        self.connect_timeout_s = connect_timeout_s
        self._ssl = security.ssl_context(server=False)
        authorization = f"Bearer {security.bearer_token}" if security.bearer_token else ""
        self._hello = frame(policy_pb2.SessionHello(authorization=authorization))
        self._turn = itertools.count()

    def __call__(self) -> FramedStream:
        """A new stream (it connects in the background; its first write or read awaits that)."""
        return FramedStream(self._connect(), self.max_frame_bytes)

    async def _connect(self) -> Connection:
        turn = next(self._turn)
        host, port = self.addresses[turn % len(self.addresses)]
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                family, _, _, _, sockaddr = infos[(turn // len(self.addresses)) % len(infos)]
                reader, writer = await asyncio.open_connection(
                    str(sockaddr[0]), int(sockaddr[1]), family=family, ssl=self._ssl, limit=STREAM_LIMIT,
                    server_hostname=server_name(Role.POLICY) if self._ssl else None)
                try:
                    writer.write(self._hello)
                    data = await read_frame(reader, self.max_frame_bytes)
                    if data is None:
                        raise StreamFailed(grpc.StatusCode.UNAVAILABLE, f"{host}:{port} closed the session unwelcomed")
                    welcome = parse(policy_pb2.SessionWelcome, data)
                except BaseException:
                    writer.close()
                    raise
        except TimeoutError:
            raise StreamFailed(grpc.StatusCode.UNAVAILABLE,
                               f"no policy session at {host}:{port} within {self.connect_timeout_s} s") from None
        except (OSError, FrameError) as exc:  # ssl.SSLError is an OSError
            raise StreamFailed(grpc.StatusCode.UNAVAILABLE, f"policy session at {host}:{port}: {exc}") from None
        if welcome.HasField("error"):
            writer.close()
            code = STATUS_CODES.get(welcome.error.code, grpc.StatusCode.UNKNOWN)
            raise StreamFailed(code, welcome.error.detail.message, welcome.error.detail)
        return reader, writer


class FramedStream:
    """One framed connection with a grpc.aio stream call's shape: `write`, `done_writing`,
    `cancel`, and async iteration over the replies (StreamFailed when it breaks)."""

    def __init__(self, connect: Coroutine[Any, Any, Connection], max_frame_bytes: int) -> None:
        self._opening = asyncio.ensure_future(connect)
        self._opening.add_done_callback(_retrieve)
        self._max_frame_bytes = max_frame_bytes
        self._cancelled = False

    async def _connection(self) -> Connection:
        if self._opening.done() and not self._opening.cancelled() and self._opening.exception() is None:
            return self._opening.result()  # every call after the first: no shield future
        try:
            return await asyncio.shield(self._opening)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._cancelled and (current is None or not current.cancelling()):
                raise StreamFailed(grpc.StatusCode.UNAVAILABLE, "the policy session was dropped") from None
            raise

    async def write(self, message: policy_pb2.SessionCall) -> None:
        _, writer = await self._connection()
        try:
            writer.write(frame(message))
            await writer.drain()
        except OSError as exc:
            raise StreamFailed(grpc.StatusCode.UNAVAILABLE, f"the policy session broke: {exc}") from None

    async def done_writing(self) -> None:
        _, writer = await self._connection()
        with contextlib.suppress(OSError):
            writer.write(END_OF_CALLS)
            await writer.drain()

    def cancel(self) -> None:
        self._cancelled = True
        if not self._opening.done():
            self._opening.cancel()
        elif not self._opening.cancelled() and self._opening.exception() is None:
            self._opening.result()[1].transport.abort()

    async def __aiter__(self) -> AsyncIterator[policy_pb2.SessionReply]:
        reader, writer = await self._connection()
        try:
            while True:
                try:
                    data = await read_frame(reader, self._max_frame_bytes)
                except (OSError, FrameError) as exc:
                    raise StreamFailed(grpc.StatusCode.UNAVAILABLE, f"the policy session broke: {exc}") from None
                if data is None:  # the service ended it: answered everything it read
                    return
                try:
                    reply = parse(policy_pb2.SessionReply, data)
                except FrameError as exc:
                    raise StreamFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                yield reply
        finally:
            writer.close()


def _retrieve(task: asyncio.Task[Connection]) -> None:
    """A connection that failed with nobody left to await it is not an unretrieved error."""
    if not task.cancelled():
        task.exception()
