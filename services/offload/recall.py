"""The decode-side recall engine: bound a step's omitted mass, fetch pages, recompute the step.

One `RecallSession` per request holds what recall needs across steps: the manifest's recall
policy, the page summaries that came with the packed view, the pages still omitted, the
current `KVPolicyState` and a `PageFetcher` (the prefill worker's offload store, or the
decode worker's local host tier). `decode_with_recall` runs one batched decode step for
every request of a `DecodeCache`, recalling for those that have a session:

    sessions = {request_id: RecallSession(manifest, summaries, fetch, state=state)}
    step = decode_with_recall(model, cache, tokens, sessions)  # one token per cache slot
    step.logits                  # [B, V] fp32, cache.request_ids order
    step.outcomes[request_id]    # RecallOutcome of that request's step

A step, in order (each numbered step is one public call, so a decode loop other than
`decode_with_recall` can drive a session the same way):

1. Capture. If some session is `due()` (its cadence, `recall_cadence_steps`, and pages still
   omitted), the step runs with a `StepCapture`: every layer records the post-RoPE query
   `[B, H_q, d_h]` and the log-sum-exp r `[B, H_q]` of the rows each query saw (retained,
   decoded, already recalled, and the step's own row). Otherwise it is a plain
   `decode_step`: recall costs nothing on steps it does not evaluate (`skipped()`).
2. `plan(query, lse, cache) -> RecallPlan` (pure): `bound_omitted_mass` over the pages still
   omitted, then `choose_pages` (threshold, at most `max_pages_per_step`, or every page when
   the full-recall gate fires).
3. `recall(plan, cache) -> RecallResult`: fetch with the deadline `recall_timeout_ms`. A
   `RecallUnavailable` from the fetcher, an answer after the deadline, a missing page or rows
   that do not match their summary make the rows unavailable; the manifest's
   `timeout_fallback` decides: `continue_lossy` keeps the step's lossy logits and records it
   in the outcome (the pages stay omitted and may be recalled at a later step);
   `fail_request` marks the outcome FAILED (the single-request `RecallSession.decode_step`
   raises `RecallFailed`). A failure never touches the cache.
4. Successor, inside `recall`: `recall_successor` builds state s + 1 (the parent plus the
   recalled positions and the positions decoded since) and hands it to `on_successor`, where
   the decode worker publishes it through the policy service's fence. A `RecallUnavailable`
   raised there takes the fallback of step 3; any other exception fails the request. Only
   then does the session adopt the state and mark the pages recalled.
5. Recompute: the cache takes the whole batch step back (`DecodeCache.undo_step`), the
   recalled rows are appended to their owners at their original positions (row order does
   not matter to attention: keys carry RoPE at their position) and the step runs again.
   Requests that recalled nothing get the same logits as in the first run.
6. `end_step(outcome)` counts the step, for every session of the batch.

The omitted-value term (`recoverability.omitted_value_term`, with row codes): before the
step, `prepare_term` hands the cache the session's `ValueTermSource`
(`DecodeCache.set_omitted_term`), which the cache asks, as each layer attends, for what the
pages still omitted would add to that layer's attention (`bound.layer_value_term`: their rows'
code-estimated mass under the layer's own query, carrying the pages' mean values). It is
computed afresh at evaluated steps, whose `plan` then reads the code logits it computed, and
reused in between; recalled pages leave it at the next step.

Deferred recalls (`RecallStrategy`, after the session's first `recompute_steps` steps): step
3 becomes `start(plan, ...)`, which hands the fetch (and the successor's construction) to a
background thread and reports FETCHING; step 5 disappears. Before the *next* step runs,
`collect()` waits for the rows until the recall deadline (counted from the fetch's start),
publishes the successor through the fence, adopts it and the rows are appended; the step then
runs once, with them. The decode loop pays no fetch and no second forward; fetches of the
requests of a batch run side by side on the shared `fetch_pool()`. Rows not back by the
deadline take the manifest's fallback at that step, exactly like a synchronous recall's.

Cache generations: the session owns its request's, starting at the state's; `end_step` is the
one place it advances (one for the step's row, one more when the step recalled,
`cache_generation_after`). A recall's successor carries the generation after the step that
first reads its rows (recomputed, or the next one when deferred), and its frontier includes
that step's token. Synchronous fetches of several requests in one step run one after the
other, each with its own deadline.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

import torch

from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityContract,
    RecoverabilityMode,
    TimeoutFallback,
)
from services.kvpolicy.state import KVPolicyState
from services.model.kvcache import DecodeCache, OmittedPart, OmittedTerm, StepCapture
from services.model.model import CausalLM
from services.model.runtime import decode_step
from services.offload.bound import (
    SKETCH_WIDTH,
    CodeLogits,
    LayerTerm,
    Ranking,
    RecallChoice,
    RecallPolicy,
    TermInputs,
    bound_omitted_mass,
    choose_estimated,
    choose_pages,
    layer_page_lse,
    layer_value_term,
    live_bias,
    live_grid,
    owner_readers,
    page_code_log_odds,
    sketched_code_log_odds,
    start_layer_page_lse,
    start_layer_value_terms,
    take_out_pages,
    term_inputs,
)
from services.offload.errors import (
    BoundInputInvalid,
    RecallFailed,
    RecallUnavailable,
    SummaryInvalid,
)
from services.offload.merge import recall_successor, recalled_position_grid
from services.offload.pages import PageRef, PageSummaries, RecalledPage, value_mean_matches


class PageFetcher(Protocol):
    """Fetch the rows of omitted pages (from the local host tier or the prefill worker).

    Returns one `RecalledPage` per ref (any order). Raises `RecallUnavailable(reason,
    timed_out=...)` when the rows cannot come back within `timeout_s` seconds.
    """

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]: ...


SuccessorHook = Callable[[KVPolicyState], None]


class RecallStatus(StrEnum):
    """What recall did at one step of one request."""

    DISABLED = "disabled"  # the manifest omits irrecoverably
    NOT_DUE = "not_due"  # the cadence skips this step, or nothing is omitted any more
    BELOW_THRESHOLD = "below_threshold"  # evaluated: no owner's bound passed the threshold
    RECALLED = "recalled"  # pages merged (the step recomputed, or applied before it ran)
    FETCHING = "fetching"  # evaluated: pages asked for in the background, rows at the next step
    # evaluated: the step's queries are scored in the background; the next step reports what
    # the plan asked for (RECALLED with its pages, BELOW_THRESHOLD, or a fallback)
    PLANNING = "planning"
    CONTINUED_LOSSY = "continued_lossy"  # rows unavailable; the manifest says continue_lossy
    FAILED = "failed"  # rows unavailable (fail_request) or the successor was rejected


@dataclass(frozen=True)
class RecallOutcome:
    """One request's recall at one decode step (`step` counts the session's steps from 0)."""

    request_id: str
    step: int
    status: RecallStatus
    mass_bound: float | None = None  # largest owner bound on the omitted mass (evaluated steps)
    full_recall: bool = False  # the full-recall gate fired
    pages: tuple[PageRef, ...] = ()  # pages asked for (and merged when RECALLED)
    rows: int = 0  # rows merged
    nbytes: int = 0  # bytes of the merged rows (K, V, positions)
    latency_s: float = 0.0  # wall time of the fetch
    reason: str | None = None  # why the rows did not come back
    timed_out: bool = False
    successor: KVPolicyState | None = None  # the state a recall published
    fetching: tuple[PageRef, ...] = ()  # pages this step asked for in the background

    @property
    def evaluated(self) -> bool:
        return self.status not in (RecallStatus.DISABLED, RecallStatus.NOT_DUE)

    @property
    def recalled(self) -> bool:
        return self.status is RecallStatus.RECALLED

    @property
    def fell_back(self) -> bool:
        return self.status is RecallStatus.CONTINUED_LOSSY


@dataclass(frozen=True)
class RecallStep:
    """The logits of one batched step and each session's outcome."""

    logits: torch.Tensor  # [B, V] fp32, in the cache's request order
    outcomes: Mapping[str, RecallOutcome]
    recomputed: bool  # the step ran a second time with recalled rows


