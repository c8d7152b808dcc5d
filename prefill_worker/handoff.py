"""The send stage: hand a packed view to the decode worker the gateway chose.

    endpoint  = GetTransferEndpoint(D)                      # cached per decode worker
    lease     = KVSender.reserve(key, endpoint.rendezvous)  # a pair group to D's TCPStore
    transfer  = KVSender.start_send(descriptor, lease)      # rendezvous in the background
    AcceptTransfer(D, descriptor)                           # control over gRPC
    every layer queued → transfer.wait_for_send(deadline)   # rows over torch.distributed
      (+ the sidecar: page summaries, and host-tier rows for recallable_local)

The descriptor is a `ViewHandoff` (services/transfer/descriptor.py), written to the wire by
`services.transfer.codec` alone: the transfer layer's descriptor, what else the receipt binds,
output token 0 with its sampling, the ledger, and what became of the omitted rows
(`recoverability`, the offload handoff id and address, the lease, or why the store refused).
Any failure — decode worker unreachable, descriptor refused, rendezvous or send timeout,
peer lost, the call cancelled — tears the pair group down (the transfer layer does that),
drops the request's offloaded rows, and surfaces as `DecodeWorkerUnavailable` naming the
decode worker; its cached endpoint is forgotten so the next transfer asks again.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from prefill_worker.errors import DecodeWorkerUnavailable
from prefill_worker.offload import OffloadTier, Packed
from prefill_worker.wire import PrefillCall
from services.rpc.kvrelay.v1 import decode_pb2, decode_pb2_grpc
from services.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, client_channel_options
from services.security.roles import Role
from services.security.transport import TransportSecurity
from services.telemetry import metrics
from services.telemetry.spans import inject_context
from services.transfer import (
    Deadline,
    DescriptorInvalid,
    KVSender,
    OffloadRef,
    PairLease,
    SendTransfer,
    SidecarLayout,
    TransferDescriptor,
    TransferError,
    TransferKey,
    TransferTimeout,
    ViewHandoff,
    ViewLayout,
    layer_of,
)
from services.transfer.codec import handoff_to_proto
from services.transfer.descriptor import check_store_address
from services.transfer.pairgroup import backend_for

_MIN_CALL_S = 0.001


@dataclass(frozen=True)
class Endpoint:
    """Where a decode worker's pair groups meet, as it answered GetTransferEndpoint."""

    rendezvous_address: str
    decode_worker: str
    backends: tuple[str, ...]


@dataclass(frozen=True)
class Handoff:
    """A finished send: the descriptor the decode worker accepted (as sent) and the bytes that
    moved."""

    descriptor: decode_pb2.TransferDescriptor
    bytes_moved: int
    reserved_bytes: int
    decode_worker: str


class Refused(Exception):
    """The decode worker answered, but not in a way a transfer can go on from."""


