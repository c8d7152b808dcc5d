"""Verification decisions (pure): a received view is used only if it matches the descriptor and
the manifest, its receipt digest recomputes from what arrived, and the fence admits it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decode_helpers import (
    k_bit_flipped,
    over_budget,
    pack_state,
    synthetic_prefill,
    tampered,
    v_shifted,
)

from decode_worker.accept import handoff_reservation_bytes
from decode_worker.errors import StaleTransfer, ViewRejected
from decode_worker.verify import (
    check_budgets,
    check_fence,
    check_fidelity,
    check_manifest,
    check_offload,
    check_payload,
    check_view,
    protected_positions_for,
    recompute_receipt,
    verified_state,
)
from services.kvpolicy.fit import Deployment
from services.kvpolicy.manifest import (
    DType,
    GQAGrouping,
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    TensorContract,
    default_manifests,
)
from services.kvpolicy.packing import pack
from services.offload.plan import offload_plan
from services.offload.recall import RecallKnobs, with_recall
from services.policy.types import Fence, Phase
from services.transfer import OffloadRef, Sidecar, SidecarLayout

CONTRACT = TensorContract(2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32)
MANIFESTS = default_manifests(CONTRACT, observation_window=4)
LENGTH = 40


@pytest.fixture(scope="module")
def prefilled():
    return synthetic_prefill(CONTRACT, LENGTH, seed=1)


@pytest.mark.parametrize("name", sorted(MANIFESTS))
def test_genuine_view_passes_every_check(name, prefilled):
    packed = pack_state(MANIFESTS[name], prefilled, "req-1", request_generation=3, state_generation=2)
    handoff = packed.handoff()
    check_manifest(packed.manifest, handoff, Deployment(CONTRACT))
    check_view(packed.view, packed.manifest, handoff)
    receipt = recompute_receipt(packed.manifest, handoff, packed.view)
    assert receipt == packed.receipt
    assert protected_positions_for(packed.manifest, LENGTH) == packed.state.protected_positions


def test_tampered_position_map_is_rejected(prefilled):
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1")
    forged = tampered(packed.view)
    # Well formed and the same shape: only the receipt digest can tell.
    check_view(forged, packed.manifest, packed.handoff())
    with pytest.raises(ViewRejected) as error:
        recompute_receipt(packed.manifest, packed.handoff(), forged)
    assert error.value.field == "receipt.digest"


def test_a_descriptor_claiming_another_selection_is_rejected(prefilled):
    """The positions are never taken on trust from the descriptor: a handoff that claims the
    receipt of another selection (its digest) over this view fails, and so does one that
    lists other rows per owner than arrived."""
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1")
    other = pack_state(MANIFESTS["snapkv-pyramid"], prefilled, "req-1")
    claimed_elsewhere = packed.handoff(receipt_digest=other.receipt.digest)
    with pytest.raises(ViewRejected) as error:
        recompute_receipt(packed.manifest, claimed_elsewhere, packed.view)
    assert error.value.field == "receipt.digest"
    with pytest.raises(ViewRejected) as error:
        check_view(packed.view, packed.manifest, other.handoff())
    assert error.value.field == "descriptor.tensors"


@pytest.mark.parametrize(
    "change",
    [
        {"receipt_digest": "0" * 64},
        {"state_generation": 2, "parent_state_generation": 1},
        {"cache_generation": 7},
        {"frontier": LENGTH + 1},
        {"request_id": "someone-else"},
    ],
)
def test_claim_that_differs_from_what_arrived_is_rejected(change, prefilled):
    packed = pack_state(MANIFESTS["snapkv-pyramid"], prefilled, "req-1")
    with pytest.raises(ViewRejected) as error:
        recompute_receipt(packed.manifest, packed.handoff(**change), packed.view)
    assert error.value.field == "receipt.digest"


def test_view_must_match_descriptor_and_manifest(prefilled):
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1")
    other = pack_state(MANIFESTS["snapkv-pyramid"], prefilled, "req-1")
    with pytest.raises(ViewRejected) as error:
        check_view(packed.view, packed.manifest, other.handoff())
    assert error.value.field == "descriptor.tensors"

    half = dataclasses.replace(
        packed.view, packed_k=packed.view.packed_k.half(), packed_v=packed.view.packed_v.half()
    )
    with pytest.raises(ViewRejected) as error:
        check_view(half, packed.manifest, packed.handoff(half))
    assert error.value.field == "packed_k"

    with pytest.raises(ViewRejected) as error:
        check_view(packed.view, packed.manifest, packed.handoff(frontier=LENGTH - 1))
    assert error.value.field == "original_position_map"

    one_layer = pack(prefilled.result.source_k[:1], prefilled.result.source_v[:1], [[[0], [1]]])
    with pytest.raises(ViewRejected) as error:
        check_view(one_layer, packed.manifest, packed.handoff(one_layer))
    assert error.value.field == "row_offsets"


def test_manifest_must_be_the_claimed_one_and_fit_the_model(prefilled):
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1")
    with pytest.raises(ViewRejected) as error:
        check_manifest(MANIFESTS["full"], packed.handoff(), Deployment(CONTRACT))
    assert error.value.field == "receipt.manifest_sha256"
    bigger = TensorContract(3, 4, 2, 16, DType.FLOAT32, DType.FLOAT32)
    with pytest.raises(ViewRejected) as error:
        check_manifest(packed.manifest, packed.handoff(), Deployment(bigger))
    assert error.value.field == "manifest.tensor.num_layers"
    half = dataclasses.replace(CONTRACT, k_dtype=DType.FLOAT16)  # the gateway's and prefill's field list
    with pytest.raises(ViewRejected) as error:
        check_manifest(packed.manifest, packed.handoff(), Deployment(half))
    assert error.value.field == "manifest.tensor.k_dtype"
    regrouped = TensorContract(
        2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32, q_to_kv_head_map=(0, 1, 0, 1), gqa_grouping=GQAGrouping.CUSTOM
    )
    with pytest.raises(ViewRejected) as error:
        check_manifest(packed.manifest, packed.handoff(), Deployment(regrouped))
    assert error.value.field == "manifest.tensor.q_to_kv_head_map"


def fence_of(packed, **changes) -> Fence:
    receipt = packed.receipt
    values = {
        "request_id": receipt.request_id,
        "request_generation": receipt.request_generation,
        "state_generation": receipt.state_generation,
        "cache_generation": receipt.cache_generation,
        "receipt_digest": receipt.digest,
        "manifest_sha256": receipt.manifest_sha256,
        "phase": Phase.PREFILLED,
        "prefill_worker": "prefill-0",
        "decode_worker": "",
        "updated_at_unix_ms": 0,
        "lease_remaining_ms": 60_000,
    }
    return Fence(**{**values, **changes})


def test_fence_admits_only_the_current_state(prefilled):
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1", request_generation=4, state_generation=1)
    check_fence(fence_of(packed), packed.handoff())
    cases = {
        "state_generation": {"state_generation": 2, "receipt_digest": "a" * 64},
        "request_generation": {"request_generation": 5, "state_generation": 0, "receipt_digest": ""},
        "cache_generation": {"cache_generation": 9},
        "receipt.digest": {"receipt_digest": "b" * 64},
        "receipt.manifest_sha256": {"manifest_sha256": MANIFESTS["full"].sha256},
        "phase": {"phase": Phase.ENDED},
    }
    for field, changes in cases.items():
        current = fence_of(packed, **changes)
        with pytest.raises(StaleTransfer) as error:
            check_fence(current, packed.handoff())
        assert error.value.field == field
        assert error.value.current == current
        assert error.value.detail().current.request_generation == current.request_generation
    with pytest.raises(StaleTransfer) as error:
        check_fence(None, packed.handoff())
    assert error.value.field == "request_id"


def test_protected_positions_follow_the_manifest_with_an_origin():
    assert protected_positions_for(MANIFESTS["full"], 10) == ()
    assert protected_positions_for(MANIFESTS["sink-recent"], 10, origin=5) == (5, 6, 7, 8)
    assert protected_positions_for(MANIFESTS["snapkv"], 10, origin=100) == (106, 107, 108, 109)
    assert torch.equal(torch.tensor(protected_positions_for(MANIFESTS["snapkv"], 3)), torch.arange(3))


# --- issue 14: budgets and payload bytes at decode -----------------------------------------


@pytest.mark.parametrize(("forge", "field"), [(v_shifted, "packed_v[0]"), (k_bit_flipped, "packed_k[0]")])
def test_payload_bytes_other_than_the_receipts_are_rejected(forge, field, prefilled):
    """A V row shifted by one against K, or one flipped bit in K: the positions, the layout and
    the receipt all still hold, and only the payload digest tells."""
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1")
    forged = forge(packed.view)
    handoff = packed.handoff(forged)
    check_view(forged, packed.manifest, handoff)
    assert recompute_receipt(packed.manifest, handoff, forged) == packed.receipt
    check_payload(packed.handoff(), packed.view)  # the genuine bytes pass
    with pytest.raises(ViewRejected) as error:
        check_payload(handoff, forged)
    assert error.value.field == field


def test_a_payload_under_another_hash_is_rejected_naming_it(prefilled):
    packed = pack_state(MANIFESTS["window"], prefilled, "req-1")
    other = dataclasses.replace(packed.receipt.payload, hash="blake3")
    with pytest.raises(ViewRejected) as error:
        check_payload(packed.handoff(payload=other), packed.view)
    assert error.value.field == "receipt.payload.hash"


def test_an_owner_over_its_budget_is_rejected_at_decode(prefilled):
    """One extra row for (layer 0, owner 0), whose budget the allocator filled: the receipt's
    recomputation refuses it naming the owner's budget, before the digest is compared."""
    packed = pack_state(MANIFESTS["snapkv"], prefilled, "req-1")
    budget = packed.receipt.owner_budgets[0][0]
    assert len(packed.view.selected_positions()[0][0]) == budget  # full
    forged = over_budget(packed.view)
    handoff = packed.handoff(forged)
    check_view(forged, packed.manifest, handoff)
    with pytest.raises(ViewRejected) as error:
        recompute_receipt(packed.manifest, handoff, forged)
    assert error.value.field == "receipt.owner_budgets[0][0]"
    assert f"{budget + 1} rows retained, the budget is {budget}" in error.value.message


