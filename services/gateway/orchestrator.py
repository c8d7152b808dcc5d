"""One generation request through the disaggregated workers:

    resolve manifest -> begin (request generation g_r) -> pick prefill P and decode D ->
    P.Prefill (P publishes the compressed state and sends it to D) -> D.StreamTokens ->
    forward tokens -> summary -> end

Retry rule: a worker that fails before the first token reaches the client (P unreachable,
a transfer to D that P reports failed, D's stream failing before its first event) is
retried up to `max_retries` times on other workers with a new request generation —
BeginRequest again fences the failed attempt out. After the first token the stream ends
with UNAVAILABLE; the tokens already sent stay valid. A client cancel cancels both workers'
calls and ends the request in the policy service, so a decode worker that has not yet
verified the transfer rejects it and frees its reservation, and one that verified it before
that end but has no stream open (the cancel came between the prefill and the stream, whose
call then may never reach it) frees it once its fence check sees the end, within a fraction
of a second. A caller that needs no more tokens
(the HTTP front, when a stop string matched) says so through `stop_requested`: the decode call
is cancelled the same way and the stream ends with a summary whose finish reason is STOP.

Admission: the pools cap how many requests each decode worker (for the whole stream) and
each prefill worker (for its Prefill call) has outstanding; beyond that a request waits its
turn at the gateway, first for a decode worker, then for a prefill worker, for up to
`admission_s` in all (or the client's own deadline, if sooner). So a burst waits here, before
any KV is computed or reserved, rather than in the workers' own short queues. A prefill
worker that still answers RESOURCE_EXHAUSTED (its queue is shared with other gateways) is
tried again after a jittered backoff, preferring another worker, until that same admission
deadline — without using up a retry; only then does the client see RESOURCE_EXHAUSTED.

Deadlines: every wait has one — the admission wait, each policy call, the Prefill call, the
decode worker's first event and every later one. A stopped worker that never answers ends
the request with UNAVAILABLE naming it (retried if no token was sent), and it is skipped
until it passes a health check again.

A request id is claimed for as long as its stream is open on this gateway: a second Generate
with it is refused with ALREADY_EXISTS rather than fencing the first out.

EndRequest is the gateway's alone (DESIGN §2 step 13): every request that began ends here,
finished, failed or cancelled, with the last request generation it began; workers only
publish states (the decode worker, recall successors).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.gateway.detokenize import IncrementalDetokenizer
from services.gateway.discovery import Endpoint, WorkerPool
from services.gateway.errors import RequestInFlight, WorkerFailed, relay
from services.gateway.policies import ManifestResolver
from services.gateway.summary import Route, TokenClock, build_summary
from services.gateway.validation import GenerationInput
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import PolicyClient, PolicyError
from services.policy.client import backoff_delay
from services.rpc.errors import ServiceError, Unavailable, error_detail
from services.rpc.kvrelay.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.telemetry import metrics
from services.transfer.codec import sampling_to_proto

log = logging.getLogger(__name__)

PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
# A prefill call that failed with one of these may succeed on other workers.
_PREFILL_RETRYABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
})
# Asked after each token event; True ends the stream early (a stop string matched).
StopRequested = Callable[[], bool]
# Backoff before asking a busy prefill worker again (full jitter, doubling up to the cap).
_BUSY_BACKOFF_S = (0.05, 1.0)


@dataclass(frozen=True)
class Deadlines:
    """Seconds each step may take: the whole prefill call (prefill, publish, transfer), the
    decode worker's first event (its verification comes first), each later event, each
    policy service call, and the wait for workers with room (all waits of a request together)."""

    prefill_s: float
    first_event_s: float
    event_s: float
    policy_s: float
    admission_s: float = 120.0


class Orchestrator:
    """Runs `generate` for the servicer; owns no connections (the pools and client do)."""

    def __init__(
        self,
        policy: PolicyClient,
        resolver: ManifestResolver,
        prefill: WorkerPool,
        decode: WorkerPool,
        decode_text: Callable[[Sequence[int]], str],
        deadlines: Deadlines,
        max_retries: int,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self.resolver = resolver
        self.prefill = prefill
        self.decode = decode
        self.decode_text = decode_text
        self.deadlines = deadlines
        self.max_retries = max_retries
        self._rng = rng or random.Random()
        self._background: set[asyncio.Task[None]] = set()
        self._in_flight: set[str] = set()

    async def generate(
        self,
        request: GenerationInput,
        time_remaining_s: float | None = None,
        stop_requested: StopRequested | None = None,
    ) -> AsyncGenerator[gateway_pb2.GenerateEvent, None]:
        """Token events, then one summary. Raises a ServiceError (mapped at the edge).
        `time_remaining_s` is the client's deadline, if it set one: no wait outlasts it.
        `stop_requested`, asked after each token event, ends the stream early when True."""
        if request.request_id in self._in_flight:
            raise RequestInFlight(f"request {request.request_id} is still streaming on this gateway; "
                                  "choose a new request_id", field="request_id")
        self._in_flight.add(request.request_id)
        try:
            wait_s = self.deadlines.admission_s
            if time_remaining_s is not None:
                wait_s = min(wait_s, time_remaining_s)
            async for event in self._generate(request, time.monotonic() + wait_s, stop_requested):
                yield event
        finally:
            self._in_flight.discard(request.request_id)

    async def _generate(
        self, request: GenerationInput, admit_by: float, stop_requested: StopRequested | None
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        clock = TokenClock()
        manifest = await self.resolver.resolve(request.manifest)
        avoid_prefill: frozenset[str] = frozenset()
        avoid_decode: frozenset[str] = frozenset()
        generation = failures = busy_rounds = 0
        try:
            while True:
                fence = await self.policy.begin_request(request.request_id, timeout_s=self.deadlines.policy_s)
                generation = fence.request_generation
                try:
                    async for event in self._attempt(request, manifest, generation, clock, avoid_prefill,
                                                     avoid_decode, admit_by, stop_requested):
                        yield event
                    return
                except WorkerFailed as failure:
                    avoid_prefill |= {failure.prefill} - {""}
                    avoid_decode |= {failure.decode} - {""}
                    if failure.busy:
                        await self._back_off(failure, admit_by, busy_rounds)
                        busy_rounds += 1
                        continue
                    if failures >= self.max_retries:
                        raise failure.error from failure
                    failures += 1
                    log.warning("request %s (g_r %d) failed before its first token, retrying: %s",
                                request.request_id, generation, failure)
                    metrics.GATEWAY_RETRIES.inc()
        finally:
            if generation:
                self._end_later(request.request_id, generation)

    async def _back_off(self, failure: WorkerFailed, admit_by: float, rounds: int) -> None:
        """Wait before asking again after a worker said it had no room; its error once the
        admission deadline leaves no time to ask again."""
        left = _left(admit_by)
        if left <= 0:
            raise failure.error from failure
        await asyncio.sleep(min(left, backoff_delay(rounds, *_BUSY_BACKOFF_S, self._rng)))

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let pending EndRequest calls finish (bounded)."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)

    async def _attempt(
        self,
        request: GenerationInput,
        manifest: KVVisibilityPolicyManifest,
        generation: int,
        clock: TokenClock,
        avoid_prefill: frozenset[str],
        avoid_decode: frozenset[str],
        admit_by: float,
        stop_requested: StopRequested | None = None,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        async with self.decode.lease(avoid_decode, _left(admit_by)) as decode:
            async with self.prefill.lease(avoid_prefill, _left(admit_by)) as prefill:
                prefilled = await self._prefill(request, manifest, generation, prefill, decode)
            route = Route(request.request_id, manifest.sha256, len(request.prompt_ids), prefill.address, decode.address)
            async for event in self._stream(request, generation, prefilled, route, decode, clock, stop_requested):
                yield event

    async def _prefill(
        self,
        request: GenerationInput,
        manifest: KVVisibilityPolicyManifest,
        generation: int,
        prefill: Endpoint,
        decode: Endpoint,
    ) -> prefill_pb2.PrefillResponse:
        message = prefill_pb2.PrefillRequest(
            request_id=request.request_id,
            request_generation=generation,
            prompt_token_ids=request.prompt_ids,
            sampling=sampling_to_proto(request.sampling, request.max_tokens),
            manifest_sha256=manifest.sha256,
            decode_worker_address=decode.address,
            decode_worker_id=decode.address,
        )
        call = prefill_pb2_grpc.PrefillWorkerStub(prefill.channel).Prefill(message, timeout=self.deadlines.prefill_s)
        try:
            response: prefill_pb2.PrefillResponse = await call
            return response
        except grpc.aio.AioRpcError as exc:
            raise self._prefill_failed(exc, prefill, decode) from exc
        finally:
            call.cancel()  # a no-op once answered; carries a client cancel to the prefill worker

    def _prefill_failed(self, exc: grpc.aio.AioRpcError, prefill: Endpoint, decode: Endpoint) -> Exception:
        error = relay(exc, f"prefill worker {prefill.address}")
        if exc.code() not in _PREFILL_RETRYABLE:
            return error
        detail = error_detail(exc)
        if detail is None:  # the prefill worker itself is unreachable or did not answer in time
            self.prefill.mark_failed(prefill.address)
            return WorkerFailed(error, prefill=prefill.address, decode=decode.address)
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its own queue is full
            return WorkerFailed(error, prefill=prefill.address, busy=True)
        if detail.reason == common_pb2.ERROR_REASON_TRANSFER_FAILED:
            self.decode.mark_failed(decode.address)
        return WorkerFailed(error, decode=decode.address)

    async def _stream(
        self,
        request: GenerationInput,
        generation: int,
        prefilled: prefill_pb2.PrefillResponse,
        route: Route,
        decode: Endpoint,
        clock: TokenClock,
        stop_requested: StopRequested | None = None,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        message = decode_pb2.StreamTokensRequest(
            request_id=request.request_id, request_generation=generation, transfer_id=prefilled.transfer.transfer_id
        )
        call = decode_pb2_grpc.DecodeWorkerStub(decode.channel).StreamTokens(message)
        detokenizer = IncrementalDetokenizer(self.decode_text) if request.detokenize else None
        summarized = False
        try:
            while True:
                timeout = self.deadlines.event_s if clock.tokens else self.deadlines.first_event_s
                event = await self._read(call, timeout, decode, clock)
                if event.HasField("summary"):
                    summarized = True
                    yield gateway_pb2.GenerateEvent(summary=build_summary(route, prefilled, event.summary, clock))
                    return
                clock.token()
                yield gateway_pb2.GenerateEvent(token=_forward(event.token, detokenizer))
                if stop_requested is not None and stop_requested():
                    stopped = decode_pb2.DecodeSummary(finish_reason=common_pb2.FINISH_REASON_STOP)
                    yield gateway_pb2.GenerateEvent(summary=build_summary(route, prefilled, stopped, clock))
                    return
        finally:
            if summarized:
                self._settle_later(call)
            else:
                call.cancel()  # frees the decode worker's KV on a client cancel or an early stop

    async def _read(
        self, call: grpc.aio.UnaryStreamCall, timeout_s: float, decode: Endpoint, clock: TokenClock
    ) -> decode_pb2.DecodeEvent:
        where = f"decode worker {decode.address}"
        error: ServiceError
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                event = await call.read()
        except TimeoutError:  # e.g. a stopped worker: skip it until it answers a health check
            which = "token" if clock.tokens else "first event"
            error = Unavailable(f"{where}: no {which} within {timeout_s:g} s")
            self.decode.mark_failed(decode.address)
        except grpc.aio.AioRpcError as exc:
            error = relay(exc, where)
            if error_detail(exc) is None:
                self.decode.mark_failed(decode.address)
        else:
            if event is not grpc.aio.EOF:
                return event
            error = Unavailable(f"{where}: stream ended without a summary")
        if clock.tokens == 0 and error.code != grpc.StatusCode.INVALID_ARGUMENT:
            raise WorkerFailed(error, decode=decode.address)
        raise error

    def _end_later(self, request_id: str, generation: int) -> None:
        """EndRequest in the background (the one call of it): it marks the request done and
        fences out whatever a failed or cancelled attempt left behind."""
        self._in_background(self._end(request_id, generation))

    def _settle_later(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Let a summarized decode stream end on its own, in the background, so the client has
        its summary at once. The summary is not the end of the call: its OK status follows, and
        a cancel sent in between raced the worker's last write, which then counted a finished
        decode as CANCELLED. A worker that never ends the stream is cancelled at the event
        deadline."""
        self._in_background(self._settle(call, self.deadlines.event_s))

    @staticmethod
    async def _settle(call: grpc.aio.UnaryStreamCall, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await call.code()
        except TimeoutError:
            log.warning("decode stream still open %g s after its summary; cancelling it", timeout_s)
        finally:
            call.cancel()  # a no-op once the call has ended

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _end(self, request_id: str, generation: int) -> None:
        with contextlib.suppress(PolicyError):
            await self.policy.end_request(request_id, generation, timeout_s=self.deadlines.policy_s)


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def _forward(token: common_pb2.TokenEvent, detokenizer: IncrementalDetokenizer | None) -> common_pb2.TokenEvent:
    text = detokenizer.feed(token.token_id) if detokenizer is not None else ""
    return common_pb2.TokenEvent(token_id=token.token_id, text=text, index=token.index, logprob=token.logprob)
