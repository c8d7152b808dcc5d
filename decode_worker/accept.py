"""Accept: a parsed handoff becomes an `Accepted` transfer, or nothing is held.

    deadline      the descriptor's, capped by `transfer_timeout_s` (one already past is refused)
    reservation   the KV bytes the request can occupy here (`reservation_bytes`; over the
                  budget → CapacityExhausted, RESOURCE_EXHAUSTED)
    receive       the descriptor's pair group joined and every receive posted (a worker
                  thread); a failure releases the reservation and maps to a typed error
    lease         for recallable_remote, the (not yet started) keeper of the offloaded rows

The prefill worker sends as soon as AcceptTransfer answers, so the receives are posted first.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass

import torch
from opentelemetry.context import Context

from decode_worker.errors import CapacityExhausted, TransferFailed, TransferInvalid
from decode_worker.offload_lease import LeaseKeeper, OffloadChannels, RemoteHandoff
from decode_worker.scheduler import KVBudget, Reservation, reservation_bytes
from services.kvpolicy.manifest import RecoverabilityMode
from services.rpc.errors import ServiceError
from services.rpc.kvrelay.v1 import decode_pb2
from services.telemetry.spans import extract_context
from services.transfer import (
    Deadline,
    KVReceiver,
    PairGroupsExhausted,
    RecvTransfer,
    TransferError,
    TransferMismatch,
    ViewHandoff,
)
from services.transfer.pairgroup import RECEIVER_RANK, SENDER_RANK


@dataclass(frozen=True)
class Accepted:
    """What AcceptTransfer established for one handoff: the deadline every later wait keeps,
    the reserved KV bytes, the posted pair-group receive, the offload lease keeper
    (recallable_remote only), and the trace context (the prefill worker's transfer.send)
    that every span of the request on this worker joins."""

    handoff: ViewHandoff
    deadline: Deadline
    reservation: Reservation
    recv: RecvTransfer
    lease: LeaseKeeper | None
    trace_parent: Context

    @property
    def transfer_id(self) -> str:
        return self.handoff.descriptor.transfer_id

    @property
    def request_id(self) -> str:
        return self.handoff.descriptor.request_id

    @property
    def request_generation(self) -> int:
        return self.handoff.descriptor.request_generation

    def release(self, reason: str) -> None:
        """Give back what the transfer holds before the decode loop takes it over: the
        reservation, and the receive (its pair group is torn down if still in flight)."""
        self.reservation.release()
        self.recv.cancel(reason)

    def span_attributes(self) -> dict[str, object]:
        """The attributes of every span of this transfer."""
        descriptor = self.handoff.descriptor
        return {
            "request_id": descriptor.request_id,
            "request_generation": descriptor.request_generation,
            "state_generation": descriptor.state_generation,
            "cache_generation": descriptor.cache_generation,
            "manifest_sha256": self.handoff.manifest_sha256,
            "transfer_id": descriptor.transfer_id,
            "source_worker": descriptor.source_worker,
        }


def handoff_reservation_bytes(handoff: ViewHandoff, cache_dtype: torch.dtype) -> int:
    """What accepting `handoff` reserves: the view's rows, what its decode may append, what
    recall may bring back, and the host memory recall holds: host-tier rows and the codes
    ranking's table (the ledger's `code_table_bytes`, checked against the summaries that
    arrive, `verify.check_offload`)."""
    sidecar = handoff.descriptor.sidecar
    recallable = handoff.offload.recallable
    host = sidecar.host_tier_bytes if sidecar is not None else 0
    return reservation_bytes(
        handoff.descriptor.layout, handoff.max_tokens, cache_dtype,
        recallable_rows=handoff.ledger.omitted_rows if recallable else 0,
        host_bytes=host + (handoff.ledger.code_table_bytes if recallable else 0),
    )


class Acceptor:
    """The accept stage of one worker: its KV budget, its rendezvous store, its offload
    channels; blocking pair-group work runs on `executor` threads."""

    def __init__(
        self,
        budget: KVBudget,
        receiver: KVReceiver,
        offload: OffloadChannels,
        executor: Executor,
        *,
        cache_dtype: torch.dtype,
        transfer_timeout_s: float,
        policy_timeout_s: float,
    ) -> None:
        self._budget = budget
        self._receiver = receiver
        self._offload = offload
        self._executor = executor
        self._cache_dtype = cache_dtype
        self._transfer_timeout_s = transfer_timeout_s
        self._policy_timeout_s = policy_timeout_s

    async def accept(self, handoff: ViewHandoff) -> Accepted:
        """Deadline → reservation → posted receive → lease keeper; nothing is held on failure."""
        deadline = transfer_deadline(handoff, self._transfer_timeout_s)
        reservation = self._budget.reserve(self.reserved_bytes(handoff), f"transfer {handoff.key}")
        try:
            recv = await self._post_receives(handoff, deadline)
        except BaseException as exc:
            reservation.release()
            if isinstance(exc, TransferError):
                raise accept_error(exc) from exc
            raise
        trace_parent = extract_context(handoff.descriptor.trace_carrier())
        return Accepted(handoff, deadline, reservation, recv, self._lease(handoff), trace_parent)

    def reserved_bytes(self, handoff: ViewHandoff) -> int:
        return handoff_reservation_bytes(handoff, self._cache_dtype)

    async def _post_receives(self, handoff: ViewHandoff, deadline: Deadline) -> RecvTransfer:
        """Join the descriptor's pair group and post the receives (a worker thread), by the
        transfer's deadline. If the caller gives up meanwhile, or the deadline passes, a
        receive that still starts is cancelled at once."""
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, self._receiver.start_recv, handoff.descriptor, deadline
        )
        try:
            async with asyncio.timeout(deadline.remaining()):  # not wait_for: on 3.11 it can swallow a cancel
                return await asyncio.shield(future)
        except TimeoutError:
            future.add_done_callback(_cancel_orphan)
            late = "receives not posted by the transfer deadline"
            raise TransferFailed(late, field="descriptor") from None
        except asyncio.CancelledError:
            future.add_done_callback(_cancel_orphan)
            raise

    def _lease(self, handoff: ViewHandoff) -> LeaseKeeper | None:
        """The (not yet started) lease keeper of a recallable_remote transfer's offloaded rows."""
        offload = handoff.offload
        if offload.mode is not RecoverabilityMode.RECALLABLE_REMOTE:
            return None
        key = handoff.key
        where = RemoteHandoff(
            key.request_id, key.request_generation, offload.handoff_id, offload.address
        )
        stub = self._offload.stub(offload.address)
        return LeaseKeeper(where, stub, offload.lease_ms, self._policy_timeout_s)


