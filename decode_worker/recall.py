"""The decode worker's side of recall: where recalled rows come from, and how a recall's
successor state is published. The engine (`services.offload.recall.RecallSession`) decides
when and what to recall; this module plugs it into the worker.

    RecallOpener         a verified recallable transfer's `Recall`: the session (its pages
                         from the host tier or the prefill worker) and its publisher; the
                         offload lease of recallable_remote is kept from then on
    LocalPageFetcher     recallable_local: pages from the host tier that came with the view
                         (`services.offload.fetchers`)
    RemotePageFetcher    recallable_remote: OffloadService.Recall over gRPC (deadline =
                         recall_timeout_ms), rows over the pair group into this worker's
                         KVReceiver, like the main transfer
    SuccessorPublisher   compare-and-publish of the successor state at the policy service

Both remote calls run on the worker's event loop (gRPC aio and the policy client live
there). Sessions recall with `worker_strategy` (the codes ranking when the summaries carry
row codes, else `WORKER_STRATEGY`): after the first step a fetch runs on the
recall engine's fetch threads while the decode loop goes on (its rows join the next step;
the fetches of a batch's requests overlap), and only the publisher is called from the decode
loop thread; both wait with deadlines, so a prefill worker that is gone costs one recall
deadline, never a hang. A failure to bring rows back raises `RecallUnavailable` (the engine then takes the
manifest's fallback); an answer for another generation than asked is rejected the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from decode_worker.accept import Accepted
from decode_worker.errors import ViewRejected
from decode_worker.offload_lease import RemoteHandoff
from decode_worker.receive import Received
from decode_worker.verify import Verified, verified_state
from services.kvpolicy.errors import KVPolicyError
from services.kvpolicy.manifest import RecoverabilityMode
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.state import KVPolicyState
from services.offload.errors import RecallUnavailable
from services.offload.fetchers import LocalPageFetcher
from services.offload.pages import PageRef, RecalledPage
from services.offload.recall import PageFetcher, RecallSession, worker_strategy
from services.policy import PolicyClient, PolicyUnavailable, StaleGeneration, StatePublication
from services.policy.types import Phase
from services.rpc.kvrelay.v1 import offload_pb2_grpc
from services.telemetry import metrics
from services.transfer import (
    Deadline,
    DescriptorInvalid,
    KVReceiver,
    TransferError,
    TransferTimeout,
)
from services.transfer.recall import (
    RecallAnswer,
    RecallCall,
    answer_from_proto,
    call_to_proto,
    pages_of_view,
    recall_digest,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# The answer may need a moment past the gRPC deadline to reach this thread.
_HANDOVER_S = 0.05


class RemotePageFetcher:
    """Pages from the prefill worker's offload store (`recallable_remote`).

    `parent_state` gives the state generation the recall builds on (the session's current
    state); `loop` is the event loop that owns `stub`'s channel; `trace_context` (a W3C
    carrier) puts the prefill worker's side of every recall into the request's trace.
    """

    def __init__(
        self,
        handoff: RemoteHandoff,
        stub: offload_pb2_grpc.OffloadServiceStub,
        receiver: KVReceiver,
        loop: asyncio.AbstractEventLoop,
        parent_state: Callable[[], int],
        trace_context: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.handoff = handoff
        self._stub = stub
        self._receiver = receiver
        self._loop = loop
        self._parent_state = parent_state
        self._trace_context = trace_context
        self.bytes_moved = 0

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        deadline = Deadline.after(timeout_s)
        call = RecallCall(
            request_id=self.handoff.request_id,
            request_generation=self.handoff.request_generation,
            parent_state_generation=self._parent_state(),
            handoff_id=self.handoff.handoff_id,
            pages=tuple(refs),
            rendezvous_address=self._receiver.address,
            trace_context=self._trace_context,
        )
        answer = self._ask(call, deadline)
        return self._receive(call, answer, deadline)

    def _ask(self, call: RecallCall, deadline: Deadline) -> RecallAnswer:
        request = call_to_proto(call)
        try:
            reply = run_on_loop(self._loop, lambda: self._stub.Recall(request, timeout=deadline.remaining()), deadline)
        except grpc.aio.AioRpcError as exc:
            timed_out = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            raise RecallUnavailable(f"Recall at {self.handoff.address}: {exc.code().name}: {exc.details()}",
                                    timed_out=timed_out) from None
        try:
            answer = answer_from_proto(reply)
        except DescriptorInvalid as exc:
            raise RecallUnavailable(f"malformed answer: {exc}") from None
        if (answer.request_generation, answer.parent_state_generation) != (
            call.request_generation, call.parent_state_generation
        ):
            raise RecallUnavailable(
                f"rejected an answer for request generation {answer.request_generation} / parent state"
                f" {answer.parent_state_generation}; asked {call.request_generation} / {call.parent_state_generation}"
            )
        if answer.transfer is None:
            raise RecallUnavailable("the answer announces no transfer of the rows")
        return answer

    def _receive(self, call: RecallCall, answer: RecallAnswer, deadline: Deadline) -> tuple[RecalledPage, ...]:
        assert answer.transfer is not None
        try:
            transfer = self._receiver.start_recv(answer.transfer, deadline)
            view = transfer.wait_for_view(deadline)
        except TransferError as exc:
            timed_out = isinstance(exc, TransferTimeout) or deadline.expired()
            raise RecallUnavailable(f"recalled rows did not arrive: {exc.reason}", timed_out=timed_out) from None
        self.bytes_moved += transfer.bytes_moved
        metrics.TRANSFER_BYTES.labels("recv").inc(transfer.bytes_moved)
        try:
            pages = pages_of_view(view, answer.pages)
        except DescriptorInvalid as exc:
            raise RecallUnavailable(f"recalled rows do not match the answer: {exc}") from None
        digest = recall_digest(call.request_id, call.request_generation, call.parent_state_generation, pages)
        if digest != answer.transfer.receipt_digest:
            raise RecallUnavailable("recalled positions do not match the answer's digest")
        return pages


class SuccessorPublisher:
    """The engine's `on_successor` hook: compare-and-publish the successor state of a recall
    (or, with `phase` DECODING, of decode-time retention, decode_worker/retention.py).

    A stale or ended request raises (the engine fails the request: its state is no longer
    current); an unreachable policy service raises `RecallUnavailable` (the manifest's
    fallback applies). `rejected` keeps the last refusal for the caller's error status.
    """

    def __init__(
        self,
        policy: PolicyClient,
        loop: asyncio.AbstractEventLoop,
        *,
        prefill_worker: str,
        decode_worker: str,
        timeout_s: float,
        phase: Phase = Phase.RECALLED,
    ) -> None:
        self._policy = policy
        self._phase = phase
        self._loop = loop
        self._prefill_worker = prefill_worker
        self._decode_worker = decode_worker
        self._timeout_s = timeout_s
        self.published: list[KVPolicyState] = []
        self.rejected: StaleGeneration | None = None

    def __call__(self, successor: KVPolicyState) -> None:
        publication = StatePublication(
            request_id=successor.request_id,
            request_generation=successor.request_generation,
            parent_state_generation=successor.parent_state_generation,
            state_generation=successor.state_generation,
            cache_generation=successor.cache_generation,
            receipt_digest=Receipt.for_state(successor).digest,
            manifest_sha256=successor.manifest_sha256,
            phase=self._phase,
            prefill_worker=self._prefill_worker,
            decode_worker=self._decode_worker,
        )
        deadline = Deadline.after(self._timeout_s)
        try:
            run_on_loop(self._loop, lambda: self._policy.publish_state(publication, timeout_s=self._timeout_s), deadline)
        except StaleGeneration as exc:  # RequestEnded too
            self.rejected = exc
            raise
        except PolicyUnavailable as exc:
            raise RecallUnavailable(f"policy service: {exc}") from None
        self.published.append(successor)


@dataclass(frozen=True)
class Recall:
    """A recallable request's recall: the engine's session and the publisher of its successors."""

    session: RecallSession
    publisher: SuccessorPublisher


class RecallOpener:
    """Opens the `Recall` of verified transfers (event loop: the fetchers and the publisher
    start their remote calls there)."""

    def __init__(
        self, policy: PolicyClient, receiver: KVReceiver, *, worker_id: str, policy_timeout_s: float
    ) -> None:
        self._policy = policy
        self._receiver = receiver
        self._worker_id = worker_id
        self._policy_timeout_s = policy_timeout_s

    def open(self, accepted: Accepted, received: Received, verified: Verified) -> Recall | None:
        """The recall of a recallable transfer (None otherwise); ViewRejected if the session
        cannot be built on what was verified. Starts renewing a recallable_remote lease."""
        handoff, sidecar = accepted.handoff, received.sidecar
        if not handoff.offload.recallable or sidecar is None:
            return None
        loop = asyncio.get_running_loop()
        publisher = SuccessorPublisher(
            self._policy, loop, prefill_worker=handoff.descriptor.source_worker,
            decode_worker=self._worker_id, timeout_s=self._policy_timeout_s,
        )
        state = verified_state(verified.receipt)
        fetch: PageFetcher
        if handoff.offload.mode is RecoverabilityMode.RECALLABLE_LOCAL:
            assert sidecar.host_rows is not None  # checked when the ViewHandoff was built
            fetch = LocalPageFetcher(sidecar.host_rows)
        else:
            lease = accepted.lease
            assert lease is not None  # every recallable_remote transfer has one
            fetch = RemotePageFetcher(lease.handoff, lease.stub, self._receiver, loop,
                                      lambda: session.state.state_generation,
                                      handoff.descriptor.trace_context)
        try:
            session = RecallSession(verified.manifest, sidecar.summaries, fetch, state=state,
                                    on_successor=publisher, strategy=worker_strategy(sidecar.summaries))
        except KVPolicyError as exc:
            raise ViewRejected(f"no recall session: {exc.reason}", field=exc.field) from None
        if accepted.lease is not None:
            accepted.lease.start()
        return Recall(session, publisher)


def run_on_loop(loop: asyncio.AbstractEventLoop, start: Callable[[], Awaitable[T]], deadline: Deadline) -> T:
    """Start an awaitable on `loop` (another thread's: gRPC aio calls must begin there) and
    wait for it until `deadline`; RecallUnavailable(timed_out) when it is not done by then
    (it is cancelled)."""

    async def on_loop() -> T:
        return await start()

    future = asyncio.run_coroutine_threadsafe(on_loop(), loop)
    try:
        return future.result(timeout=deadline.remaining() + _HANDOVER_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise RecallUnavailable("no answer by the recall deadline", timed_out=True) from None
    except concurrent.futures.CancelledError:
        raise RecallUnavailable("the worker is stopping") from None
