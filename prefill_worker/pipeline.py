"""The prefill pipeline, as its table of contents:

    forward   the prompt through the model, output token 0 sampled   (services.model)
    compress  score → allocate → select → pack                       (services.kvpolicy.compress)
    offload   omitted rows → offload tier, with page summaries        (prefill_worker.offload)
    publish   compare-and-publish of state 1 (parent 0)              (the policy service)
    send      the packed view to the decode worker                   (prefill_worker.handoff)

Forward, compress and the offload plan are blocking torch work, which `PrefillPipeline` runs on
its compute threads, never on the event loop. Each stage is one span (DESIGN §8 names them;
compress opens one per inner stage).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from opentelemetry import trace

from prefill_worker.handoff import Handoff
from prefill_worker.offload import OffloadTier, Packed
from prefill_worker.wire import PrefillCall
from services.kvpolicy.compress import Compressed, StateIdentity, compress, observation_window
from services.kvpolicy.head_profile import HeadProfile, profile_tensor
from services.kvpolicy.ledger import Ledger
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.model import LoadedModel, PrefillOptions, PromptForward, forward_prompt
from services.offload.plan import offload_plan
from services.policy import Fence, Phase, PolicyClient, StaleGeneration, StatePublication
from services.telemetry import metrics
from services.telemetry.spans import span
from services.transfer import Deadline

Result = TypeVar("Result")


@dataclass(frozen=True)
class PrefillJob:
    """A validated call plus the manifest it names."""

    call: PrefillCall
    manifest: KVVisibilityPolicyManifest

    @property
    def identity(self) -> StateIdentity:
        return StateIdentity(self.call.request_id, self.call.request_generation)


@dataclass(frozen=True)
class PrefillOutcome:
    """What a Prefill call returns. `prefill_ms` is the wall time of the stages, forward
    through send (not the wait for a slot)."""

    packed: Packed
    first_token: int
    handoff: Handoff
    fence: Fence
    prefill_ms: float


def forward(model: LoadedModel, job: PrefillJob, chunk_size: int) -> PromptForward:
    """Full prompt forward, capturing the observation window the manifest scores with (its
    vote only: the window's rows themselves are never held)."""
    options = PrefillOptions(
        chunk_size=chunk_size, obs_window=observation_window(job.manifest), keep_observation=False
    )
    return forward_prompt(model.model, job.call.prompt_ids, job.call.sampling, options)


async def publish(policy: PolicyClient, job: PrefillJob, packed: Packed, worker_id: str) -> Fence:
    """Compare-and-publish the state; StaleGeneration (FAILED_PRECONDITION) if the request has
    moved on, and then nothing is sent."""
    state = packed.state
    publication = StatePublication(
        request_id=state.request_id,
        request_generation=state.request_generation,
        parent_state_generation=state.parent_state_generation,
        state_generation=state.state_generation,
        cache_generation=state.cache_generation,
        receipt_digest=packed.receipt.digest,
        manifest_sha256=state.manifest_sha256,
        phase=Phase.PREFILLED,
        prefill_worker=worker_id,
        decode_worker=job.call.decode.worker_id,
    )
    try:
        return (await policy.publish_state(publication)).fence
    except StaleGeneration:
        metrics.STALE_REJECTIONS.labels("prefill").inc()
        raise


def state_attributes(job: PrefillJob, packed: Packed) -> dict[str, object]:
    """Span attributes of the published state: generations, manifest, receipt, rows."""
    state, ledger = packed.state, packed.ledger
    return {
        "request_id": state.request_id,
        "request_generation": state.request_generation,
        "state_generation": state.state_generation,
        "parent_state_generation": state.parent_state_generation,
        "cache_generation": state.cache_generation,
        "manifest_sha256": state.manifest_sha256,
        "manifest_name": job.manifest.name,
        "receipt_digest": packed.receipt.digest,
        "retained_rows": ledger.visible_rows,
        "omitted_rows": ledger.omitted_rows,
        "retained_bytes": ledger.visible_payload_bytes,
        "omitted_bytes": ledger.omitted_payload_bytes,
    }


def send_attributes(job: PrefillJob, packed: Packed) -> dict[str, object]:
    """Span attributes of the send stage (the bytes it must move, by the ledger)."""
    return {
        "request_id": job.call.request_id,
        "request_generation": job.call.request_generation,
        "state_generation": packed.state.state_generation,
        "decode_worker": job.call.decode.worker_id,
        "bytes": packed.ledger.traffic_bytes,
    }


def count_rows(policy: str, ledger: Ledger) -> None:
    """Retained and omitted rows and payload bytes, per policy name."""
    metrics.KV_ROWS.labels(policy, "retained").inc(ledger.visible_rows)
    metrics.KV_ROWS.labels(policy, "omitted").inc(ledger.omitted_rows)
    metrics.KV_BYTES.labels(policy, "retained").inc(ledger.visible_payload_bytes)
    metrics.KV_BYTES.labels(policy, "omitted").inc(ledger.omitted_payload_bytes)


class Sender(Protocol):
    """The send stage (`prefill_worker.handoff.DecodeHandoff`)."""

    async def send(self, call: PrefillCall, first_token: int, packed: Packed, deadline: Deadline) -> Handoff: ...


class PrefillPipeline:
    """Runs one job through every stage. Blocking stages run on `max_in_flight` compute
    threads of their own, so the event loop keeps serving other calls. `profile`: the HeadKV
    profile beside the served checkpoint, if it has one. `offload`: where omitted rows of
    recallable manifests go (default: no store, so recallable_remote is never admitted)."""

    def __init__(
        self,
        model: LoadedModel,
        policy: PolicyClient,
        sender: Sender,
        *,
        worker_id: str,
        chunk_size: int = 512,
        transfer_timeout_s: float = 30.0,
        compute_threads: int = 1,
        profile: HeadProfile | None = None,
        offload: OffloadTier | None = None,
    ) -> None:
        self.model = model
        self.profile = profile
        self.offload = offload or OffloadTier(None)
        self._policy = policy
        self._sender = sender
        self._worker_id = worker_id
        self._chunk_size = chunk_size
        self._transfer_timeout_s = transfer_timeout_s
        self._compute = ThreadPoolExecutor(compute_threads, thread_name_prefix="prefill-compute")

    async def run(self, job: PrefillJob, call_deadline: Deadline | None = None) -> PrefillOutcome:
        """forward → compress → offload → publish → send. The send stage gets
        `transfer_timeout_s`, cut short by the caller's deadline."""
        started = time.perf_counter()
        with self._stage("prefill.forward"):
            fwd = await self._compute_on_thread(forward, self.model, job, self._chunk_size)
        compressed = await self._compute_on_thread(self._compress, job, fwd)
        packed = await self._offload(job, fwd, compressed)
        count_rows(job.manifest.name, packed.ledger)
        with self._stage("policy.publish", **state_attributes(job, packed)):
            fence = await publish(self._policy, job, packed, self._worker_id)
        with self._stage("transfer.send", **send_attributes(job, packed)) as current:
            handoff = await self._sender.send(job.call, fwd.first_token, packed, self._send_deadline(call_deadline))
            current.set_attributes({"bytes_moved": handoff.bytes_moved, "reserved_bytes": handoff.reserved_bytes,
                                    "transfer_id": handoff.descriptor.transfer_id})
        elapsed_ms = (time.perf_counter() - started) * 1000
        return PrefillOutcome(packed, fwd.first_token, handoff, fence, elapsed_ms)

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)

    def _compress(self, job: PrefillJob, fwd: PromptForward) -> Compressed:
        """The compression core on a compute thread, each inner stage in its own span."""
        profile = profile_tensor(job.manifest, self.profile)
        return compress(job.manifest, fwd.result, job.identity, profile=profile, observe=self._stage)

    async def _offload(self, job: PrefillJob, fwd: PromptForward, compressed: Compressed) -> Packed:
        """Omitted rows → offload tier with their page summaries; the ledger charges what travels."""
        result, positions = fwd.result, compressed.selection.positions
        with self._stage("kv.offload", request_id=job.call.request_id,
                         mode=job.manifest.recoverability.mode.value) as current:
            plan = await self._compute_on_thread(
                offload_plan, job.manifest, result.source_k, result.source_v, positions)
            held = self.offload.hold(job.call, plan, compressed.state.state_generation)
            current.set_attributes({"travels": held.mode.value, "degraded": held.degraded,
                                    "page_summary_bytes": held.sidecar.summaries.nbytes if held.sidecar else 0})
        return Packed.of(compressed, held)

    async def _compute_on_thread(self, stage: Callable[..., Result], *args: object) -> Result:
        """Run a blocking stage on a compute thread, in this task's context (its spans nest
        under the request's)."""
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        return await loop.run_in_executor(self._compute, functools.partial(context.run, stage, *args))

    @staticmethod
    @contextlib.contextmanager
    def _stage(name: str, **attributes: object) -> Iterator[trace.Span]:
        """One stage: a span and the stage-latency histogram."""
        with span(name, **attributes) as current, metrics.timed(metrics.PREFILL_STAGE.labels(name)):
            yield current

    def _send_deadline(self, call_deadline: Deadline | None) -> Deadline:
        budget = self._transfer_timeout_s
        if call_deadline is not None:
            budget = min(budget, call_deadline.remaining())
        return Deadline.after(budget)