def transfer_deadline(handoff: ViewHandoff, transfer_timeout_s: float) -> Deadline:
    """The descriptor's deadline capped by `transfer_timeout_s`; TransferFailed if it passed."""
    seconds = transfer_timeout_s
    if handoff.deadline_unix_ms:
        remaining = handoff.deadline_unix_ms / 1000.0 - time.time()
        if remaining <= 0:
            passed = f"passed {-remaining:.3f} s ago"
            raise TransferFailed(passed, field="descriptor.deadline_unix_ms")
        seconds = min(seconds, remaining)
    return Deadline.after(seconds)


def accept_error(exc: TransferError) -> ServiceError:
    """The typed error of a receive that could not be posted."""
    if isinstance(exc, PairGroupsExhausted):
        return CapacityExhausted(exc.reason, field="pair_groups")
    if isinstance(exc, TransferMismatch):
        return TransferInvalid(exc.reason, field=f"descriptor.{exc.field}")
    return TransferFailed(exc.reason, field="descriptor.rendezvous_address")


def accepted_response(accepted: Accepted, worker_id: str) -> decode_pb2.AcceptTransferResponse:
    """The AcceptTransfer answer: the ranks of the pair group and the bytes reserved."""
    return decode_pb2.AcceptTransferResponse(
        transfer_id=accepted.transfer_id,
        accepted=True,
        sender_rank=SENDER_RANK,
        receiver_rank=RECEIVER_RANK,
        reserved_bytes=accepted.reservation.nbytes,
        decode_worker=worker_id,
    )


def _cancel_orphan(future: asyncio.Future[RecvTransfer]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().cancel("AcceptTransfer was cancelled")