@pytest.mark.parametrize("name", ["full", "window", "sink-recent"])
def test_static_budgets_must_be_the_rules_count(name, prefilled):
    packed = pack_state(MANIFESTS[name], prefilled, "req-1")
    check_budgets(packed.manifest, packed.handoff())
    budgets = [list(row) for row in packed.receipt.owner_budgets]
    budgets[1][1] += 1
    with pytest.raises(ViewRejected) as error:
        check_budgets(packed.manifest, packed.handoff(owner_budgets=budgets))
    assert error.value.field == "receipt.owner_budgets[1][1]"


def test_a_full_view_that_omits_a_row_is_rejected(prefilled):
    """`full_cache_exact` promises every row of every owner: a view missing one (within its
    budget, well formed) is refused before its receipt is even recomputed."""
    packed = pack_state(MANIFESTS["full"], prefilled, "req-1")
    check_fidelity(packed.manifest, packed.handoff(), packed.view)
    every = packed.view.selected_positions()
    gapped = [[list(owner) for owner in layer] for layer in every]
    del gapped[1][0][5]
    result = prefilled.result
    view = pack(result.source_k, result.source_v, gapped)
    with pytest.raises(ViewRejected) as error:
        check_fidelity(packed.manifest, packed.handoff(view), view)
    assert error.value.field == "receipt.selected_positions[1][0]"


