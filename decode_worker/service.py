"""The `kvrelay.v1.DecodeWorker` service: accept → receive → verify → decode → stream.

A prefill worker asks `GetTransferEndpoint` once for this worker's rendezvous store, reserves
a pair group there, and calls `AcceptTransfer` with a descriptor naming it. AcceptTransfer
validates the descriptor, reserves the KV bytes the request can occupy (over budget →
RESOURCE_EXHAUSTED), posts the receives and returns at once; a background task then

    receives the view (by the descriptor's deadline)          span transfer.recv
      and its sidecar (page summaries; host-tier rows for recallable_local)
    verifies it before any use                                span kv.verify
        manifest fits the model → view matches the descriptor → receipt digest recomputes
        from the received positions → the fence says this state is current for its g_r →
        the summaries (and host-tier rows) cover exactly the omitted positions
    submits it to the continuous-batching decode loop, with a recall session for a
    recallable manifest (decode_worker/recall.py: where pages come from, how successor
    states are published); for recallable_remote the offload lease is renewed while the
    request lives and the rows released when it ends

Anything that fails releases the reservation and is recorded (`rejections`); nothing partial is
decoded. `StreamTokens` waits for verification (failed: FAILED_PRECONDITION for a rejected
or stale view, UNAVAILABLE for a transfer that did not complete), streams the first token
(sampled by the prefill worker, from the descriptor) and every decoded token, then one
summary, and ends the request at the policy service. A stream that closes early cancels the
request and frees its KV at once; an accepted transfer whose stream never opens is released
after `lease_timeout_s` (counted from verification).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from opentelemetry.context import Context

from decode_worker.config import DecodeWorkerConfig
from decode_worker.errors import (
    CapacityExhausted,
    DuplicateTransfer,
    RecallAborted,
    StaleTransfer,
    TransferFailed,
    TransferInvalid,
    UnknownTransfer,
    ViewRejected,
)
from decode_worker.offload_lease import LeaseKeeper, OffloadChannels
from decode_worker.recall import (
    LocalPageFetcher,
    RemoteHandoff,
    RemotePageFetcher,
    SuccessorPublisher,
)
from decode_worker.scheduler import (
    FINISH_CANCELLED,
    DecodeEvent,
    DecodeFailed,
    DecodeFinished,
    DecodeRequest,
    DecodeScheduler,
    Reservation,
    TokenOut,
    asyncio_sink,
    reservation_bytes,
)
from decode_worker.verify import (
    check_fence,
    check_manifest,
    check_offload,
    check_view,
    recompute_receipt,
    verified_state,
)
from decode_worker.wire import IncomingTransfer, incoming_from_proto, ledger_to_proto
from services.kvpolicy.errors import KVPolicyError
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, RecoverabilityMode
from services.kvpolicy.packing import PackedKVView
from services.kvpolicy.receipt import Receipt
from services.model import LoadedModel
from services.model.sampler import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from services.offload.recall import PageFetcher, RecallSession
from services.policy import Fence, NotFound, PolicyClient, PolicyError
from services.rpc.errors import ServiceError, maps_errors, reject_unknown_fields
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.telemetry import metrics
from services.telemetry.spans import extract_context, span
from services.transfer import (
    Deadline,
    KVReceiver,
    PairGroupsExhausted,
    RecvTransfer,
    Sidecar,
    TransferError,
    TransferMismatch,
)
from services.transfer.pairgroup import RECEIVER_RANK, SENDER_RANK, backend_for

log = logging.getLogger(__name__)

SERVICE_NAME = "kvrelay.v1.DecodeWorker"
_FINISH_REASONS = {
    FINISH_EOS: common_pb2.FINISH_REASON_STOP,
    FINISH_STOP: common_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FINISH_CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
T = TypeVar("T")


class DecodeAborted(TransferFailed):
    """The decode loop dropped the request after it started (e.g. the worker is stopping)."""


class _Transfer:
    """Runtime state of one accepted transfer; touched only on the event loop."""

    def __init__(self, incoming: IncomingTransfer, reservation: Reservation, deadline: Deadline) -> None:
        self.incoming = incoming
        self.reservation = reservation
        self.deadline = deadline
        self.recv: RecvTransfer | None = None
        self.events: asyncio.Queue[DecodeEvent] = asyncio.Queue()
        self.verified = asyncio.Event()
        self.error: ServiceError | None = None
        self.receipt: Receipt | None = None
        self.sidecar: Sidecar | None = None
        self.session: RecallSession | None = None
        self.publisher: SuccessorPublisher | None = None
        self.lease: LeaseKeeper | None = None
        self.trace_parent: Context | None = None
        self.bytes_moved = 0
        self.stream_open = False
        self.submitted = False
        self.closed = False
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def key(self) -> str:
        return str(self.incoming.descriptor.key)

    @property
    def request_id(self) -> str:
        return self.incoming.receipt.request_id

    @property
    def request_generation(self) -> int:
        return self.incoming.receipt.request_generation

    @property
    def transfer_id(self) -> str:
        return self.incoming.descriptor.transfer_id


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    """Thin adapter: parse at the edge, verify with `decode_worker.verify`, decode with the
    `DecodeScheduler`; blocking transfer and verification work runs on `executor` threads."""

    def __init__(
        self,
        config: DecodeWorkerConfig,
        loaded: LoadedModel,
        scheduler: DecodeScheduler,
        receiver: KVReceiver,
        policy: PolicyClient,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.scheduler = scheduler
        self.receiver = receiver
        self.policy = policy
        self.rejections: collections.Counter[str] = collections.Counter()
        self._executor = executor
        self._transfers: dict[str, _Transfer] = {}
        self._manifests: collections.OrderedDict[str, KVVisibilityPolicyManifest] = collections.OrderedDict()
        self._background: set[asyncio.Task[Any]] = set()
        self._offload = OffloadChannels(config.server.max_message_bytes)

    @property
    def open_transfers(self) -> int:
        return len(self._transfers)

    @maps_errors
    async def GetTransferEndpoint(
        self, request: decode_pb2.GetTransferEndpointRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.TransferEndpoint:
        return decode_pb2.TransferEndpoint(
            rendezvous_address=self.receiver.address,
            decode_worker=self.config.worker_id,
            backends=[backend_for(self.receiver.device)],
        )

    @maps_errors
    async def AcceptTransfer(
        self, request: decode_pb2.AcceptTransferRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.AcceptTransferResponse:
        reject_unknown_fields(request)
        incoming = incoming_from_proto(
            request.descriptor, vocab_size=self.loaded.config.vocab_size, max_new_tokens=self.config.max_new_tokens
        )
        descriptor = incoming.descriptor
        if descriptor.transfer_id in self._transfers:
            raise DuplicateTransfer("is already accepted", field="descriptor.transfer_id")
        deadline = self._deadline(incoming)
        offload = incoming.offload
        sidecar = descriptor.sidecar
        nbytes = reservation_bytes(
            descriptor.layout, incoming.max_tokens, self.loaded.dtype,
            recallable_rows=offload.omitted_rows if offload.recallable else 0,
            host_bytes=sidecar.host_tier_bytes if sidecar is not None else 0,
        )
        record = _Transfer(incoming, self.scheduler.budget.reserve(nbytes, f"transfer {descriptor.key}"), deadline)
        record.lease = self._lease(incoming)
        self._transfers[record.transfer_id] = record
        try:
            record.recv = await self._start_recv(record)
        except BaseException as exc:
            self._forget(record)
            record.reservation.release()
            if isinstance(exc, TransferError):
                raise _accept_error(exc) from exc
            raise
        record.tasks = [self._spawn(self._receive(record)), self._spawn(self._expire_lease(record))]
        return decode_pb2.AcceptTransferResponse(
            transfer_id=record.transfer_id,
            accepted=True,
            sender_rank=SENDER_RANK,
            receiver_rank=RECEIVER_RANK,
            reserved_bytes=nbytes,
            decode_worker=self.config.worker_id,
        )

    @maps_errors
    async def StreamTokens(
        self, request: decode_pb2.StreamTokensRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeEvent]:
        reject_unknown_fields(request)
        record = self._open_stream(request)
        context.add_done_callback(lambda _: self._close(record, "stream closed"))
        try:
            await self._wait_verified(record)
            yield decode_pb2.DecodeEvent(token=common_pb2.TokenEvent(token_id=record.incoming.first_token_id, index=0))
            while True:
                event = await self._next_event(record)
                if isinstance(event, TokenOut):
                    token = common_pb2.TokenEvent(token_id=event.token_id, index=event.index, logprob=event.logprob)
                    yield decode_pb2.DecodeEvent(token=token)
                elif isinstance(event, DecodeFinished):
                    if event.reason != FINISH_CANCELLED:
                        self._spawn(self._end_request(record))
                    yield decode_pb2.DecodeEvent(summary=self._summary(record, event))
                    return
                else:
                    raise _failure(record, event)
        finally:
            self._close(record, "stream ended")

    async def close(self) -> None:
        """Release every open transfer and wait for the background tasks."""
        for record in list(self._transfers.values()):
            self._close(record, "decode worker stopping")
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._offload.close()

    # --- accept --------------------------------------------------------------------------

    def _deadline(self, incoming: IncomingTransfer) -> Deadline:
        seconds = self.config.transfer_timeout_s
        if incoming.deadline_unix_ms:
            remaining = incoming.deadline_unix_ms / 1000.0 - time.time()
            if remaining <= 0:
                raise TransferFailed(f"passed {-remaining:.3f} s ago", field="descriptor.deadline_unix_ms")
            seconds = min(seconds, remaining)
        return Deadline.after(seconds)

    async def _start_recv(self, record: _Transfer) -> RecvTransfer:
        """Join the descriptor's pair group and post the receives (a worker thread). If the
        caller gives up meanwhile, a receive that still starts is cancelled at once."""
        descriptor = record.incoming.descriptor
        future = asyncio.get_running_loop().run_in_executor(
            self._executor, self.receiver.start_recv, descriptor, record.deadline
        )
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_cancel_orphan)
            raise

    async def _receive(self, record: _Transfer) -> None:
        # The descriptor carries the prefill worker's transfer.send context: every span of
        # this request on this worker (receive, verify, decode step batches) is its child.
        parent = extract_context(record.incoming.descriptor.trace_carrier())
        record.trace_parent = parent
        attributes = _attributes(record)
        try:
            with span("transfer.recv", parent, **attributes, bytes=record.incoming.nbytes) as current:
                assert record.recv is not None
                with metrics.timed(metrics.TRANSFER_SECONDS.labels("recv")):
                    view = await self._in_thread(record.recv.wait_for_view, record.deadline)
                    record.sidecar = await self._in_thread(record.recv.wait_for_sidecar, record.deadline)
                record.bytes_moved = record.recv.bytes_moved
                current.set_attribute("bytes_moved", record.bytes_moved)
            metrics.TRANSFER_BYTES.labels("recv").inc(record.bytes_moved)
            with span("kv.verify", parent, **attributes) as current:
                manifest = await self._manifest(record.incoming.receipt.manifest_sha256)
                current.set_attribute("manifest_name", manifest.name)
                record.receipt = await self._verify(record, manifest, view)
                record.session = self._recall_session(record, manifest)
                current.set_attributes({"retained_rows": view.total_rows, "receipt_digest": record.receipt.digest,
                                        "recoverability": record.incoming.offload.mode.value,
                                        "offload_degraded": record.incoming.offload.degraded or None})
                log.info("transfer %s verified: %d rows, %d bytes from %s", record.key, view.total_rows,
                         record.bytes_moved, record.incoming.descriptor.source_worker)
        except TransferError as exc:
            self._reject(record, TransferFailed(f"receive failed: {exc.reason}", field="transfer"))
        except ServiceError as exc:
            self._reject(record, exc)
        else:
            self._admit(record, manifest, view)

    async def _verify(self, record: _Transfer, manifest: KVVisibilityPolicyManifest, view: PackedKVView) -> Receipt:
        claim = record.incoming.receipt
        layout = record.incoming.descriptor.layout

        def pure_checks() -> Receipt:
            check_manifest(manifest, claim, self.loaded.tensor_contract)
            check_view(view, manifest, claim, layout)
            check_offload(manifest, record.incoming.offload, record.sidecar, view, claim)
            return recompute_receipt(manifest, claim, view)

        receipt = await self._in_thread(pure_checks)
        check_fence(await self._fence(claim.request_id), claim)
        return receipt

    async def _manifest(self, sha256: str) -> KVVisibilityPolicyManifest:
        manifest = self._manifests.get(sha256)
        if manifest is not None:
            self._manifests.move_to_end(sha256)
            return manifest
        try:
            stored = await self.policy.get_manifest(sha256, timeout_s=self.config.policy_timeout_s)
            manifest = KVVisibilityPolicyManifest.from_json(stored.canonical_json)
        except NotFound:
            raise ViewRejected(f"manifest {sha256} is not registered", field="receipt.manifest_sha256") from None
        except KVPolicyError as exc:
            raise ViewRejected(f"stored manifest is invalid: {exc}", field="receipt.manifest_sha256") from None
        except PolicyError as exc:
            raise TransferFailed(f"policy service: {exc}", field="receipt.manifest_sha256") from exc
        self._manifests[sha256] = manifest
        while len(self._manifests) > self.config.manifest_cache_size:
            self._manifests.popitem(last=False)
        return manifest

    async def _fence(self, request_id: str) -> Fence | None:
        try:
            return await self.policy.get_fence(request_id, timeout_s=self.config.policy_timeout_s)
        except NotFound:
            return None
        except PolicyError as exc:
            raise TransferFailed(f"policy service: {exc}", field="fence") from exc

    def _admit(self, record: _Transfer, manifest: KVVisibilityPolicyManifest, view: PackedKVView) -> None:
        if not record.closed:
            incoming = record.incoming
            owner_map = manifest.owner_to_kv_head() if manifest.owners_are_query_heads else None
            if incoming.offload.degraded:
                metrics.RECALL_FALLBACKS.labels(incoming.offload.degraded).inc()
            self.scheduler.submit(
                DecodeRequest(
                    request_id=record.request_id,
                    request_generation=record.request_generation,
                    recall=record.session,
                    view=view,
                    frontier=incoming.receipt.end,
                    first_token=incoming.first_token_id,
                    sampling=incoming.sampling,
                    max_tokens=incoming.max_tokens,
                    cache_generation=incoming.receipt.cache_generation,
                    reservation=record.reservation,
                    sink=asyncio_sink(asyncio.get_running_loop(), record.events),
                    owner_to_kv_head=owner_map,
                    trace_parent=record.trace_parent,
                )
            )
            record.submitted = True
        record.verified.set()

    def _recall_session(self, record: _Transfer, manifest: KVVisibilityPolicyManifest) -> RecallSession | None:
        """The recall session of a recallable request: its pages come from the host tier
        (local) or the prefill worker's store (remote, whose lease is kept from now on)."""
        offload, sidecar, receipt = record.incoming.offload, record.sidecar, record.receipt
        if not offload.recallable or sidecar is None or receipt is None:
            return None
        loop = asyncio.get_running_loop()
        record.publisher = SuccessorPublisher(
            self.policy, loop, prefill_worker=record.incoming.descriptor.source_worker,
            decode_worker=self.config.worker_id, timeout_s=self.config.policy_timeout_s,
        )
        fetch: PageFetcher
        if offload.mode is RecoverabilityMode.RECALLABLE_LOCAL:
            assert sidecar.host_rows is not None  # checked by offload_from_proto
            fetch = LocalPageFetcher(sidecar.host_rows)
        else:
            assert record.lease is not None  # every recallable_remote transfer has one

            def parent_state() -> int:
                return session.state.state_generation

            lease = record.lease
            fetch = RemotePageFetcher(lease.handoff, lease.stub, self.receiver, loop, parent_state,
                                      record.incoming.descriptor.trace_context)
        try:
            state = verified_state(record.incoming.receipt, receipt)
            session = RecallSession(manifest, sidecar.summaries, fetch, state=state, on_successor=record.publisher)
        except KVPolicyError as exc:
            raise ViewRejected(f"no recall session: {exc.reason}", field=exc.field) from None
        if record.lease is not None:
            record.lease.start()
        return session

    def _lease(self, incoming: IncomingTransfer) -> LeaseKeeper | None:
        """The (not yet started) lease keeper of a recallable_remote transfer's offloaded rows."""
        offload = incoming.offload
        if offload.mode is not RecoverabilityMode.RECALLABLE_REMOTE:
            return None
        claim = incoming.receipt
        handoff = RemoteHandoff(claim.request_id, claim.request_generation, offload.handoff_id, offload.address)
        return LeaseKeeper(handoff, self._offload.stub(offload.address), offload.lease_ms, self.config.policy_timeout_s)

    def _reject(self, record: _Transfer, error: ServiceError) -> None:
        record.error = error
        record.verified.set()
        record.reservation.release()
        if record.lease is not None:  # nobody will recall the offloaded rows
            record.lease.release_soon()
        if record.recv is not None:
            record.recv.cancel(str(error))
        self.rejections[f"{type(error).__name__}:{error.field}"] += 1
        metrics.DECODE_REJECTED.labels(type(error).__name__).inc()
        if isinstance(error, StaleTransfer):
            metrics.STALE_REJECTIONS.labels("decode").inc()
        log.warning("transfer %s rejected: %s: %s", record.key, type(error).__name__, error)

    async def _expire_lease(self, record: _Transfer) -> None:
        # The lease runs once the view is verified or rejected (the receive is bounded by the
        # transfer deadline), so a slow transfer is never released before anyone could stream.
        await record.verified.wait()
        await asyncio.sleep(self.config.lease_timeout_s)
        if not record.stream_open:
            log.warning("transfer %s released: no stream opened within %.1f s", record.key, self.config.lease_timeout_s)
            self._close(record, "lease expired before a stream opened")

    # --- stream --------------------------------------------------------------------------

    def _open_stream(self, request: decode_pb2.StreamTokensRequest) -> _Transfer:
        record = self._transfers.get(request.transfer_id)
        if record is None or record.incoming.descriptor.request_id != request.request_id:
            raise UnknownTransfer(
                f"no accepted transfer {request.transfer_id!r} for request {request.request_id!r}",
                field="transfer_id",
            )
        if request.request_generation != record.incoming.receipt.request_generation:
            metrics.STALE_REJECTIONS.labels("decode").inc()
            raise StaleTransfer(
                f"transfer carries request generation {record.incoming.receipt.request_generation}",
                field="request_generation",
            )
        if record.stream_open:
            raise DuplicateTransfer("a stream is already open for this transfer", field="transfer_id")
        record.stream_open = True
        return record

    async def _wait_verified(self, record: _Transfer) -> None:
        timeout = record.deadline.remaining() + 2 * self.config.policy_timeout_s
        try:
            await asyncio.wait_for(record.verified.wait(), timeout)
        except TimeoutError:
            raise TransferFailed(f"not verified within {timeout:.1f} s", field="transfer") from None
        if record.error is not None:
            raise record.error

    async def _next_event(self, record: _Transfer) -> DecodeEvent:
        try:
            return await asyncio.wait_for(record.events.get(), self.config.transfer_timeout_s)
        except TimeoutError:
            raise DecodeAborted(f"no token for {self.config.transfer_timeout_s} s", field="decode") from None

    def _summary(self, record: _Transfer, finished: DecodeFinished) -> decode_pb2.DecodeSummary:
        claim = record.incoming.receipt
        published = record.publisher.published if record.publisher is not None else []
        state, parent = (
            (published[-1].state_generation, published[-1].parent_state_generation)
            if published
            else (claim.state_generation, claim.parent_state_generation)
        )
        ledger = ledger_to_proto(record.incoming.ledger, record.bytes_moved)
        ledger.recalled_bytes = finished.recalled_bytes
        degraded = (record.incoming.offload.degraded,) if record.incoming.offload.degraded else ()
        return decode_pb2.DecodeSummary(
            output_tokens=finished.output_tokens,
            tpot_ms=finished.tpot_ms,
            finish_reason=_FINISH_REASONS[finished.reason],
            generations=common_pb2.Generations(
                request_generation=claim.request_generation,
                state_generation=state,
                parent_state_generation=parent,
                cache_generation=finished.cache_generation,
            ),
            ledger=ledger,
            recalled_rows=finished.recalled_rows,
            recall_count=finished.recall_count,
            fallbacks=[*degraded, *finished.fallbacks],
            verified_receipt_digest=record.receipt.digest if record.receipt else "",
            retained_rows=record.incoming.descriptor.layout.total_rows,
        )

    async def _end_request(self, record: _Transfer) -> None:
        claim = record.incoming.receipt
        try:
            await self.policy.end_request(
                claim.request_id, claim.request_generation, timeout_s=self.config.policy_timeout_s
            )
        except PolicyError as exc:  # ended already, or superseded: nothing left to do
            log.info("EndRequest %s@r%d: %s", claim.request_id, claim.request_generation, exc)

    # --- lifecycle -----------------------------------------------------------------------

    def _close(self, record: _Transfer, reason: str) -> None:
        """Release everything the transfer holds (idempotent): cancel its decode, or its
        receive and reservation if it never reached the decode loop."""
        if record.closed:
            return
        record.closed = True
        self._forget(record)
        current = _current_task()
        for task in record.tasks:
            if task is not current:
                task.cancel()
        if record.lease is not None:
            record.lease.release_soon()
        if record.submitted:
            self.scheduler.cancel(record.request_id, record.request_generation)
        else:
            record.reservation.release()
            if record.recv is not None:
                record.recv.cancel(reason)

    def _forget(self, record: _Transfer) -> None:
        if self._transfers.get(record.transfer_id) is record:
            del self._transfers[record.transfer_id]

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _in_thread(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)


