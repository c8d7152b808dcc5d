"""The manifest's recoverability contract and the ledger's page-summary bytes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from services.kvpolicy.errors import ManifestInvalid, PackingError
from services.kvpolicy.ledger import build_ledger, with_page_summaries
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.offload.bound import RecallPolicy
from services.offload.pages import summarize_pages

torch.set_num_threads(1)

TENSOR = TensorContract(
    num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=4,
    k_dtype=DType.FLOAT16, v_dtype=DType.FLOAT16,
)
RECALLABLE = {
    "mode": "recallable_remote",
    "handoff_id": None,  # assigned per stored state by the offload tier, never by the manifest
    "recall_threshold": 0.05,
    "page_size": 16,
    "max_pages_per_step": 4,
    "recall_cadence_steps": 2,
    "recall_timeout_ms": 200,
    "timeout_fallback": "fail_request",
    "full_recall_on_quality_gate": 0.4,
}


def snapkv_with(recoverability: dict[str, Any]) -> dict[str, Any]:
    data = copy.deepcopy(default_manifests(TENSOR)["snapkv"].to_dict())
    data["recoverability"] = recoverability
    return data


def test_a_recallable_manifest_yields_its_recall_policy() -> None:
    manifest = KVVisibilityPolicyManifest.from_dict(snapkv_with(RECALLABLE))
    policy = RecallPolicy.from_contract(manifest.recoverability)
    assert policy == RecallPolicy(0.05, 4, full_recall_threshold=0.4, cadence_steps=2)
    assert manifest.recoverability.page_size == 16
    assert manifest.recoverability.recall_timeout_ms == 200


@pytest.mark.parametrize("gate", [0.05, 0.01])
def test_full_recall_gate_must_exceed_the_recall_threshold(gate: float) -> None:
    with pytest.raises(ManifestInvalid) as info:
        KVVisibilityPolicyManifest.from_dict(
            snapkv_with({**RECALLABLE, "full_recall_on_quality_gate": gate})
        )
    assert info.value.field == "recoverability.full_recall_on_quality_gate"


@pytest.mark.parametrize(
    "missing", ["recall_threshold", "page_size", "timeout_fallback"]
)
def test_recallable_without_a_recall_field_is_rejected(missing: str) -> None:
    with pytest.raises(ManifestInvalid) as info:
        KVVisibilityPolicyManifest.from_dict(snapkv_with({**RECALLABLE, missing: None}))
    assert info.value.field == f"recoverability.{missing}"


def test_ledger_counts_page_summaries_as_metadata() -> None:
    selected = [[[0, 2, 5, 7], [0, 1, 6, 7]], [[0, 3, 4, 7], [0, 2, 6, 7]]]
    keys = torch.zeros(2, 2, 8, 4, dtype=torch.float16)  # [L, H_kv, T, d_h]
    pages = summarize_pages(keys, selected, page_size=16)
    base = build_ledger(TENSOR, 8, selected)
    ledger = with_page_summaries(base, pages.nbytes)
    # pages: (0,0) 1,3-4,6 (0,1) 2-5 (1,0) 1-2,5-6 (1,1) 1,3-5 -> 3 + 1 + 2 + 2 = 8 pages
    assert pages.num_pages == 8
    assert pages.nbytes == 8 * (2 * 4 * 2 + 2 * 4) + 2 * 3 * 4
    assert ledger.metadata_bytes == base.metadata_bytes + pages.nbytes
    assert ledger.traffic_bytes == base.traffic_bytes + pages.nbytes
    assert base.page_summary_bytes == 0 and base.metadata_bytes == 64 + 24
    with pytest.raises(PackingError):
        with_page_summaries(base, -1)
