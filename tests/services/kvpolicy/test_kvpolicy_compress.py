"""The compression core: `compress` is its stages composed, binds the first state of the
request it is given, gathers exactly the selected rows (symbolic K/V), and reports each stage
to `observe` in order."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from kv_helpers import symbolic_kv

from services.kvpolicy.compress import (
    STAGES,
    StateIdentity,
    allocate,
    compress,
    owner_capacities,
    pack,
    score,
    select,
)
from services.kvpolicy.errors import PackingError, SelectionError, StateInvalid
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.kvpolicy.receipt import verify_receipt

L, H_Q, H_KV, D, T, W = 2, 4, 2, 4, 40, 8
IDENTITY = StateIdentity("req-compress", 7)


@dataclass(frozen=True)
class Prefill:
    source_k: torch.Tensor  # [L, H_kv, T, d_h]
    source_v: torch.Tensor
    observation: torch.Tensor  # [L, H_q, W, T]

    @property
    def prompt_length(self) -> int:
        return int(self.source_k.shape[2])


def prefill(seed: int = 0) -> Prefill:
    k, v = symbolic_kv(L, H_KV, T, D)
    attn = torch.rand(L, H_Q, W, T, generator=torch.Generator().manual_seed(seed))
    return Prefill(k, v, attn / attn.sum(-1, keepdim=True))


def manifests() -> dict[str, KVVisibilityPolicyManifest]:
    contract = TensorContract(L, H_Q, H_KV, D, DType.FLOAT32, DType.FLOAT32)
    return default_manifests(contract, budget_fraction=0.3, observation_window=W, recent_window=12,
                             sinks=2)


@pytest.mark.parametrize("name", sorted(manifests()))
def test_compress_is_its_stages_composed(name: str) -> None:
    manifest, source = manifests()[name], prefill()
    scores = score(manifest, source)
    selection = select(manifest, T, scores, allocate(manifest, T, scores))
    staged = pack(manifest, source, selection, IDENTITY)
    once = compress(manifest, source, IDENTITY)
    assert (once.selection, once.state, once.receipt, once.ledger) == (
        staged.selection, staged.state, staged.receipt, staged.ledger)
    assert torch.equal(once.view.packed_k, staged.view.packed_k)
    assert torch.equal(once.view.packed_v, staged.view.packed_v)
    verify_receipt(once.receipt, manifest_sha256=manifest.sha256, view=once.view)
    state = once.state
    assert (state.request_id, state.request_generation) == (IDENTITY.request_id, 7)
    assert (state.state_generation, state.parent_state_generation, state.cache_generation) == (1, 0, 1)
    assert state.frontier == T and state.selected_positions == selection.positions


@pytest.mark.parametrize("name", ["snapkv", "snapkv-pyramid", "window"])
def test_the_view_holds_exactly_the_selected_rows(name: str) -> None:
    manifest, source = manifests()[name], prefill(seed=3)
    compressed = compress(manifest, source, IDENTITY)
    view = compressed.view
    for layer, owners in enumerate(compressed.selection.positions):
        for head, positions in enumerate(owners):
            rows = view.rows(layer, head)
            expected_k = source.source_k[layer, head, list(positions)]  # [n, d_h]
            assert torch.equal(view.packed_k[rows], expected_k)
            assert torch.equal(view.packed_v[rows], expected_k + 5000)
            assert view.original_position_map[rows].tolist() == list(positions)
    assert compressed.ledger.visible_rows == view.total_rows


def test_observe_wraps_every_stage_in_order() -> None:
    seen: list[str] = []

    @contextlib.contextmanager
    def observe(stage: str) -> Iterator[None]:
        seen.append(stage)
        yield
        seen.append(f"/{stage}")

    compress(manifests()["snapkv"], prefill(), IDENTITY, observe=observe)
    assert seen == [s for stage in STAGES for s in (stage, f"/{stage}")]


# --- issue 14: owner budgets on the real path, the source cache ------------------------------


def expected_capacity(manifest: KVVisibilityPolicyManifest, budget: int | None) -> int:
    """Each owner's row capacity for T = 40, W = 8, window 12, worked by hand."""
    method, sinks = manifest.selection.method.value, manifest.selection.protected.sinks
    if method == "snapkv":
        assert budget is not None
        return budget + sinks + W  # prefix budget + sinks + observation suffix
    assert sinks == (2 if method == "sink_recent" else 0)
    return {"full": T, "sliding_window": 12, "sink_recent": 2 + 12}[method]


@pytest.mark.parametrize("name", sorted(manifests()))
def test_the_state_and_receipt_bind_each_owners_row_capacity(name: str) -> None:
    manifest = manifests()[name]
    compressed = compress(manifest, prefill(), IDENTITY)
    budgets = compressed.selection.budgets
    capacities = owner_capacities(manifest, T, budgets)
    assert compressed.state.owner_budgets == compressed.receipt.owner_budgets == capacities
    for layer, row in enumerate(capacities):
        for owner, capacity in enumerate(row):
            budget = None if budgets is None else budgets[layer][owner]
            assert capacity == expected_capacity(manifest, budget)
            assert len(compressed.selection.positions[layer][owner]) <= capacity


@pytest.mark.parametrize("name", ["snapkv", "window", "sink-recent"])
def test_prefill_refuses_a_selection_over_an_owners_capacity(name: str) -> None:
    """One more row than the owner may hold (layer 1, owner 0): compression refuses to bind
    it, naming the owner, before any view exists."""
    manifest, source = manifests()[name], prefill()
    scores = score(manifest, source)
    budgets = allocate(manifest, T, scores)
    selection = select(manifest, T, scores, budgets)
    full = owner_capacities(manifest, T, budgets)[1][0] == len(selection.positions[1][0])
    assert full
    owner = selection.positions[1][0]
    extra = next(p for p in range(T) if p not in owner)
    grid = [list(layer) for layer in selection.positions]
    grid[1][0] = tuple(sorted((*owner, extra)))
    over = dataclasses.replace(selection, positions=tuple(tuple(layer) for layer in grid))
    with pytest.raises(StateInvalid) as info:
        pack(manifest, source, over, IDENTITY)
    assert info.value.field == "selected_positions[1][0]"


def test_the_prompt_length_must_be_the_source_caches() -> None:
    """A prefill whose prompt length is not its cache's: materialization refuses the state."""

    @dataclass(frozen=True)
    class Shorter(Prefill):
        @property
        def prompt_length(self) -> int:
            return T - 1

    base = prefill()
    shorter = Shorter(base.source_k, base.source_v, base.observation[..., : T - 1])
    with pytest.raises(PackingError) as info:
        compress(manifests()["window"], shorter, IDENTITY)
    assert info.value.field == "frontier"


def test_snapkv_capacities_need_the_allocators_budgets() -> None:
    with pytest.raises(SelectionError) as info:
        owner_capacities(manifests()["snapkv"], T, None)
    assert info.value.field == "budgets"
