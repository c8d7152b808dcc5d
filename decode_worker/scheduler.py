"""Continuous batching: one thread steps every admitted request together, one token each.

    scheduler = DecodeScheduler(loaded, SchedulerConfig(max_batch=8, kv_budget_bytes=...))
    scheduler.start()
    reservation = scheduler.budget.reserve(reservation_bytes(layout, max_tokens, dtype), key)
    scheduler.submit(DecodeRequest(..., reservation=reservation, sink=loop_sink(loop, deliver)))
    scheduler.cancel(request_id)                              # frees its KV at the next step

Each iteration of the loop: apply cancellations → admit waiting requests while the batch has
room (`max_batch`) → one `decode_step` over every admitted request (ragged packed views share
one `DecodeCache` per owner layout) → sample each row with its own parameters → hand every
token to its request's sink → release finished requests. The first output token was sampled
by the prefill worker; the loop feeds it and emits tokens 1, 2, ... . Every step appends one
row to every owner of a request: its cache generation is the verified one plus one per step,
and the loop only reads it (`_Running.cache_generation`); a request with a recall session
reads the session's, which also counts recalls (`RecallSession.end_step` is where it advances).

Requests of recallable manifests carry a `RecallSession` (services/offload/recall.py): their
batch steps run through `decode_with_recall`, which bounds each due request's omitted mass,
fetches pages, publishes the successor state and recomputes the step. Every recall is one
`kv.recall` span in the request's trace and counted in the metrics; a fallback taken is
recorded in the request's `DecodeFinished.fallbacks`, and a recall that fails under
`fail_request` ends the request with `DecodeFailed(recall=outcome)`.

Requests whose manifest retains at decode carry a `RetentionSession` (decode_worker/
retention.py): after each step that request's evictions are decided and committed (the rows
every owner holds never exceed the budget after a step: `kvrelay_decode_retention_*`
metrics), successors are published on the manifest's cadence and at the end, and the finished
request reports a `RetentionLedger` (and one `kv.retention` span).

Requests are named by their request id in the cache (the recall engine reads a request's
slot by the id of its state). A request generation supersedes an older one of the same
request: admitting it cancels the older one; `cancel(request_id, generation)` touches only
that generation.

Each request's steps are traced in its own trace (`DecodeRequest.trace_parent`, the prefill
worker's transfer.send) as `decode.step` spans of up to `trace_steps_per_span` steps each:
trace volume grows with steps / N, not with every token of every request in the batch.

One request's numbers never fail another's: a request whose logits row is not finite (NaN or
+inf: its own KV or its own computation went wrong; every sampling value the validator admits
is safe, `services.model.sampler`) ends alone with `DecodeFailed(non_finite=True)`, which its
stream turns into `NonFiniteDecode` (INTERNAL, naming the request), while the rest of the
batch samples and goes on; an unexpected error in one batch's step fails that batch only, and
one in admitting a request fails that request only.

Memory is governed by the `KVBudget`, the ledger of the worker's one preallocated `PagePool`
(fixed-size KV pages, services/model/paged.py, sized by `kv_budget_bytes`): a transfer is
accepted only if its reservation (the view's rows plus the rows its decode can append, rounded
up to whole pages at worst, `reservation_bytes`) fits. The pages the cache allocates for the
request are charged to that same reservation, which admission trims to the exact pages its
(layer, owner) rows will need; the pages return when the request finishes, fails or is
cancelled. A request that needs a page no budget holds is refused (`KVPoolExhausted` ->
`DecodeFailed(exhausted=True)`, RESOURCE_EXHAUSTED naming kv_budget_bytes); nothing is ever
allocated past the budget. Sinks are called from the loop
thread; `loop_sink` forwards to an event loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from opentelemetry import trace
from opentelemetry.context import Context

from decode_worker.config import SchedulerConfig
from decode_worker.errors import CapacityExhausted
from decode_worker.retention import RetentionLedger, RetentionSession
from services.kvpolicy.packing import POSITION_DTYPE, PackedKVView
from services.model import (
    DecodeCache,
    LoadedModel,
    SamplingParams,
    decode_step,
    finish_reason,
    sample,
)
from services.model.errors import KVPoolExhausted, ModelError
from services.model.paged import DEFAULT_PAGE_ROWS, PageLease, PageLedger, PagePool
from services.model.row_attention import RowContract
from services.model.sampler import finite_rows
from services.offload.recall import RecallOutcome, RecallSession, RecallStatus, decode_with_recall
from services.policy import StaleGeneration
from services.telemetry import metrics
from services.telemetry.spans import record_span, start_span
from services.transfer import ViewLayout

log = logging.getLogger(__name__)

FINISH_CANCELLED = "cancelled"
OwnerMap = tuple[int, ...] | None  # None: owners are the K/V heads


@dataclass(frozen=True)
class TokenOut:
    """Output token `index` (0-based; index 0 is the prefill worker's) of a request."""

    token_id: int
    index: int
    logprob: float


@dataclass(frozen=True)
class DecodeFinished:
    """The request stopped (`reason`: eos, stop, length or cancelled) and its KV is released.
    Recall: how many recalls merged rows, the rows and bytes they brought, and the declared
    fallbacks taken (e.g. "recall_timeout:continue_lossy")."""

    reason: str
    output_tokens: int
    cache_generation: int
    tpot_ms: float
    recall_count: int = 0
    recalled_rows: int = 0
    recalled_bytes: int = 0
    fallbacks: tuple[str, ...] = ()
    retention: RetentionLedger | None = None


@dataclass(frozen=True)
class DecodeFailed:
    """The request could not be decoded; its KV is released. `recall` is the recall outcome
    that ended it (the manifest said `fail_request`, or its successor state was rejected);
    `non_finite`: its own logits were not finite, and it failed alone (its batch went on);
    `exhausted`: the KV page budget had no page for it (it failed alone)."""

    message: str
    recall: RecallOutcome | None = None
    non_finite: bool = False
    exhausted: bool = False


DecodeEvent = TokenOut | DecodeFinished | DecodeFailed
EventSink = Callable[[DecodeEvent], None]


def loop_sink(loop: asyncio.AbstractEventLoop, deliver: Callable[[DecodeEvent], None]) -> EventSink:
    """A sink the loop thread calls; `deliver` runs on the event loop `loop`, via
    `call_soon_threadsafe` (so in order, and never inside the caller's current callback)."""

    def push(event: DecodeEvent) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
            loop.call_soon_threadsafe(deliver, event)

    return push


def reservation_bytes(
    layout: ViewLayout, max_tokens: int, cache_dtype: torch.dtype, recallable_rows: int = 0,
    host_bytes: int = 0, page_rows: int = DEFAULT_PAGE_ROWS,
) -> int:
    """KV bytes a request can occupy on this worker, in whole pages of `page_rows` rows (K and
    V at the cache dtype and an int32 original position per row): the view's rows, the omitted
    rows recall may bring back (`recallable_rows`), and one row per (layer, owner) for each of
    its `max_tokens - 1` decode steps, each (layer, owner) rounded up to a page at worst (the
    layout gives rows per layer only; admission trims to the exact pages); plus `host_bytes`
    of host-tier rows (recallable_local), rounded up to a page."""
    segments = layout.num_layers * layout.num_owners
    decoded = max(0, max_tokens - 1) * segments
    rows = layout.total_rows + recallable_rows + decoded
    row_bytes = 2 * layout.head_dim * cache_dtype.itemsize + POSITION_DTYPE.itemsize
    page = page_rows * row_bytes
    pages = (rows + segments * (page_rows - 1)) // page_rows  # sum of ceil(rows_s / page_rows)
    return pages * page + -(-host_bytes // page) * page


class Reservation:
    """Pages held in a `KVBudget` until `release()` (idempotent, thread-safe): the `lease` the
    decode cache charges the request's pages to."""

    def __init__(self, budget: KVBudget, lease: PageLease) -> None:
        self.budget = budget
        self.lease = lease
        self.label = lease.label

    @property
    def nbytes(self) -> int:
        """Bytes reserved now (whole pages)."""
        return self.lease.nbytes

    @property
    def released(self) -> bool:
        return self.lease.released

    def release(self) -> None:
        self.lease.release()


class KVBudget:
    """The byte budget shared by every accepted transfer of a worker: the ledger of its page
    `pool` (reservations and allocated pages in the same pages), or, without a pool, a ledger
    of bytes alone."""

    def __init__(self, capacity_bytes: int, pool: PagePool | None = None) -> None:
        self.capacity_bytes = capacity_bytes  # as configured; the pool holds whole pages of it
        self.pool = pool
        self.ledger = pool.ledger if pool is not None else PageLedger(capacity_bytes, 1)

    @property
    def used_bytes(self) -> int:
        """Bytes reserved (whole pages), allocated or not yet."""
        return self.ledger.usage().reserved_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the pages the decode caches hold now."""
        return self.ledger.usage().held_bytes

    def reserve(self, nbytes: int, label: str) -> Reservation:
        """Hold `nbytes` (rounded up to pages), or raise CapacityExhausted if they do not fit."""
        pages = -(-nbytes // self.ledger.page_bytes)
        try:
            lease = self.ledger.reserve(pages, label)
        except KVPoolExhausted:
            usage = self.ledger.usage()
            raise CapacityExhausted(
                f"{label} needs {nbytes} KV bytes; {usage.reserved_bytes} of {self.capacity_bytes} "
                f"are reserved (pages of {usage.page_bytes} bytes: {usage.reserved_pages} of "
                f"{usage.capacity_pages})",
                field="kv_budget_bytes",
            ) from None
        return Reservation(self, lease)


@dataclass(frozen=True)
class DecodeRequest:
    """A verified view, ready to decode. `request_id` names it in the cache and in `cancel`
    (with `request_generation`); `frontier` is the original position of `first_token`
    (output token 0); `recall` is its recall session (recallable manifests only);
    `retention` its decode-time retention (manifests with `selection.retention` only)."""

    request_id: str
    view: PackedKVView
    frontier: int
    first_token: int
    sampling: SamplingParams
    max_tokens: int
    cache_generation: int
    reservation: Reservation
    sink: EventSink
    owner_to_kv_head: OwnerMap = None
    trace_parent: Context | None = None
    request_generation: int = 0
    recall: RecallSession | None = None
    retention: RetentionSession | None = None


@dataclass
class _RecallTotals:
    """What one request's recalls brought (for its DecodeFinished), and the fallbacks taken."""

    count: int = 0
    rows: int = 0
    nbytes: int = 0
    fallbacks: list[str] = field(default_factory=list)

    def add(self, outcome: RecallOutcome) -> None:
        if outcome.recalled:
            self.count += 1
            self.rows += outcome.rows
            self.nbytes += outcome.nbytes
        else:
            self.fallbacks.append(recall_fallback(outcome))


@dataclass
class _Running:
    """Runtime state of one admitted request (touched only by the loop thread)."""

    request: DecodeRequest
    last_token: int
    generated: int
    admitted_at: float
    last_token_at: float
    step_span: trace.Span | None = None
    span_steps: int = 0
    recalls: _RecallTotals = field(default_factory=_RecallTotals)

    @property
    def cache_generation(self) -> int:
        """Read, never counted here: the recall session's (it owns the generation of a
        request that can recall), or the verified one plus the rows appended since, one per
        decoded token (output token 0 came from the prefill worker)."""
        session = self.request.recall or self.request.retention
        if session is not None:
            return session.cache_generation
        return self.request.cache_generation + self.generated - 1


class DecodeScheduler:
    """The decode loop of one worker. `submit` and `cancel` are thread-safe; the cache, the
    model and every sink call stay on the loop thread."""

    def __init__(self, loaded: LoadedModel, config: SchedulerConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.pool = PagePool.for_budget(
            config.kv_budget_bytes, loaded.config.head_dim, loaded.dtype, loaded.device,
            config.page_rows,
        )
        self.budget = KVBudget(config.kv_budget_bytes, self.pool)
        self.max_batch_seen = 0
        self.steps = 0
        self._eos = loaded.generation_config.eos_token_ids
        self._caches: dict[OwnerMap, DecodeCache] = {}
        self._running: dict[str, _Running] = {}
        self._pending: deque[DecodeRequest] = deque()
        self._cancels: set[tuple[str, int | None]] = set()
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="decode-loop", daemon=True)

    @property
    def active(self) -> int:
        """Requests admitted to the cache or waiting for room."""
        with self._cond:
            return len(self._running) + len(self._pending)

    @property
    def waiting(self) -> int:
        """Verified requests not yet admitted to the batch."""
        with self._cond:
            return len(self._pending)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; every request still here fails and releases its KV."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, request: DecodeRequest) -> None:
        """Queue a verified request; it joins the batch as soon as there is room."""
        with self._cond:
            if self._stopping:
                request.reservation.release()
                request.sink(DecodeFailed("the decode worker is stopping"))
                return
            self._pending.append(request)
            self._cond.notify_all()

    def cancel(self, request_id: str, generation: int | None = None) -> None:
        """Drop a request (no-op if unknown or done); its KV is released before the next step.
        With `generation`, only that request generation is dropped."""
        with self._cond:
            self._cancels.add((request_id, generation))
            self._cond.notify_all()

    def _run(self) -> None:
        while (work := self._next_work()) is not None:
            admitted, cancelled = work
            try:
                for request_id in cancelled:
                    self._cancel_running(request_id)
                for request in admitted:
                    self._admit_alone(request)
                for owner_map, cache in list(self._caches.items()):
                    if cache.batch_size:
                        self._step_alone(owner_map, cache)
            except Exception as exc:  # noqa: BLE001 - last resort: the loop must outlive anything
                log.exception("decode loop iteration failed")
                for request_id in list(self._running):
                    self._fail(request_id, f"decode loop failed: {exc}")
        self._shutdown()

    def _admit_alone(self, request: DecodeRequest) -> None:
        """Admit one request; an unexpected error fails it, and no other."""
        try:
            self._admit(request)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any one request
            log.exception("admitting request %s failed", request.request_id)
            # A slot under this id that no running request owns is this request's, half written.
            cache = self._caches.get(request.owner_to_kv_head)
            orphan = cache is not None and request.request_id in cache.request_ids
            if orphan and request.request_id not in self._running and cache is not None:
                cache.release(request.request_id)
            self._release(request, DecodeFailed(f"cannot admit the view: {exc}"))

    def _step_alone(self, owner_map: OwnerMap, cache: DecodeCache) -> None:
        """Step one batch; a request the page budget has no page for fails alone (the others
        step next iteration); an unexpected error fails that batch's requests, and no other's."""
        try:
            self._step(owner_map, cache)
        except KVPoolExhausted as exc:
            if exc.request_id not in self._running:
                raise
            log.warning("%s", exc)
            self._fail(exc.request_id, f"no KV page: {exc}", exhausted=True)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any one batch
            log.exception("decode step of a batch of %d failed", cache.batch_size)
            for request_id in list(cache.request_ids):
                self._fail(request_id, f"decode step failed: {exc}")

    def _next_work(self) -> tuple[list[DecodeRequest], list[str]] | None:
        """Wait until there is something to do; take cancellations and the requests that fit."""
        with self._cond:
            self._cond.wait_for(self._has_work)
            if self._stopping:
                return None
            cancelled, self._cancels = list(self._cancels), set()
            for request in [r for r in self._pending if _matches(r, cancelled)]:
                self._pending.remove(request)
                self._release(request, DecodeFinished(FINISH_CANCELLED, 1, request.cache_generation, 0.0))
            room = self.config.max_batch - len(self._running)
            admitted = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            running = [r.request.request_id for r in self._running.values() if _matches(r.request, cancelled)]
            return admitted, running

    def _has_work(self) -> bool:
        fits = bool(self._pending) and len(self._running) < self.config.max_batch
        return self._stopping or bool(self._cancels) or fits or bool(self._running)

    def _admit(self, request: DecodeRequest) -> None:
        older = self._running.get(request.request_id)
        if older is not None:
            if older.request.request_generation >= request.request_generation:
                self._release(request, DecodeFailed(
                    f"request generation {request.request_generation} is superseded by "
                    f"{older.request.request_generation}, which is decoding here"))
                return
            self._finish(older, FINISH_CANCELLED)  # a newer generation fences the older out
        reason = finish_reason(request.first_token, 1, request.max_tokens, request.sampling, self._eos)
        if reason is not None:  # the prefill worker's token already ends it
            self._release(request, DecodeFinished(reason, 1, request.cache_generation, 0.0))
            return
        cache = self._cache(request.owner_to_kv_head)
        lease = request.reservation.lease
        retention = request.retention
        contract = retention.row_contract if retention is not None else RowContract()
        try:
            cache.admit_view(request.request_id, request.view, request.frontier, lease=lease,
                             contract=contract)
        except ModelError as exc:
            exhausted = isinstance(exc, KVPoolExhausted)
            self._release(request, DecodeFailed(f"cannot admit the view: {exc}", exhausted=exhausted))
            return
        bound = None
        if retention is not None:  # the step's candidate row on top of the budget, at most
            retention.admitted(cache)
            bound = retention.contract.budget_rows + 1
        if request.recall is None:  # recall may bring rows back: keep what was reserved for them
            steps = request.max_tokens - 1
            lease.ledger.trim(lease, cache.pages_after(request.request_id, steps, bound))
        now = time.monotonic()
        self._running[request.request_id] = _Running(request, request.first_token, 1, now, now)

    def _step(self, owner_map: OwnerMap, cache: DecodeCache) -> None:
        batch = [self._running[request_id] for request_id in cache.request_ids]
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        self.steps += 1
        metrics.DECODE_BATCH.observe(len(batch))
        for running in batch:
            self._trace_step(running, len(batch))
        logits, failed = self._forward(cache, batch)  # [B, V]
        sound = finite_rows(logits).tolist()  # [B]
        live = []
        for index, running in enumerate(batch):
            outcome = failed.get(running.request.request_id)
            if outcome is not None:
                self._fail(running.request.request_id, f"recall failed: {outcome.reason}", outcome)
            elif not sound[index]:
                self._fail_non_finite(running)
            elif running.request.retention is None or self._retain(cache, running):
                live.append(index)
        if live:
            self._emit([batch[i] for i in live], logits[live])

    def _retain(self, cache: DecodeCache, running: _Running) -> bool:
        """Decode-time retention's steps 3-7 for the step just run (decode_worker/retention.py);
        False if it ended the request (its state was fenced out, or the step could not be
        decided: then nothing of the step is committed and the request fails alone)."""
        session, request_id = running.request.retention, running.request.request_id
        assert session is not None
        try:
            done = session.commit(cache, session.decide(cache))
        except StaleGeneration as exc:
            metrics.RETENTION_PUBLICATIONS.labels("stale").inc()
            self._fail(request_id, f"retention successor refused: {exc}")
            return False
        except Exception as exc:  # noqa: BLE001 - one request's retention fails that request
            log.exception("retention step of %s failed", request_id)
            self._fail(request_id, f"retention step failed: {exc}")
            return False
        metrics.RETENTION_RESIDENT.observe(done.resident_max)
        metrics.RETENTION_EVICTED.inc(done.evicted_rows)
        if done.resident_max > session.contract.budget_rows:
            metrics.RETENTION_OVER_BUDGET.inc()
        if done.due:  # an unavailable policy service is retried at the next cadence point
            metrics.RETENTION_PUBLICATIONS.labels(
                "published" if done.published is not None else "unavailable").inc()
        return True

    def _emit(self, batch: list[_Running], logits: torch.Tensor) -> None:
        """Sample one token per request from its sound logits row `[B, V]` and hand it on."""
        tokens = sample(logits, [r.request.sampling for r in batch], [r.generated for r in batch])  # [B]
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None])[:, 0]  # [B]
        metrics.DECODE_TOKENS.inc(len(batch))
        now = time.monotonic()
        for running, token, logprob in zip(batch, tokens.tolist(), logprobs.tolist(), strict=True):
            self._advance(running, int(token), float(logprob), now)
            if running.span_steps >= self.config.trace_steps_per_span:
                self._end_step_span(running)

    def _fail_non_finite(self, running: _Running) -> None:
        """End a request whose own logits row is not finite; the rest of its batch goes on."""
        request = running.request
        metrics.DECODE_NON_FINITE.inc()
        message = (f"request {request.request_id} (request generation {request.request_generation}): "
                   f"the logits of output token {running.generated} are not finite (NaN or +inf); "
                   "it failed alone")
        log.warning("%s", message)
        self._fail(request.request_id, message, non_finite=True)

    def _forward(self, cache: DecodeCache, batch: list[_Running]) -> tuple[torch.Tensor, dict[str, RecallOutcome]]:
        """One batched step: plain, or through the recall engine when a request has a session.
        Returns the logits `[B, V]` and the recall outcomes that end their request."""
        tokens = [r.last_token for r in batch]
        sessions = {r.request.request_id: r.request.recall for r in batch if r.request.recall is not None}
        if not sessions:
            return decode_step(self.loaded.model, cache, tokens), {}
        step = decode_with_recall(self.loaded.model, cache, tokens, sessions)
        failed = {}
        for running in batch:
            outcome = step.outcomes.get(running.request.request_id)
            if outcome is not None and outcome.evaluated:
                self._account_recall(running, outcome)
                if outcome.status is RecallStatus.FAILED:
                    failed[running.request.request_id] = outcome
        return step.logits, failed

    def _account_recall(self, running: _Running, outcome: RecallOutcome) -> None:
        """Metrics, the `kv.recall` span, and the request's recall totals and fallbacks."""
        if not outcome.pages and not (outcome.fell_back or outcome.status is RecallStatus.FAILED):
            return  # evaluated, below the threshold, or planning in the background: no fetch
        # (a plan not done by the deadline falls back without pages: it is still counted)
        kind = recall_kind(outcome)
        metrics.RECALLS.labels(kind).inc()
        metrics.RECALL_SECONDS.observe(outcome.latency_s)
        running.recalls.add(outcome)
        if outcome.recalled:
            metrics.RECALL_ROWS.inc(outcome.rows)
            metrics.RECALL_BYTES.inc(outcome.nbytes)
        else:
            metrics.RECALL_FALLBACKS.labels(recall_fallback(outcome)).inc()
        successor = outcome.successor
        record_span(
            "kv.recall", running.request.trace_parent, outcome.latency_s,
            error=None if outcome.recalled else outcome.reason,
            request_id=running.request.request_id, request_generation=running.request.request_generation,
            step=outcome.step, outcome=kind, pages=len(outcome.pages), rows=outcome.rows,
            bytes=outcome.nbytes, latency_ms=outcome.latency_s * 1000.0, mass_bound=outcome.mass_bound,
            full_recall=outcome.full_recall, timed_out=outcome.timed_out, reason=outcome.reason,
            state_generation=successor.state_generation if successor else None,
            cache_generation=successor.cache_generation if successor else None,
        )

    def _trace_step(self, running: _Running, batch_size: int) -> None:
        """Count a step into the request's open decode.step span, opening one if needed."""
        if running.step_span is None:
            running.step_span = start_span(
                "decode.step", running.request.trace_parent, request_key=running.request.request_id,
                first_index=running.generated, batch_size=batch_size,
            )
        running.span_steps += 1

    def _end_step_span(self, running: _Running, finish_reason: str | None = None, error: str | None = None) -> None:
        step_span, running.step_span = running.step_span, None
        if step_span is not None:
            step_span.set_attributes({"steps": running.span_steps, "last_index": running.generated - 1,
                                      "cache_generation": running.cache_generation})
            if finish_reason is not None:
                step_span.set_attribute("finish_reason", finish_reason)
            if error is not None:
                step_span.set_status(trace.Status(trace.StatusCode.ERROR, error))
            step_span.end()
        running.span_steps = 0

    def _advance(self, running: _Running, token: int, logprob: float, now: float) -> None:
        request = running.request
        running.request.sink(TokenOut(token, running.generated, logprob))
        running.last_token, running.last_token_at = token, now
        running.generated += 1
        reason = finish_reason(token, running.generated, request.max_tokens, request.sampling, self._eos)
        if reason is not None:
            self._finish(running, reason)

    def _finish(self, running: _Running, reason: str) -> None:
        decoded = running.generated - 1
        tpot_ms = 1000.0 * (running.last_token_at - running.admitted_at) / decoded if decoded else 0.0
        if decoded:
            metrics.DECODE_TPOT.observe(tpot_ms / 1000.0)
        self._end_step_span(running, finish_reason=reason)
        retention = self._finish_retention(running, reason)
        self._drop(running.request.request_id)
        recalls = running.recalls
        self._release(running.request, DecodeFinished(
            reason, running.generated, running.cache_generation, tpot_ms,
            recalls.count, recalls.rows, recalls.nbytes, tuple(recalls.fallbacks), retention,
        ))

    def _finish_retention(self, running: _Running, reason: str) -> RetentionLedger | None:
        """A retaining request's end: its last committed state is published (unless cancelled:
        the gateway ended it, so its state is no longer this worker's to publish)."""
        session = running.request.retention
        if session is None:
            return None
        cache = self._caches[running.request.owner_to_kv_head]
        if reason != FINISH_CANCELLED:
            try:
                outcome = session.finish(cache)
            except StaleGeneration:
                outcome = "stale"
            if outcome is not None:
                metrics.RETENTION_PUBLICATIONS.labels(outcome).inc()
        ledger = session.ledger(cache)
        published = session.published
        record_span(
            "kv.retention", running.request.trace_parent, 0.0, request_id=session.request_id,
            state_generation=published.state_generation, cache_generation=session.cache_generation,
            **dataclasses.asdict(ledger),
        )
        return ledger

    def _cancel_running(self, request_id: str) -> None:
        running = self._running.get(request_id)
        if running is not None:
            self._finish(running, FINISH_CANCELLED)

    def _fail(self, request_id: str, message: str, recall: RecallOutcome | None = None, *,
              non_finite: bool = False, exhausted: bool = False) -> None:
        running = self._running.get(request_id)
        if running is not None:
            self._end_step_span(running, error=message)
            self._drop(request_id)
            self._release(running.request, DecodeFailed(message, recall, non_finite, exhausted))

    def _drop(self, request_id: str) -> None:
        running = self._running.pop(request_id)
        self._caches[running.request.owner_to_kv_head].release(request_id)

    def _release(self, request: DecodeRequest, event: DecodeEvent) -> None:
        if request.recall is not None:
            request.recall.abandon()  # a recall started at the last step is not collected
        request.reservation.release()
        request.sink(event)

    def _cache(self, owner_map: OwnerMap) -> DecodeCache:
        cache = self._caches.get(owner_map)
        if cache is None:
            cache = DecodeCache(
                self.loaded.config,
                self.loaded.dtype,
                self.loaded.device,
                batch_capacity=self.config.max_batch,
                row_capacity=self.config.initial_row_capacity,
                owner_to_kv_head=owner_map,
                pool=self.pool,
            )
            self._caches[owner_map] = cache
        return cache

    def _shutdown(self) -> None:
        for request_id in list(self._running):
            self._fail(request_id, "the decode worker is stopping")
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for request in pending:
            self._release(request, DecodeFailed("the decode worker is stopping"))


def recall_kind(outcome: RecallOutcome) -> str:
    """The metrics label of a recall that fetched: ok, timeout, unavailable or rejected."""
    if outcome.recalled:
        return "ok"
    if outcome.timed_out:
        return "timeout"
    if outcome.status is RecallStatus.FAILED and outcome.reason and outcome.reason.startswith("successor"):
        return "rejected"
    return "unavailable"


def recall_fallback(outcome: RecallOutcome) -> str:
    """The declared fallback a failed recall took, e.g. "recall_timeout:continue_lossy"."""
    cause = "recall_timeout" if outcome.timed_out else "recall_unavailable"
    action = "continue_lossy" if outcome.status is RecallStatus.CONTINUED_LOSSY else "fail_request"
    return f"{cause}:{action}"


def _matches(request: DecodeRequest, cancels: list[tuple[str, int | None]]) -> bool:
    return any(
        request.request_id == request_id and generation in (None, request.request_generation)
        for request_id, generation in cancels
    )