def _failure(record: _Transfer, failed: DecodeFailed) -> ServiceError:
    """The error a failed decode ends its stream with: a recall that could not bring rows
    back under `fail_request` (RecallAborted), a recall whose successor state the fence
    refused (StaleTransfer), or anything else (DecodeAborted)."""
    outcome = failed.recall
    if outcome is None:
        return DecodeAborted(failed.message)
    rejected = record.publisher.rejected if record.publisher is not None else None
    if rejected is not None and not outcome.timed_out:
        return StaleTransfer(f"recall: {rejected}", field="state_generation", current=rejected.current)
    what = "timed out" if outcome.timed_out else "could not bring its rows back"
    return RecallAborted(f"recall of {len(outcome.pages)} pages {what}: {outcome.reason}", field="recall")


def _cancel_orphan(future: asyncio.Future[RecvTransfer]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().cancel("AcceptTransfer was cancelled")


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # called back outside the event loop (grpc done callback)
        return None


def _accept_error(exc: TransferError) -> ServiceError:
    if isinstance(exc, PairGroupsExhausted):
        return CapacityExhausted(exc.reason, field="pair_groups")
    if isinstance(exc, TransferMismatch):
        return TransferInvalid(exc.reason, field=f"descriptor.{exc.field}")
    return TransferFailed(exc.reason, field="descriptor.rendezvous_address")


def _attributes(record: _Transfer) -> dict[str, object]:
    claim = record.incoming.receipt
    return {
        "request_id": claim.request_id,
        "request_generation": claim.request_generation,
        "state_generation": claim.state_generation,
        "cache_generation": claim.cache_generation,
        "manifest_sha256": claim.manifest_sha256,
        "transfer_id": record.transfer_id,
        "source_worker": record.incoming.descriptor.source_worker,
    }
