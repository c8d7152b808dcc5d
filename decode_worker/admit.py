"""Admit: a verified transfer joins the continuous-batching decode loop (scheduler.py).

The view, token 0 and its sampling, the reservation (the decode loop releases it from now
on), the recall session of a recallable manifest and the request's trace become one
`DecodeRequest`; what the transfer keeps is a `Decoding`: where the loop's events arrive and
how to drop the request from the loop.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from decode_worker.accept import Accepted
from decode_worker.recall import Recall
from decode_worker.receive import Received
from decode_worker.scheduler import DecodeEvent, DecodeRequest, DecodeScheduler, loop_sink
from decode_worker.verify import Verified
from services.telemetry import metrics


@dataclass(frozen=True)
class Decoding:
    """A transfer in the decode loop: its events in order (on the event loop), its recall
    (recallable manifests), and `cancel`, which drops it from the loop and frees its KV."""

    events: asyncio.Queue[DecodeEvent]
    recall: Recall | None
    cancel: Callable[[], None]


def admit(
    scheduler: DecodeScheduler,
    accepted: Accepted,
    received: Received,
    verified: Verified,
    recall: Recall | None,
    deliver: Callable[[DecodeEvent], None],
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
    return Decoding(asyncio.Queue(), recall, cancel)

