"""Stream: StreamTokens of one accepted transfer.

    open_stream     the transfer the request names, for its request generation, once
    stream_events   wait until it is verified (failed: its typed error: FAILED_PRECONDITION
                    for a rejected or stale view, UNAVAILABLE for a transfer that did not
                    complete), then token 0 (sampled by the prefill worker, from the
                    handoff), every decoded token, and one summary

A decode that fails ends the stream with its error (`failure`): INTERNAL naming the request
when its own logits were not finite, UNAVAILABLE when the loop dropped it; tokens already
streamed stay valid. Ending the request at the policy service is the gateway's (DESIGN §2 step 13).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from decode_worker.admit import Decoding
from decode_worker.errors import (
    CapacityExhausted,
    DuplicateTransfer,
    NonFiniteDecode,
    RecallAborted,
    StaleTransfer,
    TransferFailed,
    UnknownTransfer,
)
from decode_worker.lifecycle import Transfer, TransferState, TransferTable
from decode_worker.retention import RetentionLedger
from decode_worker.scheduler import (
    FINISH_CANCELLED,
    DecodeEvent,
    DecodeFailed,
    DecodeFinished,
    TokenOut,
)
from services.model.sampler import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from services.rpc.errors import ServiceError
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.telemetry import metrics
from services.transfer.codec import generations_to_proto, ledger_to_proto

_FINISH_REASONS = {
    FINISH_EOS: common_pb2.FINISH_REASON_STOP,
    FINISH_STOP: common_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FINISH_CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


class DecodeAborted(TransferFailed):
    """The decode loop dropped the request after it started (e.g. the worker is stopping)."""


def open_stream(transfers: TransferTable, request: decode_pb2.StreamTokensRequest) -> Transfer:
    """The accepted transfer `request` names; NOT_FOUND, FAILED_PRECONDITION (another request
    generation) or ALREADY_EXISTS (a stream is open) otherwise."""
    transfer = transfers.get(request.transfer_id)
    if transfer is None or transfer.accepted.request_id != request.request_id:
        raise UnknownTransfer(
            f"no accepted transfer {request.transfer_id!r} for request {request.request_id!r}",
            field="transfer_id",
        )
    generation = transfer.accepted.request_generation
    if request.request_generation != generation:
        metrics.STALE_REJECTIONS.labels("decode").inc()
        carries = f"transfer carries request generation {generation}"
        raise StaleTransfer(carries, field="request_generation")
    if transfer.stream_open:
        raise DuplicateTransfer("a stream is already open for this transfer", field="transfer_id")
    transfer.stream_open = True
    return transfer


async def stream_events(
    transfer: Transfer, *, policy_timeout_s: float, event_timeout_s: float
) -> AsyncIterator[decode_pb2.DecodeEvent]:
    """Token 0 once verified, every decoded token, then the summary; a failure raises."""
    decoding = await _wait_verified(transfer, policy_timeout_s)
    first = common_pb2.TokenEvent(token_id=transfer.accepted.handoff.first_token_id, index=0)
    yield decode_pb2.DecodeEvent(token=first)
    while True:
        event = await _next_event(decoding, event_timeout_s)
        if isinstance(event, TokenOut):
            token = common_pb2.TokenEvent(
                token_id=event.token_id, index=event.index, logprob=event.logprob
            )
            yield decode_pb2.DecodeEvent(token=token)
        elif isinstance(event, DecodeFinished):
            yield decode_pb2.DecodeEvent(summary=summary(transfer, event))
            return
        else:
            raise failure(decoding, event)


def summary(transfer: Transfer, finished: DecodeFinished) -> decode_pb2.DecodeSummary:
    """The summary of a finished decode: the generations of the last state (the verified
    receipt, or the last recall or retention successor) and the decode's cache generation, the ledger
    with the bytes moved and recalled, recall counts and the fallbacks taken."""
    handoff, receipt = transfer.accepted.handoff, transfer.verified.receipt
    decoding = transfer.decoding
    recall = decoding.recall if decoding is not None else None
    published = recall.publisher.published if recall is not None else []
    retention = decoding.retention if decoding is not None else None
    last = published[-1] if published else receipt
    if retention is not None and retention.publications:
        last = retention.published
    ledger = ledger_to_proto(handoff.ledger, bytes_moved=transfer.received.bytes_moved,
                             recalled_bytes=finished.recalled_bytes)
    degraded = (handoff.offload.degraded,) if handoff.offload.degraded else ()
    return decode_pb2.DecodeSummary(
        output_tokens=finished.output_tokens,
        tpot_ms=finished.tpot_ms,
        finish_reason=_FINISH_REASONS[finished.reason],
        generations=generations_to_proto(last, cache_generation=finished.cache_generation),
        ledger=ledger,
        recalled_rows=finished.recalled_rows,
        recall_count=finished.recall_count,
        fallbacks=[*degraded, *finished.fallbacks],
        verified_receipt_digest=receipt.digest,
        retained_rows=handoff.descriptor.layout.total_rows,
        retention=None if finished.retention is None else retention_to_proto(finished.retention),
    )


def retention_to_proto(ledger: RetentionLedger) -> common_pb2.RetentionSummary:
    """A retaining request's `RetentionLedger` as the summary's `retention`."""
    return common_pb2.RetentionSummary(**dataclasses.asdict(ledger))


def failure(decoding: Decoding, failed: DecodeFailed) -> ServiceError:
    """The error a failed decode ends its stream with: its own logits were not finite
    (NonFiniteDecode, INTERNAL), the KV page budget had no page for it (CapacityExhausted,
    RESOURCE_EXHAUSTED), a recall that could not bring rows back under `fail_request`
    (RecallAborted), a recall whose successor state the fence refused (StaleTransfer), or
    anything else (DecodeAborted)."""
    if failed.non_finite:
        return NonFiniteDecode(failed.message, field="logits")
    if failed.exhausted:
        return CapacityExhausted(failed.message, field="kv_budget_bytes")
    outcome = failed.recall
    if outcome is None:
        return DecodeAborted(failed.message)
    rejected = decoding.recall.publisher.rejected if decoding.recall is not None else None
    if rejected is not None and not outcome.timed_out:
        current = rejected.current
        return StaleTransfer(f"recall: {rejected}", field="state_generation", current=current)
    what = "timed out" if outcome.timed_out else "could not bring its rows back"
    message = f"recall of {len(outcome.pages)} pages {what}: {outcome.reason}"
    return RecallAborted(message, field="recall")


async def _wait_verified(transfer: Transfer, policy_timeout_s: float) -> Decoding:
    """The transfer's decoding once verified; its failure if it was rejected or abandoned."""
    timeout = transfer.accepted.deadline.remaining() + 2 * policy_timeout_s
    try:
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow a cancel
            await transfer.settled()
    except TimeoutError:
        raise TransferFailed(f"not verified within {timeout:.1f} s", field="transfer") from None
    decoding = transfer.decoding
    if decoding is None:
        assert transfer.state is TransferState.FAILED and transfer.failure is not None
        raise transfer.failure
    return decoding


async def _next_event(decoding: Decoding, timeout_s: float) -> DecodeEvent:
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
            return await decoding.events.get()
    except TimeoutError:
        raise DecodeAborted(f"no token for {timeout_s} s", field="decode") from None
