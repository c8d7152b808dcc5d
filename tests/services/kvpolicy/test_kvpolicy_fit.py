"""The one fit check: every field of the list is compared, the resolved head map decides
(not its label), and recallable_remote needs an offload store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.kvpolicy.fit import CONTRACT_FIELDS, Deployment, ManifestUnfit, check_fits
from services.kvpolicy.manifest import (
    DType,
    GQAGrouping,
    KeyPositionalStage,
    RecoverabilityContract,
    RecoverabilityMode,
    TensorContract,
    TimeoutFallback,
    default_manifests,
)

SERVED = TensorContract(2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32)
MANIFEST = default_manifests(SERVED)["snapkv"]
OTHER = {
    "num_layers": 3, "num_q_heads": 8, "num_kv_heads": 4, "head_dim": 8, "k_dtype": DType.BFLOAT16,
    "v_dtype": DType.FLOAT16, "key_positional_stage": next(s for s in KeyPositionalStage if s != SERVED.key_positional_stage),
}


@pytest.mark.parametrize("name", CONTRACT_FIELDS)
def test_each_contract_field_must_match(name: str) -> None:
    check_fits(MANIFEST, Deployment(SERVED))
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(MANIFEST, Deployment(replace(SERVED, **{name: OTHER[name]})))
    assert caught.value.field == f"tensor.{name}"


def test_the_resolved_head_map_decides() -> None:
    declared = replace(SERVED, q_to_kv_head_map=(0, 0, 1, 1), gqa_grouping=GQAGrouping.CUSTOM)
    check_fits(MANIFEST, Deployment(declared))  # the contiguous map, whatever its label
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(MANIFEST, Deployment(replace(declared, q_to_kv_head_map=(0, 1, 0, 1))))
    assert caught.value.field == "tensor.q_to_kv_head_map"


def test_recallable_remote_needs_an_offload_store() -> None:
    recall = RecoverabilityContract(
        RecoverabilityMode.RECALLABLE_REMOTE, handoff_id="h", recall_threshold=0.1, page_size=16,
        max_pages_per_step=4, recall_cadence_steps=1, recall_timeout_ms=100,
        timeout_fallback=TimeoutFallback.CONTINUE_LOSSY,
    )
    remote = replace(MANIFEST, recoverability=recall)
    check_fits(remote, Deployment(SERVED))
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(remote, Deployment(SERVED, offload_store=False))
    assert caught.value.field == "recoverability.mode"
