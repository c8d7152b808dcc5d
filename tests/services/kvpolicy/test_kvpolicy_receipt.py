"""Receipts: bound to manifest, generations, frontier, positions, owner budgets, payload bytes and
the source cache; checked on both sides."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.kvpolicy.errors import PackingError, ReceiptMismatch
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.packing import PackedKVView, SourceIdentity, pack
from services.kvpolicy.receipt import (
    PAYLOAD_HASH,
    PayloadDigest,
    Receipt,
    check_payload,
    make_receipt,
    payload_digest,
    receipt_digest,
    verify_receipt,
)
from services.kvpolicy.state import KVPolicyState

torch.set_num_threads(1)

TENSOR = TensorContract(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=4,
    k_dtype=DType.FLOAT32,
    v_dtype=DType.FLOAT32,
)
MANIFEST = default_manifests(TENSOR)["snapkv"]
SELECTED = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 2, 6, 7]]]
BUDGETS = [[4, 4], [4, 5]]
SOURCE = SourceIdentity(length=8, cache_generation=1)


def source() -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(2 * 2 * 8 * 4, dtype=torch.float32).view(2, 2, 8, 4)  # [L, H_kv, T, d_h]
    return k, k + 5000


def state(**overrides: object) -> KVPolicyState:
    fields: dict[str, object] = {
        "request_id": "req-1",
        "manifest_sha256": MANIFEST.sha256,
        "request_generation": 2,
        "state_generation": 1,
        "parent_state_generation": 0,
        "cache_generation": 1,
        "frontier": 8,
        "selected_positions": SELECTED,
        "protected_positions": [7],
        "owner_budgets": BUDGETS,
    }
    fields.update(overrides)
    return KVPolicyState(**fields)  # type: ignore[arg-type]


def receipt_of(view: PackedKVView | None = None, **overrides: object) -> Receipt:
    k, v = source()
    return make_receipt(MANIFEST, state(**overrides), view or pack(k, v, SELECTED), source=SOURCE)


def test_receipt_binds_state_and_view() -> None:
    k, v = source()
    view = pack(k, v, SELECTED)
    receipt = make_receipt(MANIFEST, state(), view, source=SOURCE)
    assert receipt.manifest_sha256 == MANIFEST.sha256
    assert receipt.selected_positions[1][0] == (0, 3, 4, 7)
    assert receipt.owner_budgets == ((4, 4), (4, 5))
    assert receipt.payload is not None and receipt.payload.hash == PAYLOAD_HASH == "xxh3-128"
    assert len(receipt.payload.layers) == 2 and all(len(h) == 32 for pair in receipt.payload.layers for h in pair)
    assert len(receipt.digest) == 64
    assert receipt.digest == receipt_digest(receipt.body())
    assert receipt == Receipt.for_state(state(), payload_digest(view))
    assert receipt.digest != Receipt.for_state(state()).digest  # the payload is bound
    verify_receipt(receipt, manifest_sha256=MANIFEST.sha256, view=pack(k, v, SELECTED))


@pytest.mark.parametrize(
    "change",
    [
        {"request_generation": 3},
        {"cache_generation": 2},
        {"frontier": 9},
        {"request_id": "req-2"},
        {"selected_positions": [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 3, 6, 7]]]},
        {"selected_positions": [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 6, 7]]]},
        {"protected_positions": [0, 7]},
        {"manifest_sha256": "cd" * 32},
        {"owner_budgets": [[4, 4], [4, 4]]},
        {"owner_budgets": None},
    ],
)
def test_digest_changes_when_anything_bound_changes(change: dict[str, object]) -> None:
    assert Receipt.for_state(state(**change)).digest != Receipt.for_state(state()).digest


def test_successor_state_generation_changes_the_digest() -> None:
    parent = state()
    child = parent.successor(selected_positions=SELECTED, frontier=8, cache_generation=1)
    assert Receipt.for_state(child).digest != Receipt.for_state(parent).digest


def test_tampered_receipt_is_unconstructible() -> None:
    receipt = Receipt.for_state(state())
    with pytest.raises(ReceiptMismatch) as info:
        replace(receipt, frontier=9)
    assert info.value.field == "digest"
    with pytest.raises(ReceiptMismatch):
        replace(receipt, digest="0" * 64)


def test_make_receipt_rejects_a_state_for_another_manifest() -> None:
    k, v = source()
    other = default_manifests(TENSOR)["snapkv-pyramid"]
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(other, state(), pack(k, v, SELECTED), source=SOURCE)
    assert info.value.field == "manifest_sha256"


def test_make_receipt_rejects_a_view_with_other_positions() -> None:
    k, v = source()
    other = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 2, 5, 7]]]
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(MANIFEST, state(), pack(k, v, other), source=SOURCE)
    assert info.value.field == "original_position_map"


def test_make_receipt_rejects_owner_count_mismatch() -> None:
    k, v = source()
    three_owners = [[[7], [7], [7]], [[7], [7], [7]]]
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(
            MANIFEST,
            state(selected_positions=three_owners, owner_budgets=None),
            pack(k, v, three_owners, owner_to_kv_head=[0, 1, 1]),
            source=SOURCE,
        )
    assert info.value.field == "selected_positions"


def test_make_receipt_checks_the_view_against_the_tensor_contract() -> None:
    k, v = source()
    with pytest.raises(PackingError) as dtype:
        make_receipt(MANIFEST, state(), pack(k.half(), v.half(), SELECTED), source=SOURCE)
    assert dtype.value.field == "packed_k"
    with pytest.raises(PackingError) as head_dim:
        make_receipt(MANIFEST, state(), pack(k[..., :3], v[..., :3], SELECTED), source=SOURCE)
    assert head_dim.value.field == "packed_k"


def test_verify_receipt_rejects_other_manifest_and_other_rows() -> None:
    k, v = source()
    receipt = make_receipt(MANIFEST, state(), pack(k, v, SELECTED), source=SOURCE)
    with pytest.raises(ReceiptMismatch) as manifest:
        verify_receipt(receipt, manifest_sha256="cd" * 32, view=pack(k, v, SELECTED))
    assert manifest.value.field == "manifest_sha256"
    shifted = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 6], [0, 2, 6, 7]]]
    with pytest.raises(ReceiptMismatch) as rows:
        verify_receipt(receipt, manifest_sha256=MANIFEST.sha256, view=pack(k, v, shifted))
    assert rows.value.field == "original_position_map"
    one_layer = [[[0, 2, 5, 7], [0, 1, 6, 7]]]
    with pytest.raises(ReceiptMismatch):
        verify_receipt(receipt, manifest_sha256=MANIFEST.sha256, view=pack(k[:1], v[:1], one_layer))


# --- owner budgets (issue 14, item 2) ------------------------------------------------------


def test_make_receipt_requires_the_owner_budgets() -> None:
    with pytest.raises(ReceiptMismatch) as info:
        receipt_of(owner_budgets=None)
    assert info.value.field == "owner_budgets"


def test_a_receipt_over_an_owner_budget_is_unconstructible_even_with_its_own_digest() -> None:
    """Five rows for a budget of four: refused naming the owner, whatever the digest says
    (here the honest digest of that very body)."""
    body = Receipt.for_state(state()).body() | {"owner_budgets": [[4, 4], [3, 5]]}
    with pytest.raises(ReceiptMismatch) as over:
        Receipt(**body, digest=receipt_digest(body))
    assert over.value.field == "owner_budgets[1][0]"
    body["owner_budgets"] = [[4, 4]]
    with pytest.raises(ReceiptMismatch) as shape:
        Receipt(**body, digest=receipt_digest(body))
    assert shape.value.field == "owner_budgets"


# --- payload digest (issue 14, item 3) -----------------------------------------------------


def shifted_v(view: PackedKVView, layer: int) -> PackedKVView:
    """V rows of `layer`'s first owner rolled by one against K: same shapes, same positions."""
    rows = view.rows(layer, 0)
    packed_v = view.packed_v.clone()
    packed_v[rows] = torch.roll(packed_v[rows], 1, dims=0)
    return replace(view, packed_v=packed_v)


