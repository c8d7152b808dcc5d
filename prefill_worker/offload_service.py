"""The prefill worker's `kvrelay.v1.OffloadService`: Recall, RenewLease and Release over its
offload tier, plus the sweep that drops rows nobody can recall any more.

    Recall:  parse → the policy service's fence holds exactly this request generation and
             parent state → the handoff names rows of this request and generation → fetch the
             pages from the store (renews the lease) → answer; the rows follow over the pair
             group to the caller's rendezvous store (or come inline when asked)

Rows go over the same pair groups as the main transfer (`KVSender` of this worker, which
reuses the idle group it holds to that decode worker): the answer carries the descriptor,
the sends are queued before it returns and finish in the background by the caller's deadline
(capped by `recall_send_timeout_s`). Typed errors become status codes once, at the edge:

| error              | status              | when                                                   |
| ------------------ | ------------------- | ------------------------------------------------------ |
| `RecallInvalid`    | INVALID_ARGUMENT    | a malformed field; a page outside the stored pages     |
| `HandoffNotFound`  | NOT_FOUND           | unknown handoff id; rows released, expired or evicted; the request ended |
| `StaleRecall`      | FAILED_PRECONDITION | the request generation or parent state is not the fence's (the fence rides along) |
| `RecallSendFailed` | UNAVAILABLE         | no pair group to the caller could be reserved          |
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace

import grpc
import torch

from prefill_worker.offload import Held, OffloadTier, UnknownHandoff
from services.kvpolicy.packing import PackedKVView
from services.offload.pages import RecalledPage
from services.policy import Fence, NotFound, PolicyClient, PolicyError
from services.rpc import errors as rpc_errors
from services.rpc.errors import maps_errors, reject_unknown_fields
from services.rpc.kvrelay.v1 import common_pb2, offload_pb2, offload_pb2_grpc
from services.telemetry import metrics
from services.telemetry.spans import extract_context, span
from services.transfer import (
    Deadline,
    DescriptorInvalid,
    KVSender,
    SendTransfer,
    TransferDescriptor,
    TransferError,
    TransferKey,
    ViewLayout,
    layer_of,
)
from services.transfer.recall import (
    PageRows,
    RecallAnswer,
    RecallCall,
    answer_to_proto,
    call_from_proto,
    recall_digest,
    recall_view,
    travel_order,
)

log = logging.getLogger(__name__)

SERVICE_NAME = offload_pb2.DESCRIPTOR.services_by_name["OffloadService"].full_name


class RecallInvalid(rpc_errors.InvalidArgument):
    """A Recall, RenewLease or Release field is malformed; `field` names it."""


class HandoffNotFound(rpc_errors.NotFound):
    """The rows are not here: unknown handoff id, released, expired, evicted, or the request ended."""


class StaleRecall(rpc_errors.FailedPrecondition):
    """The call's request generation or parent state is not what the policy service's fence
    holds (or not the handoff's); `current` is the fence, when known."""

    def __init__(self, message: str, *, field: str = "", current: Fence | None = None) -> None:
        super().__init__(message, field=field)
        self.current = current

    def detail(self) -> common_pb2.ErrorDetail:
        from services.policy.wire import fence_to_proto  # as in services.policy.errors

        detail = super().detail()
        if self.current is not None:
            detail.current.CopyFrom(fence_to_proto(self.current))
        return detail


class RecallSendFailed(rpc_errors.Unavailable):
    """No pair group to the caller's rendezvous store could be reserved for the rows."""

    reason = common_pb2.ERROR_REASON_TRANSFER_FAILED


class OffloadServicer(offload_pb2_grpc.OffloadServiceServicer):
    """Thin adapter from gRPC to the offload tier, the policy fence and the pair groups."""

    def __init__(
        self,
        tier: OffloadTier,
        policy: PolicyClient,
        sender: KVSender,
        device: torch.device,
        *,
        policy_timeout_s: float,
        send_timeout_s: float,
    ) -> None:
        self.tier = tier
        self._policy = policy
        self._sender = sender
        self._device = device
        self._policy_timeout_s = policy_timeout_s
        self._send_timeout_s = send_timeout_s
        self._sending: set[asyncio.Task[None]] = set()

    @maps_errors
    async def Recall(  # noqa: N802 - the proto's method name
        self, request: offload_pb2.RecallRequest, context: grpc.aio.ServicerContext
    ) -> offload_pb2.RecallResponse:
        reject_unknown_fields(request)
        call = _parse(request)
        deadline = self._deadline(context)
        with span("offload.recall", extract_context(dict(call.trace_context)), request_id=call.request_id,
                  request_generation=call.request_generation, parent_state_generation=call.parent_state_generation,
                  pages=len(call.pages), inline=call.inline) as current:
            try:
                answer = await self._recall(call, deadline)
            except rpc_errors.ServiceError as exc:
                metrics.OFFLOAD_RECALLS_SERVED.labels(type(exc).__name__).inc()
                raise
            current.set_attributes({"rows": answer.rows, "bytes": answer.nbytes})
        metrics.OFFLOAD_RECALLS_SERVED.labels("ok").inc()
        return answer_to_proto(answer)

    @maps_errors
    async def RenewLease(  # noqa: N802
        self, request: offload_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> offload_pb2.RenewLeaseResponse:
        reject_unknown_fields(request)
        key = self._held(request.handoff_id, request.request_id, request.request_generation).key
        assert self.tier.store is not None  # a handoff exists only with a store
        entries = self.tier.store.renew(key.request_id, key.request_generation)
        if entries == 0:
            self.tier.expire()
            raise HandoffNotFound("the rows are no longer held (lease expired or evicted)", field="handoff_id")
        return offload_pb2.RenewLeaseResponse(entries=entries, lease_ms=self.tier.lease_ms)

    @maps_errors
    async def Release(  # noqa: N802
        self, request: offload_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> offload_pb2.ReleaseResponse:
        """Idempotent: releasing rows that are already gone frees nothing and is no error."""
        reject_unknown_fields(request)
        try:
            self._held(request.handoff_id, request.request_id, request.request_generation)
        except HandoffNotFound:
            return offload_pb2.ReleaseResponse(freed_bytes=0)
        return offload_pb2.ReleaseResponse(freed_bytes=self.tier.release(request.handoff_id, "end"))

    async def close(self) -> None:
        """Wait for the recall sends still running (each is bounded by its deadline)."""
        await asyncio.gather(*self._sending, return_exceptions=True)

    # --- recall ------------------------------------------------------------------------

    async def _recall(self, call: RecallCall, deadline: Deadline) -> RecallAnswer:
        await self._check_fence(call)
        held = self._held(call.handoff_id, call.request_id, call.request_generation)
        assert self.tier.store is not None
        fetched = self.tier.store.fetch(held.key, call.pages)  # PageRefInvalid -> INVALID_ARGUMENT
        if fetched.missing:
            self.tier.expire()
            raise HandoffNotFound("the rows are no longer held (lease expired or evicted)", field="handoff_id")
        if held.decode_rendezvous and not call.inline and call.rendezvous_address != held.decode_rendezvous:
            raise RecallInvalid(
                f"rows go only to {held.decode_rendezvous}, the decode worker that received the view",
                field="rendezvous_address",
            )
        pages = travel_order(fetched.pages)
        answer = RecallAnswer(
            request_generation=call.request_generation,
            parent_state_generation=call.parent_state_generation,
            pages=tuple(PageRows(p.ref, int(p.positions.shape[0])) for p in pages),
            missing=(),
            nbytes=fetched.nbytes,
        )
        if call.inline:
            return replace(answer, inline=pages)
        return replace(answer, transfer=await self._start_send(call, held, pages, deadline))

    def _held(self, handoff_id: str, request_id: str, request_generation: int) -> Held:
        if not handoff_id:
            raise RecallInvalid("must not be empty", field="handoff_id")
        try:
            held = self.tier.held(handoff_id)
        except UnknownHandoff:
            raise HandoffNotFound(f"no offloaded rows under handoff {handoff_id!r}", field="handoff_id") from None
        key = held.key
        if key.request_id != request_id:
            raise RecallInvalid(f"the handoff belongs to another request than {request_id!r}", field="request_id")
        if key.request_generation != request_generation:
            raise StaleRecall(
                f"the handoff holds request generation {key.request_generation}, not {request_generation}",
                field="request_generation",
            )
        return held

    async def _check_fence(self, call: RecallCall) -> None:
        """The fence must hold this request generation and the recall's parent state; rows of
        an ended or superseded request generation are dropped here and then."""
        try:
            fence = await self._policy.get_fence(call.request_id, timeout_s=self._policy_timeout_s)
        except NotFound:
            self.tier.release_request(call.request_id, "ended")
            raise HandoffNotFound("the policy service no longer knows the request", field="request_id") from None
        except PolicyError as exc:
            raise rpc_errors.Unavailable(f"policy service: {exc}", field="fence") from exc
        if fence.ended:
            self.tier.release_request(call.request_id, "ended")
            raise HandoffNotFound("the request has ended; its rows are released", field="request_id")
        if fence.request_generation != call.request_generation:
            if fence.request_generation > call.request_generation:
                self.tier.fence(call.request_id, fence.request_generation)
            metrics.STALE_REJECTIONS.labels("prefill").inc()
            raise StaleRecall(f"the fence holds request generation {fence.request_generation}",
                              field="request_generation", current=fence)
        if fence.state_generation != call.parent_state_generation:
            metrics.STALE_REJECTIONS.labels("prefill").inc()
            raise StaleRecall(f"the fence holds state generation {fence.state_generation}",
                              field="parent_state_generation", current=fence)

    async def _start_send(
        self, call: RecallCall, held: Held, pages: Sequence[RecalledPage], deadline: Deadline
    ) -> TransferDescriptor:
        """Reserve a pair group to the caller, queue the rows, and finish in the background."""
        view = _on_device(recall_view(pages, held.num_layers, held.num_owners), self._device)
        key = TransferKey(call.request_id, call.request_generation, call.parent_state_generation + 1,
                          uuid.uuid4().hex)
        try:
            lease = await asyncio.to_thread(self._sender.reserve, key, call.rendezvous_address, self._device, deadline)
        except TransferError as exc:
            raise RecallSendFailed(exc.reason, field="rendezvous_address") from exc
        descriptor = TransferDescriptor(
            transfer_id=key.transfer_id,
            request_id=call.request_id,
            request_generation=call.request_generation,
            state_generation=key.state_generation,
            cache_generation=0,
            receipt_digest=recall_digest(call.request_id, call.request_generation, call.parent_state_generation,
                                         pages),
            source_worker=self._sender.worker_id,
            route=lease.route,
            layout=ViewLayout.of(view),
            trace_context=call.trace_context,
        )
        transfer = self._sender.start_send(descriptor, lease, deadline)
        for layer in range(view.num_layers):
            transfer.send_layer(layer_of(view, layer))
        task = asyncio.get_running_loop().create_task(self._finish_send(transfer, deadline))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return descriptor

    async def _finish_send(self, transfer: SendTransfer, deadline: Deadline) -> None:
        try:
            moved = await asyncio.to_thread(transfer.wait_for_send, deadline)
        except TransferError as exc:
            metrics.OFFLOAD_RECALLS_SERVED.labels("undelivered").inc()
            log.warning("recall rows %s not delivered: %s", transfer.descriptor.key, exc.reason)
            return
        metrics.TRANSFER_BYTES.labels("send").inc(moved)

    def _deadline(self, context: grpc.aio.ServicerContext) -> Deadline:
        remaining = context.time_remaining()
        budget = self._send_timeout_s if remaining is None else min(self._send_timeout_s, max(0.0, remaining))
        return Deadline.after(budget)


async def sweep(tier: OffloadTier, policy: PolicyClient, timeout_s: float) -> None:
    """One sweep: drop expired leases, then the rows of every held request that the policy
    service has ended, forgotten or moved to a newer request generation."""
    tier.expire()
    for request_id, generation in tier.held_requests().items():
        try:
            fence = await policy.get_fence(request_id, timeout_s=timeout_s)
        except NotFound:
            tier.release_request(request_id, "ended")
            continue
        except PolicyError as exc:  # the next sweep asks again
            log.info("offload sweep: fence of %s unavailable: %s", request_id, exc)
            continue
        if fence.ended:
            tier.release_request(request_id, "ended")
        elif fence.request_generation > generation:
            tier.fence(request_id, fence.request_generation)


async def sweep_forever(tier: OffloadTier, policy: PolicyClient, interval_s: float, timeout_s: float) -> None:
    """`sweep` every `interval_s` until cancelled; one failed sweep never stops the next."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sweep(tier, policy, timeout_s)
        except Exception:  # noqa: BLE001 - the sweeper must outlive any one sweep
            log.exception("offload sweep failed")


def _parse(request: offload_pb2.RecallRequest) -> RecallCall:
    try:
        return call_from_proto(request)
    except DescriptorInvalid as exc:
        raise RecallInvalid(exc.reason, field=exc.field) from None


def _on_device(view: PackedKVView, device: torch.device) -> PackedKVView:
    """The recall view with its rows on the pair group's device (metadata stays on the host)."""
    if view.packed_k.device == device:
        return view
    return replace(view, packed_k=view.packed_k.to(device), packed_v=view.packed_v.to(device))
