"""The policy service's framed Session listener: `PolicyService.Session` without gRPC
(the frames and why: `services.policy.framing`).

A connection is admitted once, from its hello: the identity its TLS handshake verified (a
client certificate of this deployment's CA) or the bearer token the hello carries, held to the
Session stream's access rule; refused with UNAUTHENTICATED or PERMISSION_DENIED in the welcome,
then closed. After that it is served exactly as a gRPC Session stream
(`policy_service.session.Sessions.serve`): each call held to its own method's rule, with its
own deadline, status, metrics and trace. A frame that is not one (too long, cut off, not a
SessionCall) ends the connection after the calls already read are answered; it never harms
another connection. `stop` closes the listener, lets the connections answer what they read
(the service drains its Sessions first) and closes what is left after the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from policy_service.session import Sessions, session_error
from services.policy.framing import (
    HELLO_TIMEOUT_S,
    STREAM_LIMIT,
    FrameError,
    frame,
    parse,
    read_frame,
)
from services.rpc.errors import ServiceError, status_for
from services.rpc.kvrelay.v1 import policy_pb2
from services.security.access import act_as, authorize, identify_connection
from services.security.transport import TransportSecurity

log = logging.getLogger(__name__)
SESSION_METHOD = "/kvrelay.v1.PolicyService/Session"


class FramedListener:
    """Serves `sessions` on framed connections with `security` (TLS or plaintext, tokens)."""

    def __init__(self, sessions: Sessions, security: TransportSecurity, max_frame_bytes: int) -> None:
        self.sessions = sessions
        self.security = security
        self.max_frame_bytes = max_frame_bytes
        self.port = 0
        self.connections = 0  # accepted so far
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on `host`:`port` (0: a free port); the port bound."""
        if self.security.plaintext:
            self.security.check_plaintext(host, "policy sessions on", "interface")
        context = self.security.ssl_context(server=True)
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=context, limit=STREAM_LIMIT,
            ssl_handshake_timeout=HELLO_TIMEOUT_S if context is not None else None)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; connections still open after `grace_s` are closed."""
        if self._server is not None:
            self._server.close()
        if self._open:
            _, late = await asyncio.wait(set(self._open), timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._open.add(task)
        self.connections += 1
        peer = writer.get_extra_info("peername")
        try:
            if await self._admit(reader, writer):
                async with contextlib.aclosing(self.sessions.serve(self._calls(reader, peer), "framed")) as replies:
                    async for reply in replies:
                        writer.write(frame(reply))
                        await writer.drain()
        except (FrameError, TimeoutError, ConnectionError, OSError) as exc:
            log.info("policy session connection from %s closed: %s", peer, exc or type(exc).__name__)
        finally:
            self._open.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Read the hello, answer the welcome; whether the connection was admitted. The
        caller's identity is this task's `caller()` from here on."""
        async with asyncio.timeout(HELLO_TIMEOUT_S):
            data = await read_frame(reader, self.max_frame_bytes)
        if data is None:
            return False
        hello = parse(policy_pb2.SessionHello, data)
        ssl_object = writer.get_extra_info("ssl_object")
        peer_cert = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        identity = identify_connection(peer_cert, hello.authorization, self.security.tokens)
        try:
            if self.security.authenticates:  # the loopback development stack admits everyone
                authorize(SESSION_METHOD, identity, self.security.tokens)
        except ServiceError as exc:
            status = status_for(exc)
            assert status is not None
            writer.write(frame(policy_pb2.SessionWelcome(error=session_error(status))))
            await writer.drain()
            return False
        act_as(identity)
        writer.write(frame(policy_pb2.SessionWelcome()))
        await writer.drain()
        return True

    async def _calls(self, reader: asyncio.StreamReader, peer: object) -> AsyncIterator[policy_pb2.SessionCall]:
        """The connection's calls until it ends them (a zero-length frame, or EOF); a frame
        that is not a call ends them too (the calls read before are answered)."""
        try:
            while (data := await read_frame(reader, self.max_frame_bytes)):
                yield parse(policy_pb2.SessionCall, data)
        except FrameError as exc:
            log.warning("policy session from %s sent a bad frame, closing it: %s", peer, exc)
        except (ConnectionError, OSError):
            return