class DecodeHandoff:
    """The prefill side of the handoff: gRPC channels to decode workers, their endpoints, and
    a `KVSender` whose pair groups carry the rows. `offload` is this worker's offload tier:
    its address goes into the descriptors of recallable_remote requests."""

    def __init__(
        self,
        sender: KVSender,
        device: torch.device | str,
        *,
        accept_timeout_s: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        security: TransportSecurity | None = None,
        offload: OffloadTier | None = None,
    ) -> None:
        self._security = security or TransportSecurity.local_plaintext()
        self.sender = sender
        self.offload = offload or OffloadTier(None)
        self._device = torch.device(device)
        self._backend = backend_for(self._device)
        self._accept_timeout_s = accept_timeout_s
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._endpoints: dict[str, Endpoint] = {}

    async def send(self, call: PrefillCall, first_token: int, packed: Packed, deadline: Deadline) -> Handoff:
        """Move `packed.view` to `call.decode`; returns once every layer is out."""
        target = call.decode
        try:
            return await self._send(call, first_token, packed, deadline)
        except (TransferError, DescriptorInvalid, grpc.aio.AioRpcError, Refused) as exc:
            self._forget(target.address, packed)
            raise DecodeWorkerUnavailable(
                f"decode worker {target.worker_id} at {target.address}: {_describe(exc)}",
                field="decode_worker_address",
            ) from exc
        except BaseException:
            self._forget(target.address, packed)
            raise

    async def close(self) -> None:
        """Close the pair groups and the channels."""
        await asyncio.to_thread(self.sender.close)
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def _send(self, call: PrefillCall, first_token: int, packed: Packed, deadline: Deadline) -> Handoff:
        endpoint = await self._endpoint(call, deadline)
        if packed.offload.handoff_id:
            self.offload.bind_decode(packed.offload.handoff_id, endpoint.rendezvous_address)
        key = TransferKey(call.request_id, call.request_generation, packed.state.state_generation, uuid.uuid4().hex)
        lease = await self._reserve(key, endpoint, deadline)
        try:
            handoff = self._handoff(call, first_token, packed, self._descriptor(key, packed, lease), deadline)
        except DescriptorInvalid as exc:
            self.sender.cancel(lease, f"no descriptor: {exc}")
            raise
        transfer = self.sender.start_send(handoff.descriptor, lease, deadline)
        try:
            with metrics.timed(metrics.TRANSFER_SECONDS.labels("send")):
                message = handoff_to_proto(handoff)
                reply = await self._accept(call, message, deadline)
                moved = await asyncio.to_thread(send_layers, transfer, packed, deadline)
        except BaseException as exc:
            transfer.cancel(f"handoff failed: {_describe(exc)}")
            raise
        metrics.TRANSFER_BYTES.labels("send").inc(moved)
        if moved != packed.ledger.traffic_bytes:
            raise Refused(f"moved {moved} bytes, the ledger says {packed.ledger.traffic_bytes}")
        return Handoff(message, moved, reply.reserved_bytes, reply.decode_worker or call.decode.worker_id)

    def _forget(self, address: str, packed: Packed) -> None:
        """After a failed handoff: ask the decode worker's endpoint again next time, and drop
        the offloaded rows nobody will recall."""
        self._endpoints.pop(address, None)
        if packed.offload.handoff_id:
            self.offload.release(packed.offload.handoff_id, "failed")

    async def _endpoint(self, call: PrefillCall, deadline: Deadline) -> Endpoint:
        address = call.decode.address
        cached = self._endpoints.get(address)
        if cached is not None:
            return cached
        request = decode_pb2.GetTransferEndpointRequest(source_worker=self.sender.worker_id)
        reply = await self._stub(address).GetTransferEndpoint(request, timeout=self._call_timeout(deadline))
        endpoint = Endpoint(reply.rendezvous_address, reply.decode_worker, tuple(reply.backends))
        check_store_address(endpoint.rendezvous_address)  # host:port, or DescriptorInvalid
        if endpoint.backends and self._backend not in endpoint.backends:
            raise Refused(f"it receives on {list(endpoint.backends)}, this worker sends with {self._backend}")
        self._endpoints[address] = endpoint
        return endpoint

    async def _reserve(self, key: TransferKey, endpoint: Endpoint, deadline: Deadline) -> PairLease:
        # Reserving may wait on the decode worker's store, so it runs on a thread; if the
        # call is cancelled meanwhile, the lease it still returns is given back. A stopped
        # (not dead) decode worker never answers its store and the store client ignores its
        # own timeout then, so the wait is bounded here like any other control call.
        reserving = asyncio.ensure_future(
            asyncio.to_thread(self.sender.reserve, key, endpoint.rendezvous_address, self._device, deadline)
        )
        timeout_s = self._call_timeout(deadline)
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                return await asyncio.shield(reserving)
        except TimeoutError:
            reserving.add_done_callback(self._give_back)
            store = endpoint.rendezvous_address
            silent = f"rendezvous store {store} did not answer within {timeout_s:.3g} s"
            raise TransferTimeout(key, silent) from None
        except asyncio.CancelledError:
            reserving.add_done_callback(self._give_back)
            raise

    def _give_back(self, reserving: asyncio.Future[PairLease]) -> None:
        if not reserving.cancelled() and reserving.exception() is None:
            self.sender.cancel(reserving.result(), "the prefill call was cancelled")

    def _descriptor(self, key: TransferKey, packed: Packed, lease: PairLease) -> TransferDescriptor:
        sidecar = packed.offload.sidecar
        return TransferDescriptor(
            transfer_id=key.transfer_id,
            request_id=key.request_id,
            request_generation=key.request_generation,
            state_generation=key.state_generation,
            cache_generation=packed.state.cache_generation,
            receipt_digest=packed.receipt.digest,
            source_worker=self.sender.worker_id,
            route=lease.route,
            layout=ViewLayout.of(packed.view),
            trace_context=tuple(inject_context().items()),
            sidecar=SidecarLayout.of(sidecar, packed.view.packed_v.dtype) if sidecar is not None else None,
        )

    def _handoff(
        self,
        call: PrefillCall,
        first_token: int,
        packed: Packed,
        descriptor: TransferDescriptor,
        deadline: Deadline,
    ) -> ViewHandoff:
        """The view offered to the decode worker, bound to `packed.receipt`."""
        receipt, offload = packed.receipt, packed.offload
        owner_budgets, payload = receipt.view_bindings()
        return ViewHandoff(
            descriptor=descriptor,
            manifest_sha256=receipt.manifest_sha256,
            parent_state_generation=receipt.parent_state_generation,
            frontier=receipt.frontier,
            position_origin=receipt.position_origin,
            first_token_id=first_token,
            sampling=call.sampling,
            max_tokens=call.max_tokens,
            prompt_tokens=call.prompt_tokens,
            ledger=packed.ledger,
            owner_budgets=owner_budgets,
            payload=payload,
            deadline_unix_ms=int((time.time() + deadline.remaining()) * 1000),
            offload=OffloadRef(
                mode=offload.mode,
                handoff_id=offload.handoff_id,
                address=self.offload.address if offload.handoff_id else "",
                lease_ms=offload.lease_ms if offload.handoff_id else 0,
                degraded=offload.degraded,
            ),
        )

    async def _accept(
        self, call: PrefillCall, message: decode_pb2.TransferDescriptor, deadline: Deadline
    ) -> decode_pb2.AcceptTransferResponse:
        request = decode_pb2.AcceptTransferRequest(descriptor=message)
        reply = await self._stub(call.decode.address).AcceptTransfer(request, timeout=self._call_timeout(deadline))
        if not reply.accepted:
            raise Refused(f"AcceptTransfer answered accepted=false for transfer {message.transfer_id}")
        if reply.transfer_id and reply.transfer_id != message.transfer_id:
            raise Refused(f"AcceptTransfer answered for transfer {reply.transfer_id}, not {message.transfer_id}")
        return reply

    def _stub(self, address: str) -> decode_pb2_grpc.DecodeWorkerStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._security.aio_channel(address, Role.DECODE,
                                                 client_channel_options(self._max_message_bytes))
            self._channels[address] = channel
        return decode_pb2_grpc.DecodeWorkerStub(channel)

    def _call_timeout(self, deadline: Deadline) -> float:
        return max(_MIN_CALL_S, min(self._accept_timeout_s, deadline.remaining()))


def send_layers(transfer: SendTransfer, packed: Packed, deadline: Deadline) -> int:
    """Queue every layer (each goes out as soon as the pair group is connected) and the
    sidecar, then wait until all are out; returns the bytes moved."""
    view = packed.view
    for layer in range(view.num_layers):
        transfer.send_layer(layer_of(view, layer))
    if packed.offload.sidecar is not None:
        transfer.send_sidecar(packed.offload.sidecar)
    return transfer.wait_for_send(deadline)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return str(exc) or type(exc).__name__
