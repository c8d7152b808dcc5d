"""The prefill pipeline: forward → score → allocate → select → pack → offload → publish → send.

The first five stages are functions over the model runtime and the pure kvpolicy core
(blocking torch work, which `PrefillPipeline` runs on its compute threads, never on the
event loop). `publish` is the compare-and-publish of state 1 (parent 0) in the policy
service; `send` hands the packed view to the decode worker (`prefill_worker.handoff`).
Each stage is one call and one span (DESIGN §8 names them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch

from prefill_worker.errors import HeadProfileUnavailable
from prefill_worker.handoff import Handoff
from prefill_worker.offload import NOT_OFFLOADED, Offloaded, OffloadTier, offload_plan
from prefill_worker.wire import PrefillCall
from services.evaluation.profile import PROFILE_FILE, HeadProfile
from services.kvpolicy import allocation, packing, snapkv
from services.kvpolicy.allocation import BudgetGrid
from services.kvpolicy.ledger import Ledger, ledger_for
from services.kvpolicy.manifest import AllocationMethod, KVVisibilityPolicyManifest, SelectionMethod
from services.kvpolicy.packing import PackedKVView
from services.kvpolicy.receipt import Receipt, make_receipt
from services.kvpolicy.state import KVPolicyState, PositionGrid
from services.kvpolicy.static import static_protected_positions, static_selection
from services.model import LoadedModel, PrefillOptions, PrefillResult, sample
from services.model import prefill as model_prefill
from services.policy import Fence, Phase, PolicyClient, StaleGeneration, StatePublication
from services.telemetry import metrics
from services.telemetry.spans import span
from services.transfer import Deadline

# The first published state of a request: successor of the empty state 0, holding the
# prompt's cache image (cache generation 1); decode-side appends advance it from there.
FIRST_STATE_GENERATION = 1
FIRST_CACHE_GENERATION = 1

Result = TypeVar("Result")


@dataclass(frozen=True)
class PrefillJob:
    """A validated call plus the manifest it names."""

    call: PrefillCall
    manifest: KVVisibilityPolicyManifest


@dataclass(frozen=True)
class Forward:
    """The prompt forward and the first output token, sampled from its last logits."""

    result: PrefillResult
    first_token: int

    @property
    def prompt_len(self) -> int:
        return self.result.prompt_length


@dataclass(frozen=True)
class Selection:
    """Retained positions `[L][H_owner]`, the protected positions every owner keeps, and the
    prefix budgets they were selected under (None for static policies)."""

    positions: PositionGrid
    protected: tuple[int, ...]
    budgets: BudgetGrid | None


@dataclass(frozen=True)
class Packed:
    """The packed view and everything bound to it: the state it realizes, its receipt, its ledger,
    and where its omitted rows went (`offload`: what travels besides the view, or nothing)."""

    view: PackedKVView
    state: KVPolicyState
    receipt: Receipt
    ledger: Ledger
    offload: Offloaded = NOT_OFFLOADED


@dataclass(frozen=True)
class PrefillOutcome:
    """What a Prefill call returns. `prefill_ms` is the wall time of the stages, forward
    through send (not the wait for a slot)."""

    packed: Packed
    first_token: int
    handoff: Handoff
    fence: Fence
    prefill_ms: float


def observation_window(manifest: KVVisibilityPolicyManifest) -> int:
    """W_obs the manifest scores with (0 for static policies: nothing to capture)."""
    params = manifest.selection.snapkv
    return params.observation_window if params is not None else 0


def uses_scores(manifest: KVVisibilityPolicyManifest) -> bool:
    return manifest.selection.method is SelectionMethod.SNAPKV


def forward(model: LoadedModel, job: PrefillJob, chunk_size: int) -> Forward:
    """Full prompt forward with observation capture, then sample output token 0."""
    options = PrefillOptions(chunk_size=chunk_size, obs_window=observation_window(job.manifest))
    result = model_prefill(model.model, job.call.prompt_ids, options)
    first = sample(result.logits[None], [job.call.sampling], [0])  # [1]
    return Forward(result, int(first[0]))


def score(manifest: KVVisibilityPolicyManifest, fwd: Forward) -> torch.Tensor | None:
    """SnapKV owner scores `[L, H_owner, T - W_obs]`; None for static policies."""
    if not uses_scores(manifest):
        return None
    return snapkv.score(manifest, fwd.result.observation, fwd.prompt_len)


def allocate(
    manifest: KVVisibilityPolicyManifest,
    prompt_len: int,
    scores: torch.Tensor | None,
    profile: HeadProfile | None = None,
) -> BudgetGrid | None:
    """Integer prefix budgets `[L][H_owner]`, exactly conserved; None for static policies.
    `profile` is the HeadKV profile beside the served checkpoint (if any)."""
    if scores is None:
        return None
    return allocation.allocate(manifest, prompt_len, scores, head_profile(manifest, profile))


def head_profile(
    manifest: KVVisibilityPolicyManifest, profile: HeadProfile | None
) -> torch.Tensor | None:
    """The importance tensor `[L, H_owner]` a HeadKV manifest names by digest; None for other
    allocation methods. HeadProfileUnavailable when the checkpoint carries no such profile."""
    spec = manifest.selection.allocation
    wanted = spec.headkv_profile_sha256 if spec is not None else None
    if spec is None or spec.method is not AllocationMethod.HEADKV or wanted is None:
        return None
    tensor = profile.tensor_for(wanted) if profile is not None else None
    if tensor is None:
        found = f"its profile is {profile.sha256}" if profile else f"it has no {PROFILE_FILE}"
        raise HeadProfileUnavailable(
            f"the served checkpoint has no profile {wanted} ({found})",
            field="selection.allocation.headkv_profile_sha256",
        )
    return tensor


def select(
    manifest: KVVisibilityPolicyManifest,
    prompt_len: int,
    scores: torch.Tensor | None,
    budgets: BudgetGrid | None,
) -> Selection:
    """SnapKV top-budget rows plus protected sinks and observation suffix, or the static set."""
    if scores is None or budgets is None:
        return Selection(
            static_selection(manifest, prompt_len),
            static_protected_positions(manifest.selection, prompt_len),
            None,
        )
    return Selection(
        snapkv.select(manifest, scores, budgets, prompt_len),
        snapkv.protected_positions(manifest, prompt_len),
        budgets,
    )


def pack(job: PrefillJob, fwd: Forward, selection: Selection) -> Packed:
    """Gather the retained rows, bind them to state 1 with a receipt, and account the bytes."""
    manifest = job.manifest
    owner_map = manifest.owner_to_kv_head() if manifest.owners_are_query_heads else None
    view = packing.pack(fwd.result.source_k, fwd.result.source_v, selection.positions, owner_map)
    state = KVPolicyState(
        request_id=job.call.request_id,
        manifest_sha256=manifest.sha256,
        request_generation=job.call.request_generation,
        state_generation=FIRST_STATE_GENERATION,
        parent_state_generation=FIRST_STATE_GENERATION - 1,
        cache_generation=FIRST_CACHE_GENERATION,
        frontier=fwd.prompt_len,
        selected_positions=selection.positions,
        protected_positions=selection.protected,
    )
    receipt = make_receipt(manifest, state, view)
    return Packed(view, state, receipt, ledger_for(manifest, fwd.prompt_len, selection.positions))


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
        """forward → score → allocate → select → pack → offload → publish → send. The send stage gets
        `transfer_timeout_s`, cut short by the caller's deadline."""
        started = time.perf_counter()
        manifest = job.manifest
        fwd = await self._blocking("prefill.forward", forward, self.model, job, self._chunk_size)
        scores = await self._blocking("kv.score", score, manifest, fwd)
        budgets = await self._blocking(
            "kv.allocate", allocate, manifest, fwd.prompt_len, scores, self.profile
        )
        selection = await self._blocking("kv.select", select, manifest, fwd.prompt_len, scores, budgets)
        packed = await self._blocking("kv.pack", pack, job, fwd, selection)
        packed = await self._offload(job, fwd, selection, packed)
        count_rows(manifest.name, packed.ledger)
        with span("policy.publish", **state_attributes(job, packed)), self._timed("policy.publish"):
            fence = await publish(self._policy, job, packed, self._worker_id)
        with span("transfer.send", **send_attributes(job, packed)) as current, self._timed("transfer.send"):
            handoff = await self._sender.send(job.call, fwd.first_token, packed, self._send_deadline(call_deadline))
            current.set_attributes({"bytes_moved": handoff.bytes_moved, "reserved_bytes": handoff.reserved_bytes,
                                    "transfer_id": handoff.descriptor.transfer_id})
        elapsed_ms = (time.perf_counter() - started) * 1000
        return PrefillOutcome(packed, fwd.first_token, handoff, fence, elapsed_ms)

    def close(self) -> None:
        self._compute.shutdown(wait=False, cancel_futures=True)

    async def _offload(self, job: PrefillJob, fwd: Forward, selection: Selection, packed: Packed) -> Packed:
        """Omitted rows → offload tier with their page summaries; the ledger charges what travels."""
        result = fwd.result
        mode = job.manifest.recoverability.mode.value
        with span("kv.offload", request_id=job.call.request_id, mode=mode) as current, self._timed("kv.offload"):
            loop = asyncio.get_running_loop()
            plan = await loop.run_in_executor(self._compute, functools.partial(
                offload_plan, job.manifest, result.source_k, result.source_v, selection.positions))
            held = self.offload.hold(job.call, plan, packed.state.state_generation)
            current.set_attributes({"travels": held.mode.value, "degraded": held.degraded,
                                    "page_summary_bytes": held.sidecar.summaries.nbytes if held.sidecar else 0})
        return replace(packed, ledger=held.ledger(packed.ledger), offload=held)

    async def _blocking(self, name: str, stage: Callable[..., Result], *args: object) -> Result:
        with span(name), self._timed(name):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._compute, functools.partial(stage, *args))

    @staticmethod
    def _timed(stage: str) -> contextlib.AbstractContextManager[None]:
        return metrics.timed(metrics.PREFILL_STAGE.labels(stage))

    def _send_deadline(self, call_deadline: Deadline | None) -> Deadline:
        budget = self._transfer_timeout_s
        if call_deadline is not None:
            budget = min(budget, call_deadline.remaining())
        return Deadline.after(budget)
