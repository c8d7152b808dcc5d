"""Decode-time retention on the decode worker (issue 18): one `RetentionSession` per request
whose manifest declares `selection.retention`, driven by the decode loop after every step.

The per-step contract (the order is part of it; the pure decisions are
`services.kvpolicy.retention`'s):

1. append: the step's K/V row went into every owner during the forward (`decode_step`), an
   unpublished candidate; the session appends its position to the score state;
2. attend: the forward attended over every candidate row, and the cache captured each
   owner's probabilities (`DecodeCache.step_attention`, the request's `RowContract`);
3-5. `decide`: update the method's score state, protect the recent partition and sinks,
   select down to the budget — pure, nothing is touched;
6-7. `commit`: evict the dropped rows from the cache (`DecodeCache.drop_owner_rows`, which
   compacts K, V and positions with the same kept indices the score state is gathered with,
   and frees pages), adopt the successor score state; the local generation and the cache generation
   advance by one. A step abandoned before `commit` (the caller takes it back with
   `DecodeCache.undo_step`) leaves neither a row nor score state behind.

Publication: the policy service is told on the manifest's cadence (`publishes_after`: every N
steps and at the end), through the same compare-and-publish hook recall uses
(`decode_worker.recall.SuccessorPublisher`, phase DECODING). Each publication is one fenced
successor of the last published state (state generation + 1, parent = the last published
one); the local generation counts committed steps. A worker that dies between publications
loses only its local successors: the last published state stays what the fence holds.
A publication the policy service cannot take now (unavailable) is retried at the next
cadence point; one it refuses (stale: the request was fenced out) ends the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.kvpolicy.retention import (
    PAD_POSITION,
    Retained,
    ScoreState,
    append,
    new_state,
    state_bytes_per_row,
    step,
)
from services.kvpolicy.retention_contract import PositionContract, RetentionContract, ScoreOwner
from services.kvpolicy.state import KVPolicyState
from services.model.kvcache import DecodeCache
from services.model.row_attention import RowContract
from services.offload.errors import RecallUnavailable

log = logging.getLogger(__name__)

SuccessorHook = Callable[[KVPolicyState], None]
_REDUCTION = {ScoreOwner.KV_HEAD_MEAN: "mean", ScoreOwner.KV_HEAD_MAX: "max",
              ScoreOwner.QUERY_HEAD: "mean"}  # query_head: one query head per owner


def row_contract(contract: RetentionContract) -> RowContract:
    """How the cache stores and reads a retaining request's rows: its position contract, and
    its attention captured (reduced as `score_owner` declares) when the method scores."""
    positions = "cache_local" if contract.positions is PositionContract.CACHE_LOCAL else "original"
    capture = _REDUCTION[contract.score_owner] if contract.method.scores else None
    return RowContract(positions=positions, capture=capture)


@dataclass(frozen=True)
class RetentionStep:
    """What one committed step did: rows evicted, the most rows any owner holds after it,
    whether the cadence made it a publication step (`due`) and the state published with it
    (None: not due, or the policy service could not take it)."""

    step: int
    evicted_rows: int
    resident_max: int
    due: bool = False
    published: KVPolicyState | None = None


@dataclass(frozen=True)
class RetentionLedger:
    """What a retaining request's decode held, for its summary: the prompt view's selection
    method and the decode-time policy (both, when composed: e.g. SnapKV + H2O), the budget and
    the most rows any owner held after a step, score-state bytes per row, the cache layout."""

    prompt_method: str
    decode_method: str
    positions: str
    budget_rows: int
    resident_max: int
    score_state_bytes_per_row: int
    score_state_bytes: int
    layout: str
    evicted_rows: int
    publications: int


class RetentionSession:
    """Decode-time retention of one request (runtime state, loop thread only).

    `state` is the state the decode worker verified (the last published one, at first);
    `on_successor` publishes a successor through the policy service's fence (see the module
    docstring); without it nothing is published (tests, tools).
    """

    def __init__(self, manifest: KVVisibilityPolicyManifest, contract: RetentionContract,
                 state: KVPolicyState, on_successor: SuccessorHook | None = None) -> None:
        self.contract = contract
        self.prompt_method = manifest.selection.method.value
        self.published = state
        self.request_id = state.request_id
        self.cache_generation = state.cache_generation
        self.generation = 0  # committed steps (local successors) since admission
        self.steps = 0
        self.evicted_rows = 0
        self.resident_max = 0
        self.publications = 0
        self._on_successor = on_successor
        self._scores: ScoreState | None = None
        self._unpublished = False  # a committed step the policy service has not seen

    @property
    def row_contract(self) -> RowContract:
        return row_contract(self.contract)

    @property
    def scores(self) -> ScoreState | None:
        """The committed score state (None before `admitted`)."""
        return self._scores

    def admitted(self, cache: DecodeCache) -> None:
        """The request's view is in `cache` (before its first step): score state for its rows,
        every (layer, owner) flattened, no evidence yet."""
        lengths = cache.lengths(self.request_id).reshape(-1)  # [L * H]
        positions = torch.full((lengths.numel(), max(int(lengths.max()), 1)), PAD_POSITION,
                               dtype=torch.int64)
        owners = cache.num_owners
        for n in range(lengths.numel()):
            held = cache.rows(self.request_id, n // owners, n % owners)[2]
            positions[n, : held.numel()] = held.cpu().long()
        self._scores = new_state(self.contract, positions, lengths)

    def decide(self, cache: DecodeCache) -> Retained:
        """Steps 1-5 for the step the cache just ran: pure (the cache and the session's state
        are untouched; drop the result to abandon the step)."""
        held = self._scores
        assert held is not None, "admitted() runs before the first step"
        slot = cache.request_ids.index(self.request_id)
        new = torch.full((held.lengths.shape[0],), int(cache.frontier()[slot]) - 1,
                         dtype=torch.int64)
        candidates = append(self.contract, held, new)
        attn = self._attention(cache, candidates) if self.contract.method.scores else None
        return step(self.contract, candidates, attn, self.steps)

    def commit(self, cache: DecodeCache, retained: Retained, last: bool = False) -> RetentionStep:
        """Steps 6-7: evict what `retained` drops (the same indices its state was gathered
        with), adopt the successor, publish on the cadence (`last`: the request's final step)."""
        dropped = retained.dropped  # [L * H, R] over the candidates: the rows each owner holds
        cache.drop_owner_rows(self.request_id, dropped.view(-1, cache.num_owners, dropped.shape[1]),
                              room=1)
        self._scores = retained.state
        evicted = int(dropped.sum())
        resident = int(retained.lengths.max())
        self.evicted_rows += evicted
        self.resident_max = max(self.resident_max, resident)
        self.generation += 1
        self.cache_generation += 1
        self._unpublished = True
        index, self.steps = self.steps, self.steps + 1
        due = self.contract.publishes_after(index, last)
        return RetentionStep(index, evicted, resident, due, self._publish(cache) if due else None)

    def finish(self, cache: DecodeCache) -> str | None:
        """The request ended: publish its last committed state unless the policy service has
        it already -> "published", "unavailable", or None (nothing new to publish).
        StaleGeneration when the fence refuses it."""
        if not self._unpublished:
            return None
        return "published" if self._publish(cache) is not None else "unavailable"

    def successor(self, cache: DecodeCache) -> KVPolicyState:
        """The committed state as a successor of the last published one."""
        assert self._scores is not None
        positions, lengths = self._scores.positions.tolist(), self._scores.lengths.tolist()
        owners = cache.num_owners
        grid = [[positions[layer * owners + h][: lengths[layer * owners + h]]
                 for h in range(owners)] for layer in range(len(positions) // owners)]
        parent = self.published
        frontier = int(cache.frontier()[cache.request_ids.index(self.request_id)])
        budgets = [[self.contract.budget_rows] * owners for _ in grid]
        return parent.successor(selected_positions=grid, frontier=frontier - parent.position_origin,
                                cache_generation=self.cache_generation,
                                protected_positions=_shared_sinks(grid, self.contract.sinks),
                                owner_budgets=budgets)

    def ledger(self, cache: DecodeCache) -> RetentionLedger:
        per_row = state_bytes_per_row(self.contract)
        rows = int(self._scores.lengths.sum()) if self._scores is not None else 0
        return RetentionLedger(
            self.prompt_method, self.contract.method.value, self.contract.positions.value,
            self.contract.budget_rows, self.resident_max, per_row, per_row * rows,
            cache.ledger(self.request_id).layout, self.evicted_rows, self.publications)

    def _publish(self, cache: DecodeCache) -> KVPolicyState | None:
        successor = self.successor(cache)
        if self._on_successor is not None:
            try:
                self._on_successor(successor)
            except RecallUnavailable as exc:  # the policy service is away: retry later
                log.warning("retention of %s: successor not published: %s", self.request_id, exc)
                return None
        self.published, self._unpublished = successor, False
        self.publications += 1
        return successor

    def _attention(self, cache: DecodeCache, candidates: ScoreState) -> torch.Tensor:
        """The step's captured probabilities as [L * H, R] over the candidate rows."""
        seen = cache.step_attention(self.request_id)
        owners = cache.num_owners
        attn = torch.zeros(candidates.positions.shape, dtype=torch.float32)
        for layer, probs in enumerate(seen.probs):
            width = min(probs.shape[1], attn.shape[1])
            attn[layer * owners:(layer + 1) * owners, :width] = probs[:, :width].cpu()
        return attn


def _shared_sinks(grid: list[list[list[int]]], sinks: int) -> tuple[int, ...]:
    """The sink positions when every owner's first `sinks` rows are the same positions (else
    none are published as protected: a per-owner sink is not a shared protected position)."""
    if not sinks:
        return ()
    first = tuple(grid[0][0][:sinks])
    same = all(tuple(owner[:sinks]) == first for layer in grid for owner in layer)
    return first if same else ()