@dataclass(frozen=True)
class RecallPlan:
    """What the bound decided at one evaluated step: `outcome` is BELOW_THRESHOLD with the
    mass bound and the pages to fetch (`pages`; none when no owner passed the threshold)."""

    outcome: RecallOutcome

    @property
    def pages(self) -> tuple[PageRef, ...]:
        return self.outcome.pages


@dataclass(frozen=True)
class RecallResult:
    """The outcome of a planned recall, and the rows to merge (only when RECALLED)."""

    outcome: RecallOutcome
    pages: tuple[RecalledPage, ...] = ()


def cache_generation_after(cache_generation: int, *, recalled: bool) -> int:
    """The cache generation once a step is in: one for the row it appended to every owner,
    one more for the rows a recall merged."""
    return cache_generation + 1 + int(recalled)


class _SuccessorRejected(Exception):
    """`on_successor` raised something other than RecallUnavailable."""


@dataclass(frozen=True)
class RecallStrategy:
    """How the engine recalls within the contract's knobs (an engine setting: the manifest
    still bounds pages per step, cadence, deadline and fallback). When rows reach attention:

    `recompute_steps`: the session's first steps (counted from 0) whose recall is fetched
    on the decode thread and recomputes the step, so the rows answer that very step (the
    cue of a follow-up turn); None: every step. Later recalls are *deferred*: the fetch
    runs on `executor`'s threads while the decode loop goes on, and its rows are merged
    before the next step runs (its outcome is RECALLED at that step; the step that asked
    reports FETCHING). The next step waits for the rows at most until the recall deadline
    (counted from the fetch's start), then takes the manifest's fallback.
    """

    recompute_steps: int | None = None
    # Pages per deferred step at most (None: the contract's `max_pages_per_step`; never
    # more): a burst at the recomputed first steps, then a trickle.
    deferred_pages: int | None = None
    # How candidate pages are ordered, and (midpoint, codes) the estimate's log-odds floor
    # below which a page is not fetched (steps whose queries look nowhere omitted fetch
    # nothing).
    ranking: Ranking = Ranking.BOUND
    min_estimate: float | None = None
    # Codes ranking: each chosen page brings its owner's next `successor_pages` live pages
    # too (a copied span is read forward, one row a step: deferred rows that arrive a step
    # late are then already there when the step that reads them runs).
    successor_pages: int = 0
    # The omitted-value term (manifests with `omitted_value_term`) is computed afresh from
    # each layer's query every `term_refresh_steps` steps, and at every evaluated step and
    # every step after a recall; in between each layer reuses its last term. 1: every step
    # (a stale term moves a tiny model's logits away from the full cache's as often as
    # towards it: tests/services/offload/test_offload_recall.py).
    term_refresh_steps: int = 1
    # After pages were recalled from a layer, between refreshes: True computes that layer's
    # term afresh from its query (a full scoring of the layer again); False takes the
    # recalled pages out of its last term (`LayerTerm.without`, their masses as that term's
    # query saw them). The layers no page was recalled from keep their last term either way.
    term_refresh_on_recall: bool = False
    # Codes ranking: score only the `sketch_candidates` pages the page sketch ranks best
    # (`bound.sketched_code_log_odds`, mean estimate + `sketch_width` standard deviations)
    # row by row, instead of every omitted row; None: every row. Steps whose code logits the
    # omitted-value term already computed read those instead.
    sketch_candidates: int | None = None
    sketch_width: float = SKETCH_WIDTH
    # Deferred steps: the step's queries are scored on the planner thread (`plan_pool()`)
    # while the decode loop goes on, and the fetch starts from there; the step reports
    # PLANNING and the next one what its plan asked for. The rows land before the same step
    # as when planned on the decode thread (False: FETCHING), so the answers are the same;
    # the decode loop waits only for whatever is not done when the next step begins.
    plan_in_background: bool = False
    # The omitted-value term at deferred steps: computed on the planner thread from an
    # evaluated step's queries as its layers attend (`ValueTermSource.ahead`), and read by the
    # steps after it instead of being computed on the decode thread by the step that reads it
    # (one or two steps old at cadence 2, against none or one); that step's plan reads the
    # code logits it computed. Needs `plan_in_background`.
    term_ahead: bool = False

    def __post_init__(self) -> None:
        if self.min_estimate is not None and self.ranking is Ranking.BOUND:
            raise BoundInputInvalid("min_estimate", "only the midpoint and codes rankings read it")
        if self.successor_pages and self.ranking is not Ranking.CODES:
            raise BoundInputInvalid("successor_pages", "only the codes ranking reads it")
        if self.successor_pages < 0:
            raise BoundInputInvalid("successor_pages", f"must be >= 0, got {self.successor_pages}")
        if self.recompute_steps is not None and self.recompute_steps < 0:
            raise BoundInputInvalid(
                "recompute_steps", f"must be >= 0 or None, got {self.recompute_steps}"
            )
        if self.term_ahead and not self.plan_in_background:
            raise BoundInputInvalid("term_ahead", "needs plan_in_background (the planner thread)")
        if self.term_refresh_steps < 1:
            raise BoundInputInvalid(
                "term_refresh_steps", f"must be positive, got {self.term_refresh_steps}"
            )
        if self.sketch_candidates is not None and self.ranking is not Ranking.CODES:
            raise BoundInputInvalid("sketch_candidates", "only the codes ranking reads it")
        if self.sketch_candidates is not None and self.sketch_candidates < 1:
            raise BoundInputInvalid(
                "sketch_candidates", f"must be positive or None, got {self.sketch_candidates}"
            )
        if not (math.isfinite(self.sketch_width) and self.sketch_width >= 0):
            raise BoundInputInvalid(
                "sketch_width", f"must be finite and >= 0, got {self.sketch_width}"
            )
        if self.deferred_pages is not None and self.deferred_pages < 1:
            raise BoundInputInvalid(
                "deferred_pages", f"must be positive or None, got {self.deferred_pages}"
            )

    def recomputes(self, step: int) -> bool:
        return self.recompute_steps is None or step < self.recompute_steps


RECOMPUTE_ALWAYS = RecallStrategy()
# Pages `SKETCH_STRATEGY` scores row by row at an evaluated step, those the page sketch scores
# best (`bound.sketched_code_log_odds`). Chosen on the single-needle and multi-key tuning
# prompts at 4K and 8K, 10%: the 1024 best held every page the full scoring ranked first, 512
# missed 8K's first page at three standard deviations; a step then reads 25% of the codes table
# and costs 3.9 ms against 9.6 ms at 4K (tuning.md, "The page sketch"). On the multi-value
# (prose) tuning prompts 1024 loses picks at 10 of 51 steps, the first-ranked page once; keeping
# every pick takes 8192, and at 4096 a sketched step already costs what scoring every row does
# (tuning.md, "The page sketch on prose").
SKETCH_CANDIDATES = 1024
# The first step (the one that reads the cue) recomputes, every later recall is fetched in
# the background and applied a step later.
DEFERRED_AFTER_FIRST = RecallStrategy(recompute_steps=1)
# With row codes: pages ranked by their rows' estimated logits, a step recalls only when a
# page's estimate clears the floor (log-odds -2: a page estimated at 13.5% of the resident
# mass), and each ranked page brings its successor. Tuned on prompts from TUNE_SEED
# (docs/results/recall-smollm2/tuning.md, "Row codes").
CODES_STRATEGY = RecallStrategy(recompute_steps=1, ranking=Ranking.CODES, min_estimate=-2.0,
                                successor_pages=1, plan_in_background=True)