def test_the_verified_state_keeps_the_budgets(prefilled):
    packed = pack_state(MANIFESTS["snapkv-pyramid"], prefilled, "req-1")
    assert verified_state(packed.receipt).owner_budgets == packed.state.owner_budgets is not None


# --- recallable manifests: page summaries and row codes ------------------------------------

LOCAL, REMOTE = RecoverabilityMode.RECALLABLE_LOCAL, RecoverabilityMode.RECALLABLE_REMOTE


def recallable(mode: RecoverabilityMode, code_bits: int | None) -> KVVisibilityPolicyManifest:
    knobs = RecallKnobs(threshold=0.5, page_size=4, max_pages_per_step=4, cadence_steps=1)
    manifest = with_recall(MANIFESTS["snapkv"], knobs, mode=mode)
    contract = dataclasses.replace(manifest.recoverability, key_code_bits=code_bits)
    return dataclasses.replace(manifest, recoverability=contract)


def offloaded(manifest: KVVisibilityPolicyManifest, prefilled, summaries_of=None):
    """The packed view, handoff and sidecar the prefill worker's offload stage makes under
    `manifest` (`summaries_of`: another manifest whose plan supplies the summaries)."""
    packed = pack_state(manifest, prefilled, "req-1")
    result = prefilled.result
    positions = packed.state.selected_positions
    plan = offload_plan(summaries_of or manifest, result.source_k, result.source_v, positions)
    assert plan is not None
    mode = manifest.recoverability.mode
    car = Sidecar(plan.summaries, plan.rows if mode is LOCAL else None)
    offload = OffloadRef(mode, "h-1", "127.0.0.1:9", 1000) if mode is REMOTE else OffloadRef(mode)
    # The ledger charged as the prefill worker charges it (summaries with their codes); the
    # handoff checks that it moves exactly what the descriptor's tensors list.
    ledger = car.charge(packed.ledger)
    sidecar = SidecarLayout.of(car, packed.view.packed_v.dtype)
    handoff = packed.handoff(sidecar=sidecar, offload=offload, ledger=ledger)
    return packed, handoff, car