def flipped_k_bit(view: PackedKVView, layer: int) -> PackedKVView:
    """One bit of one K element of `layer` flipped (the lowest mantissa bit)."""
    packed_k = view.packed_k.clone()
    as_int = packed_k.view(torch.int32)
    as_int[view.rows(layer, 1).start, 2] ^= 1
    return replace(view, packed_k=packed_k)


@pytest.mark.parametrize(
    ("forge", "field"),
    [
        (lambda view: shifted_v(view, 1), "packed_v[1]"),
        (lambda view: flipped_k_bit(view, 0), "packed_k[0]"),
    ],
)
def test_verify_receipt_rejects_other_payload_bytes(forge, field: str) -> None:  # type: ignore[no-untyped-def]
    receipt = receipt_of()
    forged = forge(receipt_view())
    assert forged.selected_positions() == SELECTED  # only the bytes differ
    with pytest.raises(ReceiptMismatch) as info:
        verify_receipt(receipt, manifest_sha256=MANIFEST.sha256, view=forged)
    assert info.value.field == field


def receipt_view() -> PackedKVView:
    k, v = source()
    return pack(k, v, SELECTED)


def test_payload_digest_is_per_layer_k_and_v_and_names_its_hash() -> None:
    view = receipt_view()
    digest = payload_digest(view)
    assert digest == payload_digest(receipt_view())  # deterministic
    assert payload_digest(shifted_v(view, 1)).layers[0] == digest.layers[0]  # layer 0 untouched
    assert payload_digest(shifted_v(view, 1)).layers[1][0] == digest.layers[1][0]  # K untouched
    with pytest.raises(ReceiptMismatch) as other_hash:
        check_payload(PayloadDigest("blake3", digest.layers), view)
    assert other_hash.value.field == "payload.hash"
    with pytest.raises(ReceiptMismatch) as none:
        check_payload(None, view)
    assert none.value.field == "payload"
    with pytest.raises(ReceiptMismatch) as layers:
        check_payload(PayloadDigest(PAYLOAD_HASH, digest.layers[:1]), view)
    assert layers.value.field == "payload"