# The same, scoring row by row only the 1024 pages the page sketch scores best
# (`SKETCH_CANDIDATES`): on the 4K tuning prompts the same answers and recalls at 1.39-1.50x
# the irrecoverable TPOT at batch 8 against 1.56-1.71x; on the 4K report prompts one
# multi-key prompt fewer (0 of 4 where every row scored answers the full cache's 1), so the
# served strategies score every row (docs/results/recall-smollm2/report.md, "The page sketch";
# on prose: `SKETCH_CANDIDATES`).
SKETCH_STRATEGY = replace(CODES_STRATEGY, sketch_candidates=SKETCH_CANDIDATES)
# With page value means too (`omitted_value_term`): the same, and the term computed afresh at
# the evaluated steps (every second one under `VALUES_RECALL_KNOBS`), whose scoring it shares,
# and reused in between. On the 8K tuning prompts computing it at every step answered the same
# (3 of 3 at 10%, where the codes alone answer 2) at 1.8-2.0x the irrecoverable TPOT against
# 1.6-1.8x (tuning.md, "The omitted-value term, served").
VALUES_STRATEGY = replace(CODES_STRATEGY, term_refresh_steps=2)
# The same, with the term of the deferred steps computed on the planner thread beside the
# evaluated steps and read by the steps after them (`RecallStrategy.term_ahead`). Not served:
# on the 8K tuning prompts it answered 2 of 3 at 10% and 25% where `VALUES_STRATEGY` answers 3
# (the term two steps old at the first evaluated step after the cue lost a digit), and at 4K,
# batch 8, one planner thread computing every due request's 30 layer terms costs 1.54-2.08x
# the irrecoverable TPOT against 1.71-2.47x (tuning.md, "Recall beside the decode loop").
VALUES_AHEAD_STRATEGY = replace(VALUES_STRATEGY, term_ahead=True)
# What the decode worker runs (`decode_worker.recall`): see docs/results/recall-smollm2.
WORKER_STRATEGY = DEFERRED_AFTER_FIRST


def worker_strategy(summaries: PageSummaries | None) -> RecallStrategy:
    """The decode worker's strategy for a session: the codes ranking when its summaries
    carry row codes (the manifest asked for them; with page value means, `VALUES_STRATEGY`),
    else `WORKER_STRATEGY`."""
    if summaries is not None and summaries.page_value_mean is not None:
        return VALUES_STRATEGY
    if summaries is not None and summaries.row_codes is not None:
        return CODES_STRATEGY
    return WORKER_STRATEGY
_POOL_LOCK = threading.Lock()
_POOLS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _shared_pool(name: str, workers: int) -> concurrent.futures.Executor:
    """The process's pool of threads named `name` (created on first use)."""
    with _POOL_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = concurrent.futures.ThreadPoolExecutor(
                max_workers=workers, thread_name_prefix=name)
        return pool


def fetch_pool() -> concurrent.futures.Executor:
    """The process's shared fetch threads (deferred recalls of every session). Fetches of the
    requests of one batch run side by side on it."""
    return _shared_pool("recall", 8)


def plan_pool() -> concurrent.futures.Executor:
    """The process's planner thread (deferred recalls planned in the background,
    `RecallStrategy.plan_in_background`). One thread: the plans of a batch queue behind each
    other on the core the decode loop's torch threads leave, rather than take cores from the
    step they run beside."""
    return _shared_pool("recall-plan", 1)


@dataclass(frozen=True)
class _Planned:
    """What a background plan decided: the plan, and its fetch when it asked for pages."""

    plan: RecallPlan
    fetch: concurrent.futures.Future[_Fetched] | None


@dataclass(frozen=True)
class _Fetched:
    """What a background fetch brought: checked pages and the successor built on them."""

    pages: tuple[RecalledPage, ...]
    successor: KVPolicyState
    latency_s: float


@dataclass(frozen=True)
class _Pending:
    """A deferred recall in flight: its plan's outcome, the future (the fetch's, or the
    background plan's when `planning`) and its start time."""

    outcome: RecallOutcome
    future: concurrent.futures.Future[_Fetched] | concurrent.futures.Future[_Planned]
    started: float
    planning: bool = False