@pytest.mark.parametrize(
    ("mode", "code_bits"), [(LOCAL, None), (REMOTE, None), (LOCAL, 1), (LOCAL, 4), (REMOTE, 2)]
)
def test_summaries_with_the_manifests_code_bits_pass(mode, code_bits, prefilled):
    manifest = recallable(mode, code_bits)
    packed, handoff, car = offloaded(manifest, prefilled)
    assert car.summaries.code_bits == (code_bits or 0)
    assert (car.summaries.row_codes is None) == (not code_bits)
    check_offload(manifest, handoff, car, packed.view)


@pytest.mark.parametrize("mode", [LOCAL, REMOTE])
def test_the_codes_table_is_charged_reserved_and_checked(mode, prefilled):
    manifest = recallable(mode, 4)
    packed, handoff, car = offloaded(manifest, prefilled)
    table = car.summaries.code_table
    assert handoff.ledger.code_table_bytes == car.summaries.code_table_bytes == table.nbytes > 0
    # Accept reserves the table beside the rest (host bytes round up to whole pages).
    plain = dataclasses.replace(handoff, ledger=dataclasses.replace(handoff.ledger, code_table_bytes=0))
    extra = handoff_reservation_bytes(handoff, torch.float32) - handoff_reservation_bytes(plain, torch.float32)
    assert table.nbytes <= extra
    # A ledger that charges less (or more) than the summaries' table is rejected: accept
    # reserved what it says.
    for wrong in (0, table.nbytes - 1, table.nbytes + 1):
        forged = dataclasses.replace(handoff, ledger=dataclasses.replace(handoff.ledger, code_table_bytes=wrong))
        with pytest.raises(ViewRejected) as error:
            check_offload(manifest, forged, car, packed.view)
        assert error.value.field == "ledger.code_table_bytes"
    # Without codes, nothing is charged.
    _, uncoded, bare = offloaded(recallable(mode, None), prefilled)
    assert uncoded.ledger.code_table_bytes == bare.summaries.code_table_bytes == 0


