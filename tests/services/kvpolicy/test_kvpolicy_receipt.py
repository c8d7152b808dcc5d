"""Receipts: bound to manifest, generations, frontier and positions; checked on both sides."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.kvpolicy.errors import PackingError, ReceiptMismatch
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.packing import pack
from services.kvpolicy.receipt import Receipt, make_receipt, receipt_digest, verify_receipt
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
    }
    fields.update(overrides)
    return KVPolicyState(**fields)  # type: ignore[arg-type]


def test_receipt_binds_state_and_view() -> None:
    k, v = source()
    receipt = make_receipt(MANIFEST, state(), pack(k, v, SELECTED))
    assert receipt.manifest_sha256 == MANIFEST.sha256
    assert receipt.selected_positions[1][0] == (0, 3, 4, 7)
    assert len(receipt.digest) == 64
    assert receipt.digest == receipt_digest(receipt.body())
    assert receipt == Receipt.for_state(state())
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
        make_receipt(other, state(), pack(k, v, SELECTED))
    assert info.value.field == "manifest_sha256"


def test_make_receipt_rejects_a_view_with_other_positions() -> None:
    k, v = source()
    other = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 2, 5, 7]]]
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(MANIFEST, state(), pack(k, v, other))
    assert info.value.field == "original_position_map"


def test_make_receipt_rejects_owner_count_mismatch() -> None:
    k, v = source()
    three_owners = [[[7], [7], [7]], [[7], [7], [7]]]
    with pytest.raises(ReceiptMismatch) as info:
        make_receipt(
            MANIFEST,
            state(selected_positions=three_owners),
            pack(k, v, three_owners, owner_to_kv_head=[0, 1, 1]),
        )
    assert info.value.field == "selected_positions"


def test_make_receipt_checks_the_view_against_the_tensor_contract() -> None:
    k, v = source()
    with pytest.raises(PackingError) as dtype:
        make_receipt(MANIFEST, state(), pack(k.half(), v.half(), SELECTED))
    assert dtype.value.field == "packed_k"
    with pytest.raises(PackingError) as head_dim:
        make_receipt(MANIFEST, state(), pack(k[..., :3], v[..., :3], SELECTED))
    assert head_dim.value.field == "packed_k"


def test_verify_receipt_rejects_other_manifest_and_other_rows() -> None:
    k, v = source()
    receipt = make_receipt(MANIFEST, state(), pack(k, v, SELECTED))
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
