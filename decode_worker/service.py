"""The `kvrelay.v1.DecodeWorker` service: accept → receive → verify → decode → stream.

A prefill worker asks `GetTransferEndpoint` once for this worker's rendezvous store, reserves
a pair group there, and calls `AcceptTransfer` with a descriptor naming it. AcceptTransfer
parses it (wire.py), reserves the KV bytes and posts the receives (accept.py) and returns at
once; a background task then runs the transfer's stages, each one call:

    receive.py   the view and its sidecar over the pair group     span transfer.recv
    verify.py    manifest fits → view matches → receipt digest    span kv.verify
                 recomputes → summaries cover the omitted rows →
                 the fence says this state is current for its g_r
    recall.py    recallable manifests: the recall session, its successor publisher, and
                 the offload lease kept from now on (recallable_remote)
    retention.py manifests that retain at decode: the retention session and its publisher
    admit.py     into the continuous-batching decode loop (scheduler.py)

`StreamTokens` (stream.py) streams token 0, every decoded token and one summary. Each
transfer's progress is one state machine (lifecycle.py): whatever fails releases what the
transfer holds by the transition that ends it, and is recorded (`rejections`) when a stage
refused it. A stream that closes early cancels the request and frees its KV at once; an
accepted transfer whose stream has not opened is released as soon as the fence says its
request ended or was begun again (asked every `_ENDED_CHECK_S`: a gateway whose client left
between the prefill and the stream opens none, but it ends the request), and after
`lease_timeout_s` (counted from verification) in any case. The gateway ends the request at the
policy service; this worker only publishes recall and decode-time retention successors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from decode_worker.accept import Acceptor, accepted_response
from decode_worker.admit import RetentionOpener, admit
from decode_worker.config import DecodeWorkerConfig
from decode_worker.errors import StaleTransfer, TransferFailed
from decode_worker.lifecycle import Transfer, TransferTable
from decode_worker.offload_lease import OffloadChannels
from decode_worker.recall import RecallOpener
from decode_worker.receive import receive
from decode_worker.scheduler import DecodeScheduler
from decode_worker.stream import open_stream, stream_events
from decode_worker.verify import Verifier
from decode_worker.wire import parse_handoff
from services.kvpolicy.fit import Deployment
from services.model import LoadedModel
from services.policy import NotFound, PolicyClient, PolicyError
from services.policy.manifests import ManifestCache
from services.rpc.errors import ServiceError, maps_errors, reject_unknown_fields
from services.rpc.kvrelay.v1 import decode_pb2, decode_pb2_grpc
from services.telemetry import metrics
from services.transfer import KVReceiver, TransferError
from services.transfer.pairgroup import backend_for

log = logging.getLogger(__name__)

SERVICE_NAME = "kvrelay.v1.DecodeWorker"
# How often an accepted transfer whose stream has not opened asks whether its request is
# still live (a stream normally opens within milliseconds, so this is rarely asked at all).
_ENDED_CHECK_S = 0.25


class DecodeServicer(decode_pb2_grpc.DecodeWorkerServicer):
    """Thin adapter: each handler and the transfer's background task are one call per stage;
    blocking transfer and verification work runs on `executor` threads."""

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
        self._transfers = TransferTable()
        self._background: set[asyncio.Task[Any]] = set()
        self._offload = OffloadChannels(config.server.max_message_bytes, config.server.security)
        self._acceptor = Acceptor(
            scheduler.budget, receiver, self._offload, executor, cache_dtype=loaded.dtype,
            transfer_timeout_s=config.transfer_timeout_s, policy_timeout_s=config.policy_timeout_s,
        )
        manifests = ManifestCache(
            policy, capacity=config.manifest_cache_size, timeout_s=config.policy_timeout_s
        )
        self._verifier = Verifier(policy, manifests, Deployment(loaded.tensor_contract), executor,
                                  policy_timeout_s=config.policy_timeout_s)
        self._recalls = RecallOpener(policy, receiver, worker_id=config.worker_id,
                                     policy_timeout_s=config.policy_timeout_s)
        self._retentions = RetentionOpener(policy, worker_id=config.worker_id,
                                           policy_timeout_s=config.policy_timeout_s)

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
        handoff = parse_handoff(
            request.descriptor,
            vocab_size=self.loaded.config.vocab_size,
            max_new_tokens=self.config.max_new_tokens,
        )
        with self._transfers.claim(handoff.descriptor.transfer_id):
            transfer = self._transfers.add(Transfer(await self._acceptor.accept(handoff)))
        transfer.tasks = [self._spawn(self._run(transfer)), self._spawn(self._expire(transfer))]
        return accepted_response(transfer.accepted, self.config.worker_id)

    @maps_errors
    async def StreamTokens(
        self, request: decode_pb2.StreamTokensRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeEvent]:
        reject_unknown_fields(request)
        transfer = open_stream(self._transfers, request)
        context.add_done_callback(lambda _: self._close(transfer, "stream closed"))
        try:
            events = stream_events(transfer, policy_timeout_s=self.config.policy_timeout_s,
                                   event_timeout_s=self.config.transfer_timeout_s)
            async for event in events:
                yield event
        finally:
            self._close(transfer, "stream ended")

    async def close(self) -> None:
        """Release every open transfer and wait for the background tasks."""
        for transfer in self._transfers.all():
            self._close(transfer, "decode worker stopping")
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self._offload.close()

    async def _run(self, transfer: Transfer) -> None:
        """receive → verify → recall → decode, each stage's product handed to the transfer;
        a stage that refuses the transfer fails it (which releases what it holds)."""
        accepted = transfer.accepted
        try:
            received = await receive(accepted, self._executor)
            transfer.receive(received)
            verified = await self._verifier.verify(accepted, received)
            transfer.verify(verified)
            recall = self._recalls.open(accepted, received, verified)
            retention = self._retentions.open(accepted, verified)
        except TransferError as exc:
            failed = TransferFailed(f"receive failed: {exc.reason}", field="transfer")
            self._reject(transfer, failed)
        except ServiceError as exc:
            self._reject(transfer, exc)
        else:
            deliver = transfer.deliver
            transfer.decode(admit(self.scheduler, accepted, received, verified, recall, deliver,
                                  retention))

    def _reject(self, transfer: Transfer, error: ServiceError) -> None:
        transfer.fail(error)
        self.rejections[f"{type(error).__name__}:{error.field}"] += 1
        metrics.DECODE_REJECTED.labels(type(error).__name__).inc()
        if isinstance(error, StaleTransfer):
            metrics.STALE_REJECTIONS.labels("decode").inc()
        key = transfer.accepted.handoff.key
        log.warning("transfer %s rejected: %s: %s", key, type(error).__name__, error)

    async def _expire(self, transfer: Transfer) -> None:
        # The lease runs once the view is verified or rejected (the receive is bounded by the
        # transfer deadline), so a slow transfer is never released before anyone could stream.
        # Until a stream opens, a transfer that still holds KV (decoding) asks the fence every
        # `_ENDED_CHECK_S`: a gateway that gave up between the prefill and the stream (its
        # client left) opens none, but it ends the request, and a decode verified just before
        # that EndRequest must not run on unread. A rejected or finished one holds nothing and
        # waits out the lease, so a late stream still reads how it ended.
        await transfer.settled()
        loop = asyncio.get_running_loop()
        lease_ends = loop.time() + self.config.lease_timeout_s
        while not transfer.stream_open:
            left = lease_ends - loop.time()
            if left <= 0:
                log.warning("transfer %s released: no stream opened within %.1f s",
                            transfer.accepted.handoff.key, self.config.lease_timeout_s)
                self._close(transfer, "lease expired before a stream opened")
                return
            await asyncio.sleep(left if transfer.terminal else min(left, _ENDED_CHECK_S))
            if transfer.stream_open or transfer.terminal:
                continue
            gone = await self._request_gone(transfer)
            if gone is not None and not transfer.stream_open:
                log.info("transfer %s released before a stream opened: %s", transfer.accepted.handoff.key, gone)
                self._close(transfer, gone)
                return

    async def _request_gone(self, transfer: Transfer) -> str | None:
        """Why no stream will open for `transfer` (its request ended, was begun again or is
        unknown to the policy service); None while it is current or the fence is unreadable."""
        accepted = transfer.accepted
        try:
            fence = await self.policy.get_fence(accepted.request_id, timeout_s=self.config.policy_timeout_s)
        except NotFound:
            return "the request is unknown to the policy service"
        except PolicyError:
            return None  # unreadable now: asked again, and the lease still bounds the wait
        if fence.ended:
            return "the request ended"
        if fence.request_generation != accepted.request_generation:
            return f"the request was begun again (request generation {fence.request_generation})"
        return None

    def _close(self, transfer: Transfer, reason: str) -> None:
        """Forget the transfer and stop its stages (idempotent); it releases what it holds."""
        if not self._transfers.remove(transfer):
            return
        current = _current_task()
        for task in transfer.tasks:
            if task is not current:
                task.cancel()
        transfer.close(reason)

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # called back outside the event loop (grpc done callback)
        return None