class RecallSession:
    """Recall for one request on the decode side (runtime state, not thread-safe).

    `summaries` and `fetch` may be None only when the manifest omits irrecoverably; such a
    session never evaluates (every outcome is DISABLED). `state` is the state the decode
    worker verified (its request id names the session); `on_successor` receives every
    successor state before the session adopts it.

    One step, in public calls: `due()`; if due, `plan(...)` then `recall(plan, cache)`, else
    `skipped()`; then `end_step(outcome)`. `decode_with_recall` drives them for a batch.
    """

    def __init__(
        self,
        manifest: KVVisibilityPolicyManifest,
        summaries: PageSummaries | None,
        fetch: PageFetcher | None,
        *,
        state: KVPolicyState,
        on_successor: SuccessorHook | None = None,
        clock: Callable[[], float] = time.perf_counter,
        strategy: RecallStrategy = RECOMPUTE_ALWAYS,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        contract = manifest.recoverability
        self.strategy = strategy
        self._executor = executor
        self._pending: _Pending | None = None
        self.request_id = state.request_id
        self.policy = RecallPolicy.from_contract(contract) if contract.recallable else None
        self.timeout_s = (contract.recall_timeout_ms or 0) / 1000.0
        self.fallback = contract.timeout_fallback
        self.summaries = summaries
        self._fetch = fetch
        self._on_successor = on_successor
        self._clock = clock
        self.state = state
        self.steps = 0
        self.cache_generation = state.cache_generation
        self.recalled_rows = 0
        self.recalled_bytes = 0
        pages = summaries.num_pages if summaries is not None else 0
        self._live = torch.ones(pages, dtype=torch.bool)  # [P_total], pages still omitted
        _check_session(manifest, summaries, fetch, state)
        if strategy.ranking is Ranking.CODES and summaries is not None and summaries.row_codes is None:
            raise BoundInputInvalid("ranking", "the codes ranking needs summaries with row codes "
                                    "(recoverability.key_code_bits)")
        if strategy.ranking is Ranking.CODES and summaries is not None:
            _ = summaries.code_table  # built at admission, not at the cue step
            if strategy.sketch_candidates is not None:
                _ = summaries.page_sketch
        # The omitted-value term (`recoverability.omitted_value_term`): the cache asks it
        # for every layer of every step (`attach_term`).
        self.value_term: ValueTermSource | None = None
        if contract.omitted_value_term and summaries is not None:
            if summaries.page_value_mean is None:
                raise SummaryInvalid("page_value_mean", "the manifest's omitted_value_term needs "
                                     "summaries with page value means")
            self.value_term = ValueTermSource(summaries, self._live,
                                              refresh_on_recall=strategy.term_refresh_on_recall)

    @property
    def enabled(self) -> bool:
        return self.policy is not None

    @property
    def live_pages(self) -> int:
        return int(self._live.sum())

    @property
    def pending(self) -> bool:
        """A deferred recall is in flight (its rows are merged before the next step)."""
        return self._pending is not None

    def abandon(self) -> None:
        """The request ended (finished, failed or cancelled) with a deferred recall in flight
        that no step will collect: its fetch is cancelled if it has not started, and its rows
        are never merged (a running fetch ends on its own deadline and is dropped)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.future.cancel()

    def due(self) -> bool:
        """Whether this step evaluates the bound (cadence, some page still omitted, no
        deferred recall in flight)."""
        return (
            self.policy is not None
            and self._pending is None
            and self.policy.due(self.steps)
            and bool(self._live.any())
        )

    def defers(self) -> bool:
        """Whether a recall planned at this step is fetched in the background."""
        return not self.strategy.recomputes(self.steps)

    def start(self, plan: RecallPlan, cache: DecodeCache, *, recalled_now: bool) -> RecallOutcome:
        """Deferred step 3: start fetching the planned pages in the background, after this
        step's row is in (`recalled_now`: this step also merged a recall). Returns the
        step's outcome (FETCHING, or the plan's when there is nothing to fetch); `collect`
        at the next step merges the rows."""
        base = plan.outcome
        if not plan.pages:
            return base
        generation, frontier = self._deferred_successor(cache, recalled_now)
        future = self._fetches().submit(self._fetch_in_background, plan.pages, self.state,
                                        generation, frontier)
        self._pending = _Pending(base, future, self._clock())
        return replace(base, status=RecallStatus.FETCHING, pages=(), fetching=plan.pages)

    def scores_alongside(self) -> bool:
        """Whether this step's codes scoring runs layer by layer on the planner thread while
        the step's later layers still run (`LayerScores`): a deferred step planned in the
        background, scoring every row (from the value term's logits where the decode thread
        computed them for the layer)."""
        strategy = self.strategy
        return (strategy.plan_in_background and strategy.ranking is Ranking.CODES
                and strategy.sketch_candidates is None and self.defers())

    def start_planning(self, query: torch.Tensor, lse: torch.Tensor, cache: DecodeCache, *,
                       recalled_now: bool, scores: LayerScores | None = None) -> RecallOutcome:
        """Deferred steps 2 and 3 in the background (`RecallStrategy.plan_in_background`):
        the planner thread scores this step's queries `[L, H_q, d_h]` and r `[L, H_q]` (copies:
        the capture is the step's) and starts the fetch of what it chose; the step's outcome
        is PLANNING, and `collect` at the next step reports the plan and merges its rows.
        Everything the plan reads of the session is fixed here, on the decode thread.
        `scores`: the step's page scores, computed as its layers attended."""
        generation, frontier = self._deferred_successor(cache, recalled_now)
        logits = self._term_logits() if scores is None else None  # else: scored per layer
        future = plan_pool().submit(
            self._plan_in_background, query.detach().clone(), lse.detach().clone(),
            list(cache.head_to_owner), cache.scale, logits, scores, self.steps, self.state,
            generation, frontier,
        )
        self._pending = _Pending(RecallOutcome(self.request_id, self.steps,
                                               RecallStatus.BELOW_THRESHOLD),
                                 future, self._clock(), planning=True)
        return RecallOutcome(self.request_id, self.steps, RecallStatus.PLANNING)

    def _plan_in_background(
        self, query: torch.Tensor, lse: torch.Tensor, head_to_owner: list[int], scale: float,
        logits: CodeLogits | None, scores: LayerScores | None, step: int, state: KVPolicyState,
        generation: int, frontier: int,
    ) -> _Planned:
        """On the planner thread: the plan (reading the live pages, which only `collect`
        changes, on the decode thread once this is done) and its fetch, started."""
        page_lse = None if scores is None else scores.page_lse(self.request_id)
        plan = self._plan(query, lse, head_to_owner, scale, step=step, deferred=True,
                          logits=logits, page_lse=page_lse)
        if not plan.pages:
            return _Planned(plan, None)
        fetch = self._fetches().submit(self._fetch_in_background, plan.pages, state, generation,
                                       frontier)
        return _Planned(plan, fetch)

    def _deferred_successor(self, cache: DecodeCache, recalled_now: bool) -> tuple[int, int]:
        """The cache generation and frontier of a deferred recall's successor: its rows land
        before the next step runs, so it describes the cache once that step is in, as a
        recomputed recall's does (one more token, two generations)."""
        next_step = cache_generation_after(self.cache_generation, recalled=recalled_now)
        return (cache_generation_after(next_step, recalled=True),
                self._frontier_after_step(cache) + 1)

    def _fetches(self) -> concurrent.futures.Executor:
        return self._executor or fetch_pool()

    def collect(self) -> RecallResult:
        """Deferred steps 3 and 4, before the step after `start`: wait for the rows until
        the recall deadline, publish the successor through `on_successor`, adopt it. Rows
        that did not come back in time take the manifest's fallback (a late answer is
        dropped, never merged)."""
        pending = self._pending
        assert pending is not None, "collect() without a deferred recall in flight"
        self._pending = None
        base = replace(pending.outcome, step=self.steps)
        future: concurrent.futures.Future[_Fetched] | concurrent.futures.Future[_Planned]
        future = pending.future
        try:
            if pending.planning:  # the plan first (the deadline counts from its start)
                planned = future.result(timeout=self._remaining(pending))
                assert isinstance(planned, _Planned)
                base = replace(planned.plan.outcome, step=self.steps)
                if planned.fetch is None:
                    return RecallResult(base)
                future = planned.fetch
            fetched = future.result(timeout=self._remaining(pending))
            assert isinstance(fetched, _Fetched)
            self._publish(fetched.successor)
        except concurrent.futures.TimeoutError:
            future.cancel()
            late = RecallUnavailable(
                f"rows not back {self.timeout_s * 1000:.0f} ms after the fetch started "
                "(the recall deadline)",
                timed_out=True,
            )
            return RecallResult(self._unavailable(base, late, self._clock() - pending.started))
        except RecallUnavailable as exc:
            return RecallResult(self._unavailable(base, exc, self._clock() - pending.started))
        except _SuccessorRejected as exc:
            return RecallResult(replace(base, status=RecallStatus.FAILED, reason=str(exc)))
        rows, nbytes = self._adopt(fetched.successor, fetched.pages)
        outcome = replace(
            base,
            status=RecallStatus.RECALLED,
            rows=rows,
            nbytes=nbytes,
            latency_s=fetched.latency_s,
            successor=fetched.successor,
        )
        return RecallResult(outcome, fetched.pages)

    def _remaining(self, pending: _Pending) -> float:
        return max(self.timeout_s - (self._clock() - pending.started), 0.0)

    def _fetch_in_background(
        self, refs: tuple[PageRef, ...], state: KVPolicyState, generation: int, frontier: int
    ) -> _Fetched:
        """On a fetch thread: the rows, checked, and the successor built on them (pure: the
        session's own fields are only touched by `collect`, on the decode thread)."""
        started = self._clock()
        pages = self._fetch_pages(refs)
        latency = self._clock() - started
        _check_deadline(latency, self.timeout_s)
        return _Fetched(pages, self._build_successor(state, pages, generation, frontier), latency)

    def decode_step(self, model: CausalLM, cache: DecodeCache, token: int) -> RecallStep:
        """One step of this request alone in `cache`; raises RecallFailed when it fails."""
        if cache.request_ids != [self.request_id]:
            raise BoundInputInvalid(
                "cache", f"holds {cache.request_ids}, expected only {self.request_id!r}"
            )
        step = decode_with_recall(model, cache, [token], {self.request_id: self})
        outcome = step.outcomes[self.request_id]
        if outcome.status is RecallStatus.FAILED:
            raise RecallFailed(self.request_id, outcome.reason or "", timed_out=outcome.timed_out)
        return step

    def skipped(self) -> RecallOutcome:
        """The outcome of a step this session does not evaluate (not due, or disabled)."""
        status = RecallStatus.NOT_DUE if self.enabled else RecallStatus.DISABLED
        return RecallOutcome(self.request_id, self.steps, status)

    def choose(
        self, query: torch.Tensor, lse: torch.Tensor, head_to_owner: Sequence[int], scale: float,
        *, deferred: bool | None = None, logits: CodeLogits | None = None,
        page_lse: torch.Tensor | None = None,
    ) -> RecallChoice:
        """Pages to recall given one step's queries `[L, H_q, d_h]` and r `[L, H_q]`
        (`deferred`: the recall is deferred, None: as `defers()` says now; `logits`: the
        step's code logits when the value term computed them; `page_lse`: the codes ranking's
        page scores when computed as the step ran, `LayerScores`)."""
        assert self.policy is not None and self.summaries is not None
        strategy = self.strategy
        deferred = self.defers() if deferred is None else deferred
        if strategy.ranking is Ranking.CODES:
            return self._choose_by_codes(query, lse, head_to_owner, scale, deferred, logits,
                                         page_lse)
        midpoint = strategy.ranking is Ranking.MIDPOINT
        bound = bound_omitted_mass(
            self.summaries, query, lse, head_to_owner, live=self._live, scale=scale,
            estimate=midpoint,
        )
        policy, cap = self.policy, strategy.deferred_pages
        if cap is not None and deferred and cap < policy.max_pages_per_step:
            policy = replace(policy, max_pages_per_step=cap)
        return choose_pages(bound, policy, strategy.ranking, strategy.min_estimate)

    def _choose_by_codes(
        self, query: torch.Tensor, lse: torch.Tensor, head_to_owner: Sequence[int], scale: float,
        deferred: bool, logits: CodeLogits | None, page_lse: torch.Tensor | None,
    ) -> RecallChoice:
        """The codes ranking: pages by estimated log-odds (`page_code_log_odds`) above the
        strategy's floor, plus their successors. The page bound is computed only for the
        contract's full-recall gate; the contract's threshold (a bound) is not read: a step
        recalls when some page's estimate clears `min_estimate`."""
        assert self.policy is not None and self.summaries is not None
        policy, strategy = self.policy, self.strategy
        worst: float | None = None
        if policy.full_recall_threshold is not None:
            bound = bound_omitted_mass(self.summaries, query, lse, head_to_owner, live=self._live,
                                       scale=scale)
            worst = bound.max_mass_bound
            choice = choose_pages(bound, policy)
            if choice.full_recall:
                return choice
        cap = policy.max_pages_per_step
        if strategy.deferred_pages is not None and deferred:
            cap = min(cap, strategy.deferred_pages)
        if page_lse is None and logits is None and strategy.sketch_candidates is not None:
            odds = sketched_code_log_odds(self.summaries, query, lse, head_to_owner,
                                          strategy.sketch_candidates, live=self._live,
                                          scale=scale, width=strategy.sketch_width)
        else:
            odds = page_code_log_odds(self.summaries, query, lse, head_to_owner,
                                      live=self._live, scale=scale, logits=logits,
                                      page_lse=page_lse)
        pages = choose_estimated(odds, self._live, cap, strategy.min_estimate,
                                 self.summaries.page_segment, strategy.successor_pages)
        return RecallChoice(pages=pages, triggered=bool(pages.numel()), full_recall=False,
                            max_mass_bound=worst)

    def plan(self, query: torch.Tensor, lse: torch.Tensor, cache: DecodeCache) -> RecallPlan:
        """Step 2: bound and choose for the step just run, from its captured queries
        `[L, H_q, d_h]` and r `[L, H_q]` (this request's slot)."""
        return self._plan(query, lse, cache.head_to_owner, cache.scale, step=self.steps,
                          deferred=self.defers(), logits=self._term_logits())

    def _plan(
        self, query: torch.Tensor, lse: torch.Tensor, head_to_owner: Sequence[int], scale: float,
        *, step: int, deferred: bool, logits: CodeLogits | None,
        page_lse: torch.Tensor | None = None,
    ) -> RecallPlan:
        choice = self.choose(query, lse, head_to_owner, scale, deferred=deferred, logits=logits,
                             page_lse=page_lse)
        outcome = RecallOutcome(
            self.request_id,
            step,
            RecallStatus.BELOW_THRESHOLD,
            mass_bound=choice.max_mass_bound,
            full_recall=choice.full_recall,
        )
        if choice.pages.numel() == 0:
            return RecallPlan(outcome)
        assert self.summaries is not None
        return RecallPlan(replace(outcome, pages=choice.page_refs(self.summaries)))

    def prepare_term(self, cache: DecodeCache, *, fresh: bool) -> None:
        """Before a step: the cache holds this request's omitted-value term (if its manifest
        asks for one), computed afresh at this step when `fresh` (an evaluated step) or the
        strategy's `term_refresh_steps` says so."""
        term = self.value_term
        if term is None:
            return
        if not bool(self._live.any()):  # every page recalled: attention reads rows only
            if cache.has_omitted_term(self.request_id):
                cache.clear_omitted_term(self.request_id)
            return
        if not cache.has_omitted_term(self.request_id):
            term.bind(cache.head_to_owner, cache.scale)
            cache.set_omitted_term(self.request_id, term)
        strategy = self.strategy
        if strategy.term_ahead and self.defers():  # the planner computed it, never this thread
            term.begin_step(fresh=False, take_ahead=True)
            return
        term.begin_step(fresh=fresh or self.steps % strategy.term_refresh_steps == 0)

    def _term_logits(self) -> CodeLogits | None:
        """This step's code logits, if the value term computed them as the step's layers
        attended (from the same queries)."""
        term = self.value_term
        return None if term is None else term.step_logits()

    def recall(self, plan: RecallPlan, cache: DecodeCache) -> RecallResult:
        """Steps 3 and 4: fetch the planned pages, publish the successor through
        `on_successor`, adopt it. Nothing to fetch: the plan's outcome, unchanged."""
        base = plan.outcome
        if not plan.pages:
            return RecallResult(base)
        started = self._clock()
        try:
            pages = self._fetch_pages(plan.pages)
            latency = self._clock() - started
            _check_deadline(latency, self.timeout_s)
            successor = self._successor(pages, self._frontier_after_step(cache))
        except RecallUnavailable as exc:
            return RecallResult(self._unavailable(base, exc, self._clock() - started))
        except _SuccessorRejected as exc:
            return RecallResult(replace(base, status=RecallStatus.FAILED, reason=str(exc)))
        rows, nbytes = self._adopt(successor, pages)
        outcome = replace(
            base,
            status=RecallStatus.RECALLED,
            rows=rows,
            nbytes=nbytes,
            latency_s=latency,
            successor=successor,
        )
        return RecallResult(outcome, pages)

    def end_step(self, outcome: RecallOutcome) -> None:
        """Step 6: count the step this session's `outcome` describes. The one place the
        request's cache generation advances (its row, and the recall if it merged rows)."""
        self.steps += 1
        recalled = outcome.recalled
        self.cache_generation = cache_generation_after(self.cache_generation, recalled=recalled)

    def _fetch_pages(self, refs: tuple[PageRef, ...]) -> tuple[RecalledPage, ...]:
        assert self._fetch is not None and self.summaries is not None
        answer = tuple(self._fetch(refs, self.timeout_s))
        return _check_pages(self.summaries, refs, answer)

    def _frontier_after_step(self, cache: DecodeCache) -> int:
        """Committed tokens once this step is in: the cache's next position (cache positions
        count from the prompt's first token; the state adds `position_origin`)."""
        return int(cache.frontier()[cache.request_ids.index(self.request_id)])

    def _successor(self, pages: tuple[RecalledPage, ...], frontier: int) -> KVPolicyState:
        """State s + 1 for the cache after the recomputed step; published via the hook."""
        after = cache_generation_after(self.cache_generation, recalled=True)
        successor = self._build_successor(self.state, pages, after, frontier)
        self._publish(successor)
        return successor

    @staticmethod
    def _build_successor(
        state: KVPolicyState, pages: tuple[RecalledPage, ...], generation: int, frontier: int
    ) -> KVPolicyState:
        grid = recalled_position_grid(
            pages, state.num_layers, state.num_owners, origin=state.position_origin
        )
        return recall_successor(state, grid, cache_generation=generation, frontier=frontier)

    def _publish(self, successor: KVPolicyState) -> None:
        """Hand `successor` to `on_successor` (the fence) before the session adopts it."""
        if self._on_successor is None:
            return
        try:
            self._on_successor(successor)
        except RecallUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a rejected state fails this request only
            raise _SuccessorRejected(
                f"successor state rejected: {type(exc).__name__}: {exc}"
            ) from exc

    def _adopt(self, successor: KVPolicyState, pages: tuple[RecalledPage, ...]) -> tuple[int, int]:
        """Take the successor and mark the pages recalled; returns their rows and bytes."""
        assert self.summaries is not None
        self.state = successor
        for page in pages:
            self._live[self.summaries.global_index(page.ref)] = False
        if self.value_term is not None:  # before any step reads the term again (a rerun too)
            self.value_term.recount()
        rows = sum(int(page.positions.shape[0]) for page in pages)
        nbytes = sum(page.nbytes for page in pages)
        self.recalled_rows += rows
        self.recalled_bytes += nbytes
        return rows, nbytes

    def _unavailable(
        self, base: RecallOutcome, exc: RecallUnavailable, latency: float
    ) -> RecallOutcome:
        status = (
            RecallStatus.CONTINUED_LOSSY
            if self.fallback is TimeoutFallback.CONTINUE_LOSSY
            else RecallStatus.FAILED
        )
        return replace(
            base, status=status, reason=exc.reason, timed_out=exc.timed_out, latency_s=latency
        )