def test_a_receipt_with_the_wrong_number_of_layer_digests_is_unconstructible() -> None:
    receipt = receipt_of()
    assert receipt.payload is not None
    body = receipt.body() | {"payload": PayloadDigest(PAYLOAD_HASH, receipt.payload.layers[:1])}
    with pytest.raises(ReceiptMismatch) as info:
        Receipt(**body, digest=receipt_digest(body))
    assert info.value.field == "payload"


# --- the source cache (issue 14, item 4) ---------------------------------------------------


@pytest.mark.parametrize(
    ("source_identity", "field"),
    [
        (SourceIdentity(length=8, cache_generation=2), "cache_generation"),
        (SourceIdentity(length=7, cache_generation=1), "frontier"),
        (SourceIdentity(length=8, cache_generation=1, position_origin=1), "position_origin"),
    ],
)
def test_make_receipt_rejects_a_state_outside_its_source(source_identity: SourceIdentity, field: str) -> None:
    k, v = source()
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(MANIFEST, state(), pack(k, v, SELECTED), source=source_identity)
    assert info.value.field == field


def test_a_frontier_beyond_the_source_is_rejected() -> None:
    """The issue's case: a state with frontier 9 over a source of 8 positions."""
    k, v = source()
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(MANIFEST, state(frontier=9), pack(k, v, SELECTED), source=SOURCE)
    assert info.value.field == "frontier"


def test_only_a_views_receipt_has_view_bindings() -> None:
    receipt = receipt_of()
    assert receipt.view_bindings() == (receipt.owner_budgets, receipt.payload)
    with pytest.raises(ReceiptMismatch) as info:
        Receipt.for_state(state()).view_bindings()  # a state no view realizes (e.g. a recall's)
    assert info.value.field == "payload"


def test_a_full_cache_exact_state_must_retain_every_row_of_every_owner() -> None:
    full = default_manifests(TENSOR)["full"]
    k, v = source()
    every = [[list(range(8))] * 2] * 2
    exact = state(manifest_sha256=full.sha256, selected_positions=every, protected_positions=[],
                  owner_budgets=[[8, 8], [8, 8]])
    make_receipt(full, exact, pack(k, v, every), source=SOURCE)
    omitting = [[list(range(8)), list(range(8))], [list(range(8)), [0, 1, 2, 3, 4, 5, 7]]]
    gapped = replace(exact, selected_positions=omitting)  # under budget, well formed
    with pytest.raises(ReceiptMismatch) as caught:
        make_receipt(full, gapped, pack(k, v, omitting), source=SOURCE)
    assert caught.value.field == "selected_positions[1][1]"
    assert "full_cache_exact" in caught.value.reason
