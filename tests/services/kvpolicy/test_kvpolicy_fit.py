"""The one fit check: a manifest declares only what the runtime performs (no decode-time
retention, original rows, post-RoPE keys, the gateway's fallbacks), every field of the tensor
contract is compared, the resolved head map decides, the cache ABI and checkpoint generation
are the served ones, and recallable_remote needs an offload store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.kvpolicy.fit import (
    CONTRACT_FIELDS,
    Deployment,
    ManifestUnfit,
    check_fits,
    check_fits_any,
)
from services.kvpolicy.manifest import (
    CapacityAction,
    DType,
    Fidelity,
    GQAGrouping,
    InvalidStateAction,
    KeyPositionalStage,
    KVVisibilityPolicyManifest,
    Phase,
    QualityContract,
    RecoverabilityContract,
    RecoverabilityMode,
    RepresentationContract,
    RowKind,
    TensorContract,
    TimeoutFallback,
    UpdateCadence,
    default_manifests,
)
from services.kvpolicy.retention_manifests import retention_manifests

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
    check_fits(MANIFEST, Deployment(replace(SERVED, q_to_kv_head_map=(0, 0, 1, 1))))
    regrouped = replace(SERVED, q_to_kv_head_map=(0, 1, 0, 1), gqa_grouping=GQAGrouping.CUSTOM)
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(MANIFEST, Deployment(regrouped))
    assert caught.value.field == "tensor.q_to_kv_head_map"


RECALL = RecoverabilityContract(
    RecoverabilityMode.RECALLABLE_REMOTE, recall_threshold=0.1, page_size=16,
    max_pages_per_step=4, recall_cadence_steps=1, recall_timeout_ms=100,
    timeout_fallback=TimeoutFallback.CONTINUE_LOSSY,
)


def test_recallable_remote_needs_an_offload_store() -> None:
    remote = replace(MANIFEST, recoverability=RECALL)
    check_fits(remote, Deployment(SERVED))
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(remote, Deployment(SERVED, offload_store=False))
    assert caught.value.field == "recoverability.mode"


def refused(manifest: KVVisibilityPolicyManifest, deployment: Deployment = Deployment(SERVED)) -> str:
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(manifest, deployment)
    with pytest.raises(ManifestUnfit):
        check_fits_any(manifest, [deployment])
    return caught.value.field


@pytest.mark.parametrize("name", ["window", "sink-recent"])
def test_decode_time_retention_fits_when_it_evicts_for_good(name: str) -> None:
    served = default_manifests(SERVED)[name]
    assert (served.selection.phase, served.selection.update_cadence) == (
        Phase.PREFILL, UpdateCadence.PREFILL_ONCE)  # what happens: selected once, then appends
    check_fits(served, Deployment(SERVED))
    for retained in retention_manifests(SERVED).values():  # every method, both positions
        check_fits(retained, Deployment(SERVED))
    recallable = replace(retention_manifests(SERVED)["snapkv-h2o"], recoverability=RECALL)
    assert refused(recallable) == "recoverability.mode"  # evicted rows never come back
    full = default_manifests(SERVED)["full"]
    assert full.selection.phase is Phase.BOTH  # appends only: nothing is ever dropped
    check_fits(full, Deployment(SERVED))


def test_replacement_rows_are_refused_until_a_producer_exists() -> None:
    replacement = RepresentationContract(
        RowKind.REPLACEMENT_ROWS, Fidelity.LOSSY_REPLACEMENT, consumer_schema="merged-rows.v1")
    assert refused(replace(MANIFEST, representation=replacement)) == "representation.rows"


def test_pre_rope_keys_are_refused_even_where_the_deployment_claims_them() -> None:
    for stage in (KeyPositionalStage.PRE_ROPE, KeyPositionalStage.NONE):
        tensor = replace(MANIFEST.tensor, key_positional_stage=stage)
        claimed = replace(MANIFEST, tensor=tensor)
        assert refused(claimed, Deployment(tensor)) == "tensor.key_positional_stage"


@pytest.mark.parametrize(
    ("quality", "field"),
    [
        (QualityContract(on_invalid_state=InvalidStateAction.FAIL_REQUEST), "quality.on_invalid_state"),
        (QualityContract(on_capacity_exhausted=CapacityAction.FAIL_REQUEST),
         "quality.on_capacity_exhausted"),
    ],
)
def test_fallbacks_the_gateway_does_not_take_are_refused(quality: QualityContract, field: str) -> None:
    assert refused(replace(MANIFEST, quality=quality)) == field


def test_cache_abi_and_checkpoint_generation_are_the_served_ones() -> None:
    assert refused(MANIFEST, Deployment(SERVED, logical_cache_abi_sha256="a" * 64)) == (
        "logical_cache_abi_sha256")
    assert refused(MANIFEST, Deployment(SERVED, checkpoint_generation=1)) == "checkpoint_generation"
    check_fits(MANIFEST, Deployment(SERVED, logical_cache_abi_sha256=MANIFEST.logical_cache_abi_sha256))