class ValueTermSource:
    """One request's omitted-value term, as its decode cache asks for it layer by layer
    (`OmittedTerm`): what the pages still omitted would add to attention, estimated from their
    row codes and page value means (`bound.layer_value_term`).

    Computed afresh, from the layer's own query, at every evaluated step (the step's recall
    plan then reads the code logits it computed instead of scoring again) and every
    `term_refresh_steps` of the strategy; in between each layer reuses its last term, with
    the pages recalled from that layer since taken out at once (`LayerTerm.without`: their
    masses as that query saw them; or the term computed afresh,
    `RecallStrategy.term_refresh_on_recall`). `live` is the session's tensor of pages still
    omitted (updated in place as pages are recalled, then `recount`)."""

    def __init__(self, summaries: PageSummaries, live: torch.Tensor, *,
                 refresh_on_recall: bool = False) -> None:
        _ = summaries.value_grid  # built at admission, not at the cue step
        self.summaries = summaries
        self._refresh_on_recall = refresh_on_recall
        self._live = live
        self._readers: torch.Tensor | None = None
        self._scale = 1.0
        layers = summaries.num_layers
        self._terms: list[LayerTerm | None] = [None] * layers
        # Each layer's live pages when its term was last updated: a recall takes pages out
        # of the terms of the layers it recalled from, and leaves the other layers' as they are.
        self._term_live = [-1] * layers
        self._fresh_layers: set[int] = set()  # layers computed afresh at this step
        self._fresh = True
        self._live_count = -1  # live pages when `_bias` and `_grid` were built
        self._layer_live: list[int] = [-1] * layers  # of them, each layer's
        self._bias: torch.Tensor | None = None  # `live_bias` of the live pages
        self._grid: torch.Tensor | None = None  # `live_grid` of the live pages
        self._ahead: AheadTerms | None = None  # computed beside the last evaluated step
        self._layer_inputs: list[TermInputs | None] = [None] * layers  # (`_inputs`)
        self._counted: torch.Tensor | None = None  # `live` when last counted

    def bind(self, head_to_owner: Sequence[int], scale: float) -> None:
        """The cache's query-head layout and attention scale."""
        self._readers = owner_readers(self.summaries, head_to_owner)
        self._scale = scale
        self._layer_inputs = [None] * self.summaries.num_layers

    def begin_step(self, *, fresh: bool, take_ahead: bool = False) -> None:
        """Before a step: compute every layer's term afresh (`fresh`) or reuse the last one;
        `take_ahead`: the terms computed beside the last evaluated step become the last ones
        when every layer of them is done (else they are dropped, never half taken)."""
        self._fresh = fresh
        self._fresh_layers = set()
        self.recount()
        ahead, self._ahead = self._ahead, None
        if take_ahead and ahead is not None and ahead.complete():
            for layer, term in enumerate(ahead.terms):
                self._terms[layer], self._term_live[layer] = term, ahead.layer_live[layer]

    def ahead(self) -> AheadTerms:
        """On the decode thread, before an evaluated step whose term is computed beside it:
        what the planner thread computes each layer's term with (the live pages now)."""
        assert self._readers is not None, "bind() first"
        self.recount()
        assert self._bias is not None
        batch = AheadTerms(self.summaries, self._readers, self._bias, self._scale,
                           list(self._layer_live))
        self._ahead = batch
        return batch

    def recount(self) -> int:
        """The live pages now; the pages recalled since the last count taken out of the live
        slot bias and page grid, in place (`take_out_pages`: the kernel inputs of every layer,
        views of them, stay valid). Pages are recalled on the decode thread between steps (the
        session recounts as it adopts them), never while a step runs or a term computed ahead
        is still being computed (the plan that waits for those is collected first), so the
        layer calls of a step read the count and never take it."""
        live = int(self._live.sum())
        if self._bias is None or self._grid is None or self._counted is None:
            self._bias = live_bias(self.summaries, self._live)
            self._grid = live_grid(self.summaries, self._live)
        elif live != self._live_count:
            take_out_pages(self.summaries, self._counted & ~self._live, self._bias, self._grid)
        else:
            return live
        self._counted = self._live.clone()
        self._live_count = live
        self._layer_live = self._grid.view(self.summaries.num_layers, -1).sum(dim=1).tolist()
        return live

    def __call__(self, layer: int, query: torch.Tensor) -> OmittedPart | None:
        return ValueTermSource.start_layer_parts(layer, [(self, query)])()[0]

    @staticmethod
    def start_layer_parts(
        layer: int, calls: Sequence[tuple[OmittedTerm, torch.Tensor]],
    ) -> Callable[[], list[OmittedPart | None]]:
        """Layer l's parts of several requests' terms (`OmittedTerm.start_layer_parts`): those
        computed afresh started on the kernel's thread (`bound.start_layer_value_terms`), the
        others reused; the function returned waits for them and keeps them."""
        parts: list[OmittedPart | None] = [None] * len(calls)
        fresh: dict[float, list[tuple[int, ValueTermSource, torch.Tensor]]] = {}
        for i, (source, query) in enumerate(calls):
            assert isinstance(source, ValueTermSource)
            if source._reuses(layer):
                parts[i] = source._keep(layer, source._reused(layer), fresh=False)
            elif source._live_count:
                fresh.setdefault(source._scale, []).append((i, source, query))
        started = [(group, start_layer_value_terms(
            [(source._inputs(layer), query) for _, source, query in group], scale))
            for scale, group in fresh.items()]

        def finish() -> list[OmittedPart | None]:
            for group, wait in started:
                for (i, source, _), term in zip(group, wait(), strict=True):
                    parts[i] = source._keep(layer, term, fresh=True)
            return parts

        return finish

    def _reuses(self, layer: int) -> bool:
        """Whether layer l's part is its last term (pages recalled since taken out), not one
        computed afresh (False too when nothing is omitted: no part at all)."""
        if self._live_count < 0:  # asked before any step began
            self.recount()
        if self._live_count == 0:
            return False
        term = self._terms[layer]
        recalled = self._term_live[layer] != self._layer_live[layer]
        return not (term is None or self._fresh or (recalled and self._refresh_on_recall))

    def _reused(self, layer: int) -> LayerTerm:
        term = self._terms[layer]
        assert term is not None
        if self._term_live[layer] != self._layer_live[layer]:  # pages recalled since
            assert self._grid is not None
            term = term.without(self.summaries, self._grid)
        return term

    def _inputs(self, layer: int) -> TermInputs:
        """Layer l's kernel inputs, kept until pages are recalled (`recount`)."""
        inputs = self._layer_inputs[layer]
        if inputs is None:
            assert self._readers is not None and self._bias is not None, "bind() first"
            inputs = term_inputs(self.summaries, layer, self._readers, self._bias)
            self._layer_inputs[layer] = inputs
        return inputs

    def _keep(self, layer: int, term: LayerTerm, *, fresh: bool) -> OmittedPart:
        if fresh:
            self._fresh_layers.add(layer)
        self._terms[layer], self._term_live[layer] = term, self._layer_live[layer]
        return term.log_mass, term.value

    def fresh_logits(self, layer: int) -> torch.Tensor | None:
        """Layer l's code logits `[H_owner, G, slots]` if its term was computed afresh at this
        step (from this step's query), else None."""
        term = self._terms[layer]
        return term.logits if term is not None and layer in self._fresh_layers else None

    def step_logits(self) -> CodeLogits | None:
        """The code logits every layer computed at this step (None unless all did)."""
        terms = self._terms
        if self._readers is None or len(self._fresh_layers) != len(terms):
            return None
        return CodeLogits(torch.cat([t.logits for t in terms if t is not None]), self._readers)


