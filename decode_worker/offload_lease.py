"""Keeping a `recallable_remote` request's omitted rows alive at the prefill worker.

The prefill worker holds the rows under a lease (`offload_lease_ms` in the descriptor). While
the request decodes, `LeaseKeeper` renews it every third of the lease; when the request ends
(finished, cancelled or failed) it releases the rows at once, so the prefill worker's store
returns those bytes without waiting for the lease to run out. A renewal that finds the rows
gone stops renewing (a later recall then takes the manifest's fallback); a prefill worker
that does not answer is retried at the next renewal. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc

from services.rpc.kvrelay.v1 import offload_pb2, offload_pb2_grpc
from services.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, client_channel_options
from services.security.roles import Role
from services.security.transport import TransportSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteHandoff:
    """Where a request's omitted rows wait: the prefill worker's OffloadService and handoff."""

    request_id: str
    request_generation: int
    handoff_id: str
    address: str


class OffloadChannels:
    """One gRPC channel per prefill worker's OffloadService address (event-loop confined)."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 security: TransportSecurity | None = None) -> None:
        self._max_message_bytes = max_message_bytes
        self._security = security or TransportSecurity.local_plaintext()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> offload_pb2_grpc.OffloadServiceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._security.aio_channel(address, Role.PREFILL,
                                                 client_channel_options(self._max_message_bytes))
            self._channels[address] = channel
        return offload_pb2_grpc.OffloadServiceStub(channel)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


class LeaseKeeper:
    """Renews one request's offload lease until `release()`; then releases the rows. Made on
    the event loop, whose thread runs every call it makes."""

    def __init__(
        self, handoff: RemoteHandoff, stub: offload_pb2_grpc.OffloadServiceStub, lease_ms: int, timeout_s: float
    ) -> None:
        self.handoff = handoff
        self.stub = stub
        self.renewals = 0
        self._stub = stub
        self._interval_s = lease_ms / 3000.0
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[None] | None = None
        self._releasing: asyncio.Task[int] | None = None
        self._released = False

    def start(self) -> None:
        self._task = self._loop.create_task(self._renew_forever())

    def release_soon(self) -> None:
        """Start `release()` on the keeper's loop; callable from any thread or gRPC callback."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: the lease runs out instead
            self._loop.call_soon_threadsafe(self._start_release)

    def _start_release(self) -> None:
        if self._releasing is None:
            self._releasing = self._loop.create_task(self.release())

    async def release(self) -> int:
        """Stop renewing and drop the rows at the prefill worker (idempotent, bounded by the
        timeout); returns the bytes it freed (0 when unreachable or already gone)."""
        if self._released:
            return 0
        self._released = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        request = offload_pb2.ReleaseRequest(
            request_id=self.handoff.request_id,
            request_generation=self.handoff.request_generation,
            handoff_id=self.handoff.handoff_id,
        )
        try:
            reply = await self._stub.Release(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.info("release of %s at %s: %s (its lease will expire)", self.handoff.handoff_id,
                     self.handoff.address, exc.code().name)
            return 0
        return int(reply.freed_bytes)

    async def _renew_forever(self) -> None:
        request = offload_pb2.RenewLeaseRequest(
            request_id=self.handoff.request_id,
            request_generation=self.handoff.request_generation,
            handoff_id=self.handoff.handoff_id,
        )
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._stub.RenewLease(request, timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                    log.warning("offload rows of %s are gone (%s); recalls will fall back",
                                self.handoff.request_id, exc.code().name)
                    return
                continue
            self.renewals += 1