@pytest.mark.parametrize(("declared", "sent"), [(2, 4), (2, None), (None, 1)])
def test_code_bits_other_than_the_manifests_are_rejected(declared, sent, prefilled):
    manifest = recallable(LOCAL, declared)
    packed, handoff, car = offloaded(manifest, prefilled, summaries_of=recallable(LOCAL, sent))
    with pytest.raises(ViewRejected) as error:
        check_offload(manifest, handoff, car, packed.view)
    assert error.value.field == "sidecar.code_bits"


@pytest.mark.parametrize("forge", ["shifted", "tampered"])
def test_local_row_codes_that_are_not_the_host_rows_are_rejected(forge, prefilled):
    manifest = recallable(LOCAL, 2)
    packed, handoff, car = offloaded(manifest, prefilled)
    codes = car.summaries.row_codes
    assert codes is not None
    if forge == "shifted":  # every row's codes moved to the next row
        forged = torch.roll(codes, 1, dims=0)
    else:  # one coordinate of one row moved to the next level
        forged = codes.clone()
        forged[codes.shape[0] // 2, 0] ^= 0b01
    assert not torch.equal(forged, codes)
    summaries = dataclasses.replace(car.summaries, row_codes=forged)
    with pytest.raises(ViewRejected) as error:
        check_offload(manifest, handoff, Sidecar(summaries, car.host_rows), packed.view)
    assert error.value.field == "sidecar.row_codes"


def with_values(manifest: KVVisibilityPolicyManifest) -> KVVisibilityPolicyManifest:
    contract = dataclasses.replace(manifest.recoverability, omitted_value_term=True)
    return dataclasses.replace(manifest, recoverability=contract)


@pytest.mark.parametrize("mode", [LOCAL, REMOTE])
def test_page_value_means_pass_with_the_manifest_that_asks_for_them_and_are_charged(mode, prefilled):
    manifest = with_values(recallable(mode, 4))
    packed, handoff, car = offloaded(manifest, prefilled)
    means = car.summaries.page_value_mean
    assert means is not None and means.dtype == packed.view.packed_v.dtype
    check_offload(manifest, handoff, car, packed.view)
    grid = car.summaries.value_grid
    assert handoff.ledger.code_table_bytes == car.summaries.code_table.nbytes + grid.numel() * 2
    # Carried without the manifest asking, or asked for and not carried: rejected.
    for declared, sent in ((recallable(mode, 4), manifest), (manifest, recallable(mode, 4))):
        packed, handoff, car = offloaded(declared, prefilled, summaries_of=sent)
        with pytest.raises(ViewRejected) as error:
            check_offload(declared, handoff, car, packed.view)
        assert error.value.field == "sidecar.page_value_mean"


@pytest.mark.parametrize("forge", ["shifted", "dtype"])
def test_page_value_means_that_are_not_the_host_rows_means_are_rejected(forge, prefilled):
    manifest = with_values(recallable(LOCAL, 4))
    packed, handoff, car = offloaded(manifest, prefilled)
    assert car.host_rows is not None and car.summaries.page_value_mean is not None
    rows, summaries = car.host_rows, car.summaries
    if forge == "shifted":  # the means of the host rows with one V row moved one row down
        values = rows.v.clone()
        values[1:] = rows.v[:-1].clone()
        rows = dataclasses.replace(rows, v=values)
    else:
        means = summaries.page_value_mean
        assert means is not None
        summaries = dataclasses.replace(summaries, page_value_mean=means.double())
    with pytest.raises(ViewRejected) as error:
        check_offload(manifest, handoff, Sidecar(summaries, rows), packed.view)
    assert error.value.field == "sidecar.page_value_mean"
