"""Receive: the view and its sidecar arrive over the pair group, by the transfer's deadline.

One `transfer.recv` span (child of the prefill worker's transfer.send) covers the wait for
every layer of the packed view and then for the sidecar (page summaries, and host-tier rows
for recallable_local). The waits block, so they run on worker threads; a receive that fails
or runs out of time raises the transfer layer's `TransferError`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass

from decode_worker.accept import Accepted
from services.kvpolicy.packing import PackedKVView
from services.telemetry import metrics
from services.telemetry.spans import span
from services.transfer import Sidecar


@dataclass(frozen=True)
class Received:
    """What arrived: the packed view, its sidecar (recallable manifests), and the bytes moved."""

    view: PackedKVView
    sidecar: Sidecar | None
    bytes_moved: int


async def receive(accepted: Accepted, executor: Executor) -> Received:
    """Wait for the view, then the sidecar, on `executor` threads (deadline: the transfer's)."""
    recv, deadline = accepted.recv, accepted.deadline
    loop = asyncio.get_running_loop()
    attributes = accepted.span_attributes()
    nbytes = accepted.handoff.descriptor.nbytes
    with span("transfer.recv", accepted.trace_parent, **attributes, bytes=nbytes) as current:
        with metrics.timed(metrics.TRANSFER_SECONDS.labels("recv")):
            view = await loop.run_in_executor(executor, recv.wait_for_view, deadline)
            sidecar = await loop.run_in_executor(executor, recv.wait_for_sidecar, deadline)
        current.set_attribute("bytes_moved", recv.bytes_moved)
    metrics.TRANSFER_BYTES.labels("recv").inc(recv.bytes_moved)
    return Received(view, sidecar, recv.bytes_moved)
