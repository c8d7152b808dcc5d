"""Admit: a verified transfer joins the continuous-batching decode loop (scheduler.py).

The view, token 0 and its sampling, the reservation (the decode loop releases it from now
on), the recall session of a recallable manifest, the retention session of a manifest that
retains at decode (decode_worker/retention.py) and the request's trace become one
`DecodeRequest`; what the transfer keeps is a `Decoding`: where the loop's events arrive and
how to drop the request from the loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.accept import Accepted
from decode_worker.recall import Recall, SuccessorPublisher
from decode_worker.receive import Received
from decode_worker.retention import RetentionSession
from decode_worker.scheduler import DecodeEvent, DecodeRequest, DecodeScheduler, loop_sink
from decode_worker.verify import Verified, verified_state
from services.policy import PolicyClient
from services.policy.types import Phase
from services.telemetry import metrics


@dataclass(frozen=True)
class Decoding:
    """A transfer in the decode loop: its events in order (on the event loop), its recall
    (recallable manifests), and `cancel`, which drops it from the loop and frees its KV;
    `retention`: its decode-time retention (read once its last event arrived)."""

    events: asyncio.Queue[DecodeEvent]
    recall: Recall | None
    cancel: Callable[[], None]
    retention: RetentionSession | None = None


def admit(
    scheduler: DecodeScheduler,
    accepted: Accepted,
    received: Received,
    verified: Verified,
    recall: Recall | None,
    deliver: Callable[[DecodeEvent], None],
    retention: RetentionSession | None = None,
) -> Decoding:
    """Submit the request; every event of the loop goes to `deliver` on this event loop (via
    `call_soon_threadsafe`, so never before the caller has recorded the returned Decoding)."""
    handoff, manifest = accepted.handoff, verified.manifest
    if handoff.offload.degraded:
        metrics.RECALL_FALLBACKS.labels(handoff.offload.degraded).inc()
    request_id, generation = accepted.request_id, accepted.request_generation
    owner_map = manifest.expanded_owner_map
    scheduler.submit(
        DecodeRequest(
            request_id=request_id,
            request_generation=generation,
            recall=recall.session if recall is not None else None,
            retention=retention,
            view=received.view,
            frontier=handoff.end,
            first_token=handoff.first_token_id,
            sampling=handoff.sampling,
            max_tokens=handoff.max_tokens,
            cache_generation=handoff.descriptor.cache_generation,
            reservation=accepted.reservation,
            sink=loop_sink(asyncio.get_running_loop(), deliver),
            owner_to_kv_head=owner_map,
            trace_parent=accepted.trace_parent,
        )
    )
    cancel = functools.partial(scheduler.cancel, request_id, generation)
    return Decoding(asyncio.Queue(), recall, cancel, retention)


class RetentionOpener:
    """Opens the `RetentionSession` of verified transfers whose manifest retains at decode
    (event loop: the publisher starts its remote calls there)."""

    def __init__(self, policy: PolicyClient, *, worker_id: str, policy_timeout_s: float) -> None:
        self._policy = policy
        self._worker_id = worker_id
        self._policy_timeout_s = policy_timeout_s

    def open(self, accepted: Accepted, verified: Verified) -> RetentionSession | None:
        """The session (None without `selection.retention`). The verify stage's fit check
        (services/kvpolicy/fit.py) admitted the manifest: this runtime performs its retention."""
        contract = verified.manifest.selection.retention
        if contract is None:
            return None
        publisher = SuccessorPublisher(
            self._policy, asyncio.get_running_loop(),
            prefill_worker=accepted.handoff.descriptor.source_worker,
            decode_worker=self._worker_id, timeout_s=self._policy_timeout_s, phase=Phase.DECODING,
        )
        return RetentionSession(verified.manifest, contract, verified_state(verified.receipt),
                                on_successor=publisher)
