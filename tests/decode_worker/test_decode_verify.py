"""Verification decisions (pure): a received view is used only if it matches the descriptor and
the manifest, its receipt digest recomputes from what arrived, and the fence admits it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decode_helpers import pack_state, synthetic_prefill, tampered

from decode_worker.errors import StaleTransfer, ViewRejected
from decode_worker.verify import (
    check_fence,
    check_manifest,
    check_view,
    protected_positions_for,
    recompute_receipt,
)
from services.kvpolicy.fit import Deployment
from services.kvpolicy.manifest import DType, GQAGrouping, TensorContract, default_manifests
from services.kvpolicy.packing import pack
from services.policy.types import Fence, Phase

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