_ScoreWork = tuple[str, PageSummaries, int, torch.Tensor, "AheadTerms | None",
                   "ValueTermSource | None"]
"""A session `LayerScores` scores: request id, summaries, slot, readers, terms computed ahead
and its value term."""


class LayerScores:
    """One step's codes scoring for the sessions that score alongside it
    (`RecallSession.scores_alongside`): as each layer's attention is captured (`StepCapture.
    on_layer`), the planner thread scores that layer's segments of every such session's codes
    table (`bound.layer_page_lse`), while the decode thread runs the later layers. The
    sessions whose value term computed the layer's code logits (before the capture) are scored
    from those, not the table (the same scores to the bit), on the kernel's own thread
    (`bound.start_layer_page_lse`: no interpreter lock, no hand-off to the planner). The
    sessions' background plans, queued behind the layers, read the scores (`page_lse`)."""

    def __init__(self, sessions: Mapping[str, RecallSession], slots: Mapping[str, int],
                 cache: DecodeCache) -> None:
        self._scale = cache.scale
        self._work: list[_ScoreWork] = []
        for request_id, session in sessions.items():
            assert session.summaries is not None
            readers = owner_readers(session.summaries, cache.head_to_owner)
            term = session.value_term
            ahead = term.ahead() if term is not None and session.strategy.term_ahead else None
            self._work.append((request_id, session.summaries, slots[request_id], readers, ahead,
                               term))
        layers = cache.config.num_layers
        self._pages: dict[str, list[torch.Tensor | None]] = {
            request_id: [None] * layers for request_id in sessions
        }
        self._errors: dict[str, BaseException] = {}
        self._futures: list[concurrent.futures.Future[None]] = []
        # Layers scored on the kernel's thread: each layer, its sessions and the wait.
        self._started: list[tuple[int, list[str], Callable[[], list[torch.Tensor]]]] = []

    def submit(self, layer: int, query: torch.Tensor, lse: torch.Tensor) -> None:
        """`StepCapture.on_layer`: score `layer` from its queries `[B, H_q, d_h]` and r
        `[B, H_q]`: the sessions whose term computed the layer's code logits on the kernel's
        own thread (`bound.start_layer_page_lse`, started here), the others on the planner
        thread."""
        fresh, rest = [], []
        for work in self._work:
            term, ahead = work[5], work[4]
            logits = None if term is None or ahead is not None else term.fresh_logits(layer)
            if logits is None:
                rest.append(work)
            else:
                fresh.append((work, logits))
        if fresh:
            members = [work[0] for work, _ in fresh]
            try:
                wait = start_layer_page_lse(
                    [work[1] for work, _ in fresh], layer, [logits for _, logits in fresh],
                    lse, [work[2] for work, _ in fresh], [work[3] for work, _ in fresh])
            except Exception as exc:  # noqa: BLE001 - raised by those sessions' plans only
                for request_id in members:
                    self._errors[request_id] = exc
            else:
                self._started.append((layer, members, wait))
        if rest:
            self._futures.append(plan_pool().submit(self._score, rest, layer, query, lse))

    def _score(self, work: list[_ScoreWork], layer: int, query: torch.Tensor,
               lse: torch.Tensor) -> None:
        for request_id, summaries, slot, readers, ahead, term in work:
            try:
                if ahead is not None:
                    self._pages[request_id][layer] = ahead.layer(layer, query[slot], lse[slot])
                    continue
                self._pages[request_id][layer] = layer_page_lse(
                    summaries, layer, query[slot], lse[slot], readers, scale=self._scale,
                    logits=None if term is None else term.fresh_logits(layer),
                )
            except Exception as exc:  # noqa: BLE001 - raised by that session's plan only
                self._errors[request_id] = exc

    def page_lse(self, request_id: str) -> torch.Tensor:
        """The session's page scores of every layer `[S, slots / page_size]` (waits for the
        layers still being scored; on the one planner thread they are already done). On the
        planner thread only."""
        for future in self._futures:
            future.result()
        started, self._started = self._started, []
        for layer, members, wait in started:
            for member, pages in zip(members, wait(), strict=True):
                self._pages[member][layer] = pages
        error = self._errors.get(request_id)
        if error is not None:
            raise error
        parts = self._pages[request_id]
        missing = [layer for layer, part in enumerate(parts) if part is None]
        if missing:
            raise BoundInputInvalid("capture", f"layers {missing} were never captured")
        return torch.cat([part for part in parts if part is not None])


