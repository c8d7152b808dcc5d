"""The compression core: a prompt's prefill tensors and a manifest → the packed view, the state
it realizes, its receipt and its ledger. The one entry point the prefill worker, the
evaluations, the benchmarks, the demo and the tests share; pure (no I/O, no model).

    compressed = compress(manifest, prefill, StateIdentity(request_id, request_generation),
                          profile=head_profile_tensor)

      score     SnapKV owner scores `[L, H_owner, T - W_obs]` from the observation window
                (static policies score nothing)
      allocate  integer prefix budgets `[L][H_owner]`, exactly conserved (uniform, PyramidKV,
                Ada-KV, HeadKV, ZigZagKV; `services.kvpolicy.allocation`)
      select    top-budget rows per owner plus the protected sinks and observation suffix, or
                the static set (window, sink-recent, full)
      pack      gather the retained rows into a `PackedKVView`, bind them to the first state of
                the request (state 1, parent 0, cache generation 1, each owner's row capacity as
                its budget) with a receipt (positions, budgets, payload digest, checked against
                the source cache the rows came from), and account the bytes (`Ledger`)

Each stage is also public, so a caller can reuse one prompt's scores for several budgets (the
quality sweeps) or check one stage alone (the tests). `compress(..., observe=...)` lets the
prefill worker put each stage in its own span and timer without this module knowing about
telemetry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from services.kvpolicy import allocation, packing, snapkv
from services.kvpolicy.allocation import BudgetGrid
from services.kvpolicy.errors import SelectionError
from services.kvpolicy.ledger import Ledger, ledger_for
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    SelectionContract,
    SelectionMethod,
)
from services.kvpolicy.packing import PackedKVView, SourceCache
from services.kvpolicy.receipt import Receipt, make_receipt
from services.kvpolicy.state import KVPolicyState, PositionGrid
from services.kvpolicy.static import static_protected_positions, static_selection

# The first published state of a request: successor of the empty state 0, holding the
# prompt's cache image (cache generation 1); decode-side appends advance it from there.
FIRST_STATE_GENERATION = 1
FIRST_CACHE_GENERATION = 1

# Span names of the stages (DESIGN §8), in order.
STAGES = ("kv.score", "kv.allocate", "kv.select", "kv.pack")

Observe = Callable[[str], contextlib.AbstractContextManager[object]]


class PrefillTensors(Protocol):
    """What compression reads from a prompt's prefill (`services.model.PrefillResult`)."""

    @property
    def source_k(self) -> torch.Tensor: ...  # [L, H_kv, T, d_h], keys post-RoPE

    @property
    def source_v(self) -> torch.Tensor: ...  # [L, H_kv, T, d_h]

    @property
    def observation(self) -> torch.Tensor | None: ...  # [L, H_q, W_obs, T] fp32, if kept

    # Also read, when the object has it: `observation_vote`, the runtime's per-layer reduction
    # of the observation (`snapkv.WindowVote`), which scoring takes instead of the observation.

    @property
    def prompt_length(self) -> int: ...


@dataclass(frozen=True)
class StateIdentity:
    """The request the compressed state belongs to (the gateway's BeginRequest answer)."""

    request_id: str
    request_generation: int


@dataclass(frozen=True)
class Selection:
    """Retained positions `[L][H_owner]`, the protected positions every owner keeps, and the
    prefix budgets they were selected under (None for static policies)."""

    positions: PositionGrid
    protected: tuple[int, ...]
    budgets: BudgetGrid | None


@dataclass(frozen=True)
class Compressed:
    """One compression: what was selected, the packed view, the state it realizes, its
    receipt and its ledger (before any offload charges)."""

    selection: Selection
    view: PackedKVView
    state: KVPolicyState
    receipt: Receipt
    ledger: Ledger


def observation_window(manifest: KVVisibilityPolicyManifest) -> int:
    """W_obs the manifest scores with (0 for static policies: nothing to capture)."""
    params = manifest.selection.snapkv
    return params.observation_window if params is not None else 0


def uses_scores(manifest: KVVisibilityPolicyManifest) -> bool:
    return manifest.selection.method is SelectionMethod.SNAPKV


def score(manifest: KVVisibilityPolicyManifest, prefill: PrefillTensors) -> torch.Tensor | None:
    """SnapKV owner scores `[L, H_owner, T - W_obs]`; None for static policies."""
    if not uses_scores(manifest):
        return None
    voted = getattr(prefill, "observation_vote", None)
    evidence = voted if voted is not None else prefill.observation
    if evidence is None:
        raise SelectionError("observation", "the prefill kept neither observation nor its vote")
    return snapkv.score(manifest, evidence, prefill.prompt_length)


