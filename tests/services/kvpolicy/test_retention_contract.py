"""The decode-time retention contract in a manifest: bad parameters are refused naming the
field, the named policies round-trip through canonical JSON, and manifests without retention
keep their identity (issue 18)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from services.kvpolicy.errors import ManifestInvalid
from services.kvpolicy.manifest import (
    DType,
    GQAReduction,
    KVVisibilityPolicyManifest,
    Phase,
    TensorContract,
    UpdateCadence,
    default_manifests,
)
from services.kvpolicy.retention_contract import (
    KeyformerParams,
    PositionContract,
    PublishCadence,
    RetentionContract,
    RetentionMethod,
    ScissorhandsParams,
    ScoreOwner,
)
from services.kvpolicy.retention_manifests import retention_contracts, retention_manifests

TENSOR = TensorContract(2, 4, 2, 8, DType.FLOAT16, DType.FLOAT16)


def refused(build: Any) -> str:
    with pytest.raises(ManifestInvalid) as caught:
        build()
    assert len(str(caught.value)) < 400
    return caught.value.field


H2O = RetentionContract(RetentionMethod.H2O, 8, 4)
REFUSALS = [
    ("selection.retention.budget_rows",
     lambda: RetentionContract(RetentionMethod.H2O, 6, 4, sinks=2)),  # no room past protected
    ("selection.retention.recent_window", lambda: RetentionContract(RetentionMethod.H2O, 4, 5)),
    ("selection.retention.budget_rows", lambda: RetentionContract(RetentionMethod.WINDOW, 8, 4)),
    ("selection.retention.sinks", lambda: RetentionContract(RetentionMethod.WINDOW, 8, 6, 2)),
    ("selection.retention.sinks", lambda: RetentionContract(RetentionMethod.SINK_RECENT, 4, 4)),
    ("selection.retention.budget_rows", lambda: RetentionContract(RetentionMethod.H2O, 0, 1)),
    ("selection.retention.score_owner", lambda: RetentionContract(
        RetentionMethod.WINDOW, 4, 4, score_owner=ScoreOwner.KV_HEAD_MAX)),
    ("selection.retention.publish_every_steps", lambda: replace(H2O, publish_every_steps=None)),
    ("selection.retention.publish_every_steps", lambda: replace(
        H2O, publish_cadence=PublishCadence.AT_END)),
    ("selection.retention.publish_every_steps", lambda: replace(H2O, publish_every_steps=0)),
    ("selection.retention.scissorhands", lambda: RetentionContract(
        RetentionMethod.SCISSORHANDS, 8, 2)),
    ("selection.retention.keyformer", lambda: replace(H2O, keyformer=KeyformerParams(10))),
    ("selection.retention.keyformer.schedule_steps", lambda: KeyformerParams()),
    ("selection.retention.keyformer.tau_end", lambda: KeyformerParams(10, tau_end=0.0)),
    ("selection.retention.scissorhands.history_window", lambda: ScissorhandsParams(64, 1)),
    ("selection.retention.scissorhands.threshold", lambda: ScissorhandsParams(8, 1, 1.5)),
    ("selection.retention.scissorhands.drop_batch", lambda: RetentionContract(
        RetentionMethod.SCISSORHANDS, 8, 4, scissorhands=ScissorhandsParams(8, 6))),
]


@pytest.mark.parametrize(("path", "build"), REFUSALS)
def test_bad_retention_parameters_are_refused_naming_the_field(path: str, build: Any) -> None:
    assert refused(build) == path


def plain(name: str) -> dict[str, Any]:
    return retention_manifests(TENSOR, budget_rows=32, sinks=2)[name].to_dict()


@pytest.mark.parametrize(("edit", "path"), [
    (("publish_cadence", "hourly"), "selection.retention.publish_cadence"),
    (("method", "lru"), "selection.retention.method"),
    (("positions", "nope"), "selection.retention.positions"),
    (("budget", 3), "selection.retention.budget"),
])
def test_unknown_values_in_json_are_refused_naming_the_field(edit: tuple[str, Any],
                                                              path: str) -> None:
    data = plain("h2o")
    data["selection"]["retention"][edit[0]] = edit[1]
    assert refused(lambda: KVVisibilityPolicyManifest.from_json(json.dumps(data))) == path
    keyformer = plain("keyformer")
    del keyformer["selection"]["retention"]["keyformer"]["schedule_steps"]
    assert refused(lambda: KVVisibilityPolicyManifest.from_dict(keyformer)) == (
        "selection.retention.keyformer.schedule_steps")


def test_named_policies_round_trip_and_declare_what_they_retain() -> None:
    manifests = retention_manifests(TENSOR, budget_rows=32, sinks=2)
    assert set(manifests) == set(retention_contracts())
    for name, manifest in manifests.items():
        again = KVVisibilityPolicyManifest.from_json(manifest.canonical_json())
        assert again == manifest and again.sha256 == manifest.sha256, name
        retention = manifest.selection.retention
        assert retention is not None and retention.budget_rows == 32
        assert (manifest.selection.phase, manifest.selection.update_cadence) == (
            Phase.BOTH, UpdateCadence.EVERY_STEP)
    assert manifests["sink-recent-local"].selection.retention.positions is (  # type: ignore
        PositionContract.CACHE_LOCAL)
    assert manifests["snapkv-h2o"].selection.snapkv is not None  # prompt view + decode policy


def test_manifests_without_retention_keep_their_canonical_json() -> None:
    for manifest in default_manifests(TENSOR).values():
        assert manifest.selection.retention is None
        assert b"retention" not in manifest.canonical_json()
        assert KVVisibilityPolicyManifest.from_json(manifest.canonical_json()) == manifest


def test_retention_and_the_prefill_selection_agree() -> None:
    named = retention_manifests(TENSOR, budget_rows=32, sinks=2)
    window, snapkv, h2o = named["window-decode"], named["snapkv-h2o"], named["h2o"]
    assert refused(lambda: replace(window, selection=replace(
        window.selection, retention=replace(window.selection.retention, budget_rows=33,
                                            recent_window=33)))) == (
        "selection.retention.recent_window")
    assert refused(lambda: replace(window.selection, retention=h2o.selection.retention)) == (
        "selection.retention.method")
    assert refused(lambda: replace(snapkv.selection, phase=Phase.PREFILL)) == "selection.phase"
    served = default_manifests(TENSOR)["window"]
    assert refused(lambda: replace(served.selection, phase=Phase.BOTH,
                                   update_cadence=UpdateCadence.EVERY_STEP)) == (
        "selection.retention")
    assert refused(lambda: replace(h2o.selection, update_cadence=UpdateCadence.NEVER)) == (
        "selection.update_cadence")
    expand = replace(snapkv.selection, snapkv=replace(
        snapkv.selection.snapkv, gqa_reduction=GQAReduction.EXPAND))  # type: ignore[arg-type]
    assert refused(lambda: replace(snapkv, selection=expand)) == "selection.retention.score_owner"
    query = replace(expand.retention, score_owner=ScoreOwner.QUERY_HEAD)  # type: ignore[arg-type]
    per_query = replace(snapkv, selection=replace(expand, retention=query))
    assert per_query.owners_are_query_heads