class AheadTerms:
    """One request's omitted-value terms computed on the planner thread from one evaluated
    step's queries, layer by layer as the step attends (`LayerScores`), for the steps after it
    (`RecallStrategy.term_ahead`); the layers' page scores for that step's plan come from the
    same code logits."""

    def __init__(self, summaries: PageSummaries, readers: torch.Tensor, bias: torch.Tensor,
                 scale: float, layer_live: list[int]) -> None:
        self.summaries, self.readers, self.bias, self.scale = summaries, readers, bias, scale
        self.layer_live = layer_live  # each layer's live pages the terms count
        self.terms: list[LayerTerm | None] = [None] * summaries.num_layers

    def complete(self) -> bool:
        return all(term is not None for term in self.terms)

    def layer(self, layer: int, query: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """On the planner thread: layer l's term from its queries `[H_q, d_h]`, kept, and the
        layer's page scores (`bound.layer_page_lse`, from the term's logits: the same values
        to the bit).  # [H_owner, slots / page_size] float32"""
        summaries = self.summaries
        term = layer_value_term(summaries, layer, query, self.readers, self.bias, self.scale)
        self.terms[layer] = term
        return layer_page_lse(summaries, layer, query, lse, self.readers, scale=self.scale,
                              logits=term.logits)


def decode_with_recall(
    model: CausalLM,
    cache: DecodeCache,
    tokens: Sequence[int] | torch.Tensor,
    sessions: Mapping[str, RecallSession],
) -> RecallStep:
    """One decode step for every request of `cache`, with recall for those in `sessions`.

    Requests without a session decode as plain `decode_step` would. A FAILED outcome does
    not stop the batch: its logits row is the lossy one and the caller ends that request.
    """
    slots = _session_slots(cache, sessions)
    outcomes: dict[str, RecallOutcome] = {}

    for request_id, session in sessions.items():  # deferred recalls: rows before the step
        if session.pending:
            result = session.collect()
            outcomes[request_id] = result.outcome
            if result.pages:
                merge_into_cache(cache, request_id, result.pages)
    due = {
        request_id: s
        for request_id, s in sessions.items()
        if s.due() and not _failed(outcomes.get(request_id))
    }
    for request_id, session in sessions.items():
        session.prepare_term(cache, fresh=request_id in due)
    alongside = {rid: s for rid, s in due.items() if s.scores_alongside()}
    scores = LayerScores(alongside, slots, cache) if alongside else None
    capture = StepCapture(on_layer=None if scores is None else scores.submit) if due else None
    logits = decode_step(model, cache, tokens, capture)
    for rid, s in sessions.items():
        if rid not in due and rid not in outcomes:
            outcomes[rid] = s.skipped()
    recalls: dict[str, tuple[RecalledPage, ...]] = {}
    for request_id, session in due.items():
        assert capture is not None
        slot = slots[request_id]
        query, lse = capture.query(slot), capture.log_sum_exp(slot)
        collected = outcomes.get(request_id)
        recalled_now = collected is not None and collected.recalled
        if session.defers() and session.strategy.plan_in_background:
            started = session.start_planning(query, lse, cache, recalled_now=recalled_now,
                                             scores=scores if request_id in alongside else None)
            outcomes[request_id] = _combine(collected, started)
            continue
        plan = session.plan(query, lse, cache)
        if session.defers():
            started = session.start(plan, cache, recalled_now=recalled_now)
            outcomes[request_id] = _combine(collected, started)
            continue
        result = session.recall(plan, cache)
        outcomes[request_id] = _combine(collected, result.outcome)
        if result.pages:
            recalls[request_id] = result.pages
    if recalls:
        cache.undo_step()
        for request_id, pages in recalls.items():
            merge_into_cache(cache, request_id, pages)
        logits = decode_step(model, cache, tokens)
    for request_id, session in sessions.items():
        session.end_step(outcomes[request_id])
    return RecallStep(logits, outcomes, recomputed=bool(recalls))


def _failed(outcome: RecallOutcome | None) -> bool:
    return outcome is not None and outcome.status is RecallStatus.FAILED


def _combine(collected: RecallOutcome | None, planned: RecallOutcome) -> RecallOutcome:
    """One step's outcome when it both merged a deferred recall (`collected`) and planned:
    the collected one (that is what changed the cache), naming the pages now in flight."""
    if collected is None:
        return planned
    if planned.status is RecallStatus.PLANNING:  # nothing known of the new plan yet
        return collected
    return replace(collected, fetching=planned.fetching, mass_bound=planned.mass_bound)


def merge_into_cache(cache: DecodeCache, request_id: str, pages: Sequence[RecalledPage]) -> None:
    """Append recalled rows to their (layer, owner) at their original positions: one write
    for every owner (an owner's pages in the order given)."""
    ordered = sorted(pages, key=lambda p: (p.ref.layer, p.ref.owner))  # stable
    counts = torch.zeros(cache.config.num_layers, cache.num_owners, dtype=torch.long)
    for page in ordered:
        counts[page.ref.layer, page.ref.owner] += int(page.positions.shape[0])
    cache.append_owner_rows(
        request_id,
        counts,
        torch.cat([p.k for p in ordered]),  # [n, d_h]
        torch.cat([p.v for p in ordered]),  # [n, d_h]
        torch.cat([p.positions for p in ordered]),  # [n]
    )


@dataclass(frozen=True)
class RecallKnobs:
    """The recall fields of a recoverability contract, as one tunable unit."""

    threshold: float
    page_size: int
    max_pages_per_step: int
    cadence_steps: int
    timeout_ms: int = 200
    fallback: TimeoutFallback = TimeoutFallback.CONTINUE_LOSSY
    full_recall_gate: float | None = None
    code_bits: int | None = None  # row codes with the summaries (`key_code_bits`)
    value_term: bool = False  # page value means and the omitted-value term (needs code_bits)

    def contract(self, mode: RecoverabilityMode) -> RecoverabilityContract:
        """A recallable contract with these knobs (validated by the manifest's rules)."""
        return RecoverabilityContract(
            mode=mode,
            recall_threshold=self.threshold,
            page_size=self.page_size,
            max_pages_per_step=self.max_pages_per_step,
            recall_cadence_steps=self.cadence_steps,
            recall_timeout_ms=self.timeout_ms,
            timeout_fallback=self.fallback,
            full_recall_on_quality_gate=self.full_recall_gate,
            key_code_bits=self.code_bits,
            omitted_value_term=True if self.value_term else None,
        )


# Tuned with `kvrelay eval recall --tune` (services/evaluation/recall_eval.py, `TuneConfig`) on
# tuning seeds disjoint from the evaluation's (32 prompts from seed 9500000): placement (b),
# 25% budget, 1K context, SnapKV uniform, on the trained demo checkpoint. Without recall SnapKV
# answers 3.1% (full cache 100%). Every threshold from 0.9 to 0.9999 gave the same result (the
# page bound is loose: owner log-odds sit far above any of them), so the threshold is the
# middle one; page size x pages/step sets the recalled share. 8-row pages, 8 per step, every
# step: 100% accurate while recalling 2.1% of the omitted rows, the smallest share of all the
# settings that closed the whole gap (16x8 and 8x16: 4.1%; 32x8: 7.8%). Cadence 2 skips the
# cue's last step, the one that reads the needle. Re-tune when the checkpoint changes.
DEFAULT_RECALL_KNOBS = RecallKnobs(
    threshold=0.99, page_size=8, max_pages_per_step=8, cadence_steps=1
)
# With row codes (`CODES_STRATEGY` ranks by them): 4-bit codes, 16 pages a step at most (8
# ranked, each with its successor), every second step evaluated. 2-bit codes did as well at
# 4K but found one needle fewer at 8K and 10% (1 of 3 tuning prompts; 4 bits and exact keys 2).
# Chosen with
# `kvrelay eval recall --suite ruler` on SmolLM2-135M-Instruct, tuning prompts only
# (docs/results/recall-smollm2/tuning.md, "Row codes"). The threshold is not read by the codes
# ranking (its floor is the strategy's `min_estimate`); it stays the default's.
CODES_RECALL_KNOBS = replace(DEFAULT_RECALL_KNOBS, code_bits=4, max_pages_per_step=16,
                             cadence_steps=2)
# The codes' knobs with the omitted-value term: every page also carries its mean value row
# (d_h values a page on the wire and on the decode host) and each step's attention adds the
# still-omitted pages' estimated mass carrying them (`ValueTermSource`).
VALUES_RECALL_KNOBS = replace(CODES_RECALL_KNOBS, value_term=True)


def with_recall(
    manifest: KVVisibilityPolicyManifest,
    knobs: RecallKnobs = DEFAULT_RECALL_KNOBS,
    *,
    mode: RecoverabilityMode = RecoverabilityMode.RECALLABLE_REMOTE,
    name: str | None = None,
) -> KVVisibilityPolicyManifest:
    """`manifest` with recallable omitted rows: a new manifest (and identity) named `name`,
    by default `<name>-recall`."""
    name = name or f"{manifest.name}-recall"
    return replace(
        manifest,
        name=name,
        policy_manifest_id=f"{name}@{manifest.policy_generation}",
        recoverability=knobs.contract(mode),
    )


def _check_session(
    manifest: KVVisibilityPolicyManifest,
    summaries: PageSummaries | None,
    fetch: PageFetcher | None,
    state: KVPolicyState,
) -> None:
    if state.manifest_sha256 != manifest.sha256:
        raise BoundInputInvalid("state.manifest_sha256", "names another manifest")
    contract = manifest.recoverability
    if not contract.recallable:
        return
    if summaries is None or fetch is None:
        raise BoundInputInvalid("summaries", f"{contract.mode.value} needs summaries and a fetcher")
    tensor = manifest.tensor
    expected = (tensor.num_layers, manifest.num_owners, tensor.head_dim, contract.page_size)
    actual = (summaries.num_layers, summaries.num_owners, summaries.head_dim, summaries.page_size)
    if actual != expected:
        raise SummaryInvalid(
            "summaries", f"[L, H_owner, d_h, page_size] = {actual}, the manifest says {expected}"
        )
    if (state.num_layers, state.num_owners) != expected[:2]:
        raise BoundInputInvalid(
            "state.selected_positions", f"grid is not [L][H_owner] {expected[:2]}"
        )


def _session_slots(cache: DecodeCache, sessions: Mapping[str, RecallSession]) -> dict[str, int]:
    slots = {}
    for request_id, session in sessions.items():
        if request_id not in cache.request_ids:
            raise BoundInputInvalid("sessions", f"{request_id!r} is not in the cache")
        summaries = session.summaries
        if summaries is not None and summaries.num_owners != cache.num_owners:
            raise BoundInputInvalid(
                "sessions",
                f"{request_id!r} has {summaries.num_owners} owners per layer, "
                f"the cache {cache.num_owners}",
            )
        slots[request_id] = cache.request_ids.index(request_id)
    return slots


def _check_deadline(latency_s: float, timeout_s: float) -> None:
    if latency_s > timeout_s:
        raise RecallUnavailable(
            f"rows came back after {latency_s * 1000:.1f} ms, deadline {timeout_s * 1000:.0f} ms",
            timed_out=True,
        )


def _check_pages(
    summaries: PageSummaries, refs: tuple[PageRef, ...], answer: tuple[RecalledPage, ...]
) -> tuple[RecalledPage, ...]:
    """The answer in `refs` order; RecallUnavailable if a page is missing, repeated, not
    asked for, or its rows do not match its summary (such rows are never merged)."""
    by_ref = {page.ref: page for page in answer}
    if len(by_ref) != len(answer) or set(by_ref) != set(refs):
        missing = len(set(refs) - set(by_ref))
        raise RecallUnavailable(
            f"asked for {len(refs)} pages, got {len(answer)} ({missing} missing)"
        )
    for ref in refs:
        _check_page(summaries, by_ref[ref])
    return tuple(by_ref[ref] for ref in refs)


def _check_page(summaries: PageSummaries, page: RecalledPage) -> None:
    index = summaries.global_index(page.ref)
    first, count = int(summaries.page_first[index]), int(summaries.page_count[index])
    expected = torch.arange(first, first + count)
    shape = (count, summaries.head_dim)
    if (
        tuple(page.k.shape) != shape
        or tuple(page.v.shape) != shape
        or page.positions.shape != expected.shape
        or not torch.equal(page.positions.long(), expected)
        or not bool(torch.isfinite(page.k).all())
    ):
        raise RecallUnavailable(f"rows of page {page.ref} do not match its summary")
    means = summaries.page_value_mean
    if means is not None and not value_mean_matches(means[index : index + 1], page.v,
                                                    torch.tensor([count])):
        raise RecallUnavailable(f"values of page {page.ref} do not average to its summary's mean")