def allocate(
    manifest: KVVisibilityPolicyManifest,
    prompt_len: int,
    scores: torch.Tensor | None,
    profile: torch.Tensor | None = None,
) -> BudgetGrid | None:
    """Integer prefix budgets `[L][H_owner]`, exactly conserved; None for static policies.
    `profile`: the HeadKV importance tensor `[L, H_owner]` the manifest names (HeadKV only;
    `services.kvpolicy.head_profile.profile_tensor` finds it)."""
    if scores is None:
        return None
    return allocation.allocate(manifest, prompt_len, scores, profile)


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


def owner_capacities(
    manifest: KVVisibilityPolicyManifest, prompt_len: int, budgets: BudgetGrid | None
) -> BudgetGrid:
    """Rows each (layer, owner) may retain, `[L][H_owner]`: what the state and its receipt
    bind and every hop checks. SnapKV: the allocator's prefix budget plus the protected rows
    (sinks and observation suffix); a static policy: its rule's own count."""
    if uses_scores(manifest):
        if budgets is None:
            raise SelectionError("budgets", "SnapKV row capacities need the allocator's budgets")
        protected = len(snapkv.protected_positions(manifest, prompt_len))
        return tuple(tuple(budget + protected for budget in row) for row in budgets)
    count = static_row_count(manifest.selection, prompt_len)
    return tuple((count,) * manifest.num_owners for _ in range(manifest.tensor.num_layers))


def static_row_count(selection: SelectionContract, frontier: int) -> int:
    """Rows a static policy keeps of `frontier` committed ones: full every row, a window its
    width, sink + recent both (never more than there are)."""
    if selection.method is SelectionMethod.FULL:
        return frontier
    window = selection.recent_window
    if window is None:
        raise SelectionError("selection.method", f"{selection.method.value} is not a static policy")
    if selection.method is SelectionMethod.SLIDING_WINDOW:
        return min(window, frontier)
    return min(selection.protected.sinks + window, frontier)


def first_state(
    manifest: KVVisibilityPolicyManifest,
    identity: StateIdentity,
    frontier: int,
    selection: Selection,
) -> KVPolicyState:
    """State 1 of a request (parent 0, cache generation 1): the prompt's compressed image,
    each owner's row capacity its budget (so the state refuses a selection over it)."""
    return KVPolicyState(
        request_id=identity.request_id,
        manifest_sha256=manifest.sha256,
        request_generation=identity.request_generation,
        state_generation=FIRST_STATE_GENERATION,
        parent_state_generation=FIRST_STATE_GENERATION - 1,
        cache_generation=FIRST_CACHE_GENERATION,
        frontier=frontier,
        selected_positions=selection.positions,
        protected_positions=selection.protected,
        owner_budgets=owner_capacities(manifest, frontier, selection.budgets),
    )


def pack(
    manifest: KVVisibilityPolicyManifest,
    prefill: PrefillTensors,
    selection: Selection,
    identity: StateIdentity,
) -> Compressed:
    """Gather the retained rows from the prompt's cache image (cache generation 1), bind them
    to state 1 with a receipt, and account the bytes."""
    owner_map = manifest.expanded_owner_map
    source = SourceCache(prefill.source_k, prefill.source_v, FIRST_CACHE_GENERATION)
    state = first_state(manifest, identity, prefill.prompt_length, selection)
    view = packing.materialize(state, source, owner_map)
    receipt = make_receipt(manifest, state, view, source=source.identity)
    ledger = ledger_for(manifest, prefill.prompt_length, selection.positions)
    return Compressed(selection, view, state, receipt, ledger)


def compress(
    manifest: KVVisibilityPolicyManifest,
    prefill: PrefillTensors,
    identity: StateIdentity,
    *,
    profile: torch.Tensor | None = None,
    observe: Observe = lambda _stage: contextlib.nullcontext(),
) -> Compressed:
    """score → allocate → select → pack. `observe(stage)` wraps each stage (a span and a
    timer in the prefill worker; nothing by default)."""
    prompt_len = prefill.prompt_length
    with observe("kv.score"):
        scores = score(manifest, prefill)
    with observe("kv.allocate"):
        budgets = allocate(manifest, prompt_len, scores, profile)
    with observe("kv.select"):
        selection = select(manifest, prompt_len, scores, budgets)
    with observe("kv.pack"):
        return pack(manifest, prefill, selection, identity)
