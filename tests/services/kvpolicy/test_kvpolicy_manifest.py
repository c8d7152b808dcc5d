"""Manifest: canonical JSON identity, strict parsing, and one negative test per validation rule."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest

from services.kvpolicy.errors import KVPolicyError, ManifestInvalid
from services.kvpolicy.manifest import (
    DType,
    GQAReduction,
    KVVisibilityPolicyManifest,
    TensorContract,
    cache_abi_sha256,
    default_manifests,
)

DELETE = object()
TENSOR = TensorContract(
    num_layers=2,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=8,
    k_dtype=DType.FLOAT16,
    v_dtype=DType.FLOAT16,
)
RECALLABLE = {
    "mode": "recallable_remote",
    "handoff_id": None,
    "recall_threshold": 0.05,
    "page_size": 16,
    "max_pages_per_step": 4,
    "recall_cadence_steps": 1,
    "recall_timeout_ms": 200,
    "timeout_fallback": "continue_lossy",
    "full_recall_on_quality_gate": None,
}


def base(name: str = "snapkv") -> dict[str, Any]:
    return default_manifests(TENSOR)[name].to_dict()


def mutated(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return out


def expect_invalid(data: dict[str, Any], field: str) -> ManifestInvalid:
    with pytest.raises(ManifestInvalid) as info:
        KVVisibilityPolicyManifest.from_dict(data)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(f"{field}: ")
    return info.value


def test_defaults_are_valid_and_round_trip_through_canonical_json() -> None:
    manifests = default_manifests(TENSOR)
    assert sorted(manifests) == sorted(
        ["full", "window", "sink-recent", "snapkv", "snapkv-pyramid", "snapkv-adakv"]
    )
    shas = set()
    for name, manifest in manifests.items():
        assert manifest.name == name
        again = KVVisibilityPolicyManifest.from_json(manifest.canonical_json())
        assert again == manifest
        assert again.sha256 == manifest.sha256
        shas.add(manifest.sha256)
    assert len(shas) == len(manifests)
    assert manifests["snapkv"].selection.budget is not None
    assert manifests["snapkv"].selection.budget.fraction == 0.25
    assert manifests["snapkv"].tensor.q_to_kv_head_map == (0, 0, 1, 1)


def test_canonical_json_sorts_keys_recursively_keeps_arrays_and_is_compact() -> None:
    manifest = default_manifests(TENSOR)["snapkv"]
    text = manifest.canonical_json().decode("utf-8")
    assert " " not in text and "\n" not in text
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    assert '"q_to_kv_head_map":[0,0,1,1]' in text
    top_keys = list(json.loads(text))
    assert top_keys == sorted(top_keys)


def test_identity_ignores_input_key_order_but_not_values() -> None:
    data = base()

    def reverse_keys(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: reverse_keys(node[k]) for k in reversed(list(node))}
        return node

    manifest = KVVisibilityPolicyManifest.from_dict(data)
    reordered = KVVisibilityPolicyManifest.from_dict(reverse_keys(data))
    assert reordered.sha256 == manifest.sha256
    changed = KVVisibilityPolicyManifest.from_dict(
        mutated(data, "selection.snapkv.pooling_kernel", 7)
    )
    assert changed.sha256 != manifest.sha256
    assert len(manifest.sha256) == 64


def test_integer_given_for_a_float_field_canonicalizes_as_float() -> None:
    as_int = KVVisibilityPolicyManifest.from_dict(
        mutated(base("snapkv-pyramid"), "selection.allocation.beta", 20)
    )
    as_float = KVVisibilityPolicyManifest.from_dict(
        mutated(base("snapkv-pyramid"), "selection.allocation.beta", 20.0)
    )
    assert as_int.sha256 == as_float.sha256


def test_omitted_optional_fields_take_defaults_and_keep_identity() -> None:
    data = base("full")
    data = mutated(data, "quality", DELETE)
    data = mutated(data, "schema_version", DELETE)
    assert (
        KVVisibilityPolicyManifest.from_dict(data).sha256
        == default_manifests(TENSOR)["full"].sha256
    )


def test_recallable_manifest_is_accepted_when_complete() -> None:
    manifest = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "recoverability", dict(RECALLABLE))
    )
    assert manifest.recoverability.recallable
    assert manifest.recoverability.timeout_fallback is not None


def test_expand_owners_are_query_heads() -> None:
    manifest = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "selection.snapkv.gqa_reduction", "expand")
    )
    assert manifest.selection.snapkv is not None
    assert manifest.selection.snapkv.gqa_reduction is GQAReduction.EXPAND
    assert manifest.owners_are_query_heads and manifest.num_owners == 4
    assert manifest.owner_to_kv_head() == (0, 0, 1, 1)
    assert default_manifests(TENSOR)["snapkv"].num_owners == 2


def test_capacity_from_fraction_is_exact_and_floored_above_the_protected_rows() -> None:
    selection = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "selection.budget.fraction", 0.1)
    ).selection
    assert selection.capacity(30 * 10) == 30  # Decimal arithmetic: 0.1 * 300 is 30, not 31
    assert selection.capacity(1000) == 100
    assert selection.capacity(20) == selection.protected_rows + 1 == 17


def test_tensor_contract_bytes() -> None:
    assert TENSOR.bytes_per_row == 8 * (2 + 2)
    assert TENSOR.bytes_per_token == 2 * 2 * 32
    assert cache_abi_sha256(TENSOR) == cache_abi_sha256(TENSOR)


def test_error_hierarchy() -> None:
    error = ManifestInvalid("selection.unit", "bad")
    assert isinstance(error, KVPolicyError) and isinstance(error, ValueError)
    assert error.field == "selection.unit"


# (base manifest, dotted path, new value, expected field) — one row per validation rule.
NEGATIVE_RULES = [
    ("snapkv", "schema_version", 2, "schema_version"),
    ("snapkv", "name", "Bad Name", "name"),
    ("snapkv", "policy_manifest_id", "  ", "policy_manifest_id"),
    ("snapkv", "policy_generation", 0, "policy_generation"),
    ("snapkv", "checkpoint_generation", -1, "checkpoint_generation"),
    ("snapkv", "logical_cache_abi_sha256", "abc", "logical_cache_abi_sha256"),
    ("snapkv", "tensor.num_layers", 0, "tensor.num_layers"),
    ("snapkv", "tensor.num_q_heads", -4, "tensor.num_q_heads"),
    ("snapkv", "tensor.num_kv_heads", 0, "tensor.num_kv_heads"),
    ("snapkv", "tensor.head_dim", 0, "tensor.head_dim"),
    ("snapkv", "tensor.q_to_kv_head_map", [0, 0, 1], "tensor.q_to_kv_head_map"),
    ("snapkv", "tensor.q_to_kv_head_map", [0, 0, 1, 2], "tensor.q_to_kv_head_map"),
    ("snapkv", "tensor.q_to_kv_head_map", [0, 1, 0, 1], "tensor.q_to_kv_head_map"),
    ("snapkv", "tensor.q_to_kv_head_map", [], "tensor.q_to_kv_head_map"),
    ("snapkv", "tensor.k_dtype", "float64", "tensor.k_dtype"),
    ("snapkv", "tensor.key_positional_stage", "rope", "tensor.key_positional_stage"),
    ("snapkv", "selection.recent_window", 64, "selection.recent_window"),
    ("window", "selection.recent_window", None, "selection.recent_window"),
    ("window", "selection.recent_window", 0, "selection.recent_window"),
    ("snapkv", "selection.budget", None, "selection.budget"),
    ("full", "selection.budget", {"scope": "owner", "rows_per_owner": 8}, "selection.budget"),
    ("snapkv", "selection.snapkv", None, "selection.snapkv"),
    ("window", "selection.snapkv", {"observation_window": 8}, "selection.snapkv"),
    ("snapkv", "selection.allocation", None, "selection.allocation"),
    ("snapkv", "selection.evidence", "positional", "selection.evidence"),
    ("snapkv", "selection.unit", "token", "selection.unit"),
    ("snapkv", "selection.unit", "per-head", "selection.unit"),
    ("sink-recent", "selection.protected.sinks", 0, "selection.protected.sinks"),
    ("window", "selection.protected.sinks", 2, "selection.protected.sinks"),
    ("snapkv", "selection.protected.sinks", -1, "selection.protected.sinks"),
    (
        "snapkv",
        "selection.protected.observation_suffix",
        False,
        "selection.protected.observation_suffix",
    ),
    ("snapkv", "selection.phase", "decode", "selection.phase"),
    ("snapkv", "selection.update_cadence", "every_step", "selection.update_cadence"),
    ("window", "selection.update_cadence", "never", "selection.update_cadence"),
    ("full", "selection.update_cadence", "every_step", "selection.update_cadence"),
    ("snapkv", "selection.tie_rule", "random", "selection.tie_rule"),
    ("snapkv", "selection.budget.rows_per_owner", 64, "selection.budget"),
    ("snapkv", "selection.budget.scope", "global", "selection.budget.scope"),
    ("snapkv", "selection.snapkv.observation_window", 0, "selection.snapkv.observation_window"),
    ("snapkv", "selection.snapkv.pooling_kernel", 4, "selection.snapkv.pooling_kernel"),
    ("snapkv", "selection.snapkv.pooling", "none", "selection.snapkv.pooling_kernel"),
    ("snapkv", "selection.snapkv.pooling", "median", "selection.snapkv.pooling"),
    ("snapkv", "selection.snapkv.aggregation", "product", "selection.snapkv.aggregation"),
    ("snapkv", "selection.snapkv.gqa_reduction", "min", "selection.snapkv.gqa_reduction"),
    ("snapkv", "selection.allocation.method", "streamingllm", "selection.allocation.method"),
    ("snapkv-pyramid", "selection.allocation.beta", None, "selection.allocation.beta"),
    ("snapkv-pyramid", "selection.allocation.beta", 0.5, "selection.allocation.beta"),
    ("snapkv", "selection.allocation.uniform_share", 0.2, "selection.allocation.uniform_share"),
    ("snapkv-adakv", "selection.allocation.uniform_share", 1.5, "selection.allocation.uniform_share"),
    ("snapkv-adakv", "selection.allocation.alpha", 0.2, "selection.allocation.alpha"),
    ("snapkv", "selection.allocation.floor_rows", 1, "selection.allocation.floor_rows"),
    ("snapkv", "selection.allocation.cap_rows", 8, "selection.allocation.cap_rows"),
    ("snapkv", "selection.snapkv.gqa_order", "reduce_then_pool", "selection.snapkv.gqa_order"),
    ("snapkv", "selection.snapkv.gqa_order", "interleaved", "selection.snapkv.gqa_order"),
    ("window", "selection.tie_rule", "position_descending", "selection.tie_rule"),
    ("snapkv", "policy_manifest_id", "snapkv@2", "policy_manifest_id"),
    ("snapkv", "selection.snapkv.aggregation", "mean", "selection.snapkv.aggregation"),
    ("snapkv", "selection.snapkv.pooling_kernel", 1, "selection.snapkv.pooling_kernel"),
    ("full", "selection.phase", "prefill", "selection.phase"),
    ("snapkv", "policy_generation", 2, "policy_manifest_id"),
    ("snapkv", "tensor.gqa_grouping", "custom", "tensor.gqa_grouping"),
    ("snapkv", "representation.consumer_schema", "rows.v1", "representation.consumer_schema"),
    ("snapkv", "selection.allocation.floor_rows", -1, "selection.allocation.floor_rows"),
    ("snapkv", "selection.allocation.cap_rows", 0, "selection.allocation.cap_rows"),
    ("snapkv", "representation.rows", "replacement_rows", "representation.rows"),
    ("snapkv", "representation.fidelity", "full_cache_exact", "representation.fidelity"),
    ("full", "representation.fidelity", "lossy_subset", "representation.fidelity"),
    ("full", "representation.rows", "replacement_rows", "representation.rows"),
    ("snapkv", "representation.fidelity", "lossy_replacement", "representation.rows"),
    ("snapkv", "representation.fidelity", "approximate", "representation.fidelity"),
    ("snapkv", "recoverability.mode", "recallable_local", "recoverability.recall_threshold"),
    ("snapkv", "recoverability.mode", "recallable_somewhere", "recoverability.mode"),
    ("snapkv", "recoverability.handoff_id", "offload-a", "recoverability.handoff_id"),
    (
        "snapkv",
        "recoverability.full_recall_on_quality_gate",
        0.5,
        "recoverability.full_recall_on_quality_gate",
    ),
    ("snapkv", "quality.on_invalid_state", "ignore", "quality.on_invalid_state"),
    ("snapkv", "quality.on_capacity_exhausted", "evict", "quality.on_capacity_exhausted"),
]


@pytest.mark.parametrize(
    ("name", "path", "value", "field"),
    NEGATIVE_RULES,
    ids=[f"{r[1]}={r[2]!r}" for r in NEGATIVE_RULES],
)
def test_validation_rule_rejects_with_field_path(
    name: str, path: str, value: Any, field: str
) -> None:
    expect_invalid(mutated(base(name), path, value), field)


def test_contiguous_grouping_needs_divisible_heads() -> None:
    data = mutated(base("full"), "tensor.q_to_kv_head_map", [])
    expect_invalid(mutated(data, "tensor.num_kv_heads", 3), "tensor.gqa_grouping")


def test_custom_map_must_read_every_kv_head() -> None:
    data = mutated(base(), "tensor.gqa_grouping", "custom")
    assert KVVisibilityPolicyManifest.from_dict(
        mutated(data, "tensor.q_to_kv_head_map", [1, 0, 1, 0])
    ).tensor.q_to_kv_head_map == (1, 0, 1, 0)
    error = expect_invalid(
        mutated(data, "tensor.q_to_kv_head_map", [0, 0, 0, 0]), "tensor.q_to_kv_head_map"
    )
    assert "read by no query head" in error.reason


def test_map_errors_say_what_is_wrong() -> None:
    assert (
        "outside"
        in expect_invalid(
            mutated(base(), "tensor.q_to_kv_head_map", [0, 0, 1, 2]), "tensor.q_to_kv_head_map"
        ).reason
    )
    assert (
        "contradicts"
        in expect_invalid(
            mutated(base(), "tensor.q_to_kv_head_map", [0, 1, 0, 1]), "tensor.q_to_kv_head_map"
        ).reason
    )
    assert (
        "3 entries"
        in expect_invalid(
            mutated(base(), "tensor.q_to_kv_head_map", [0, 0, 1]), "tensor.q_to_kv_head_map"
        ).reason
    )
    assert (
        "head-level"
        in expect_invalid(
            mutated(base(), "tensor.q_to_kv_head_map", []), "tensor.q_to_kv_head_map"
        ).reason
    )


def test_budget_needs_exactly_one_of_rows_and_fraction() -> None:
    both = mutated(base(), "selection.budget.rows_per_owner", 64)
    expect_invalid(both, "selection.budget")
    rows_only = mutated(both, "selection.budget.fraction", None)
    assert KVVisibilityPolicyManifest.from_dict(rows_only).selection.capacity(10_000) == 64
    expect_invalid(
        mutated(rows_only, "selection.budget.rows_per_owner", 0), "selection.budget.rows_per_owner"
    )
    expect_invalid(mutated(base(), "selection.budget.fraction", 1.5), "selection.budget.fraction")


def test_capacity_must_exceed_observation_window_and_sinks() -> None:
    rows = mutated(
        mutated(base(), "selection.budget.fraction", None), "selection.budget.rows_per_owner", 16
    )
    error = expect_invalid(rows, "selection.budget.rows_per_owner")  # W_obs = 16
    assert "protected" in error.reason
    ok = mutated(rows, "selection.budget.rows_per_owner", 17)
    KVVisibilityPolicyManifest.from_dict(ok)
    expect_invalid(mutated(ok, "selection.protected.sinks", 1), "selection.budget.rows_per_owner")


@pytest.mark.parametrize(
    ("method", "scope", "params", "field"),
    [
        ("zigzagkv", "global", {"b_min": -1, "coverage": 0.9}, "selection.allocation.b_min"),
        ("zigzagkv", "global", {"b_min": 1, "coverage": 0.0}, "selection.allocation.coverage"),
        ("zigzagkv", "global", {"b_min": 1}, "selection.allocation.coverage"),
        (
            "headkv",
            "global",
            {"beta": 2.0, "headkv_profile_sha256": "not-a-digest"},
            "selection.allocation.headkv_profile_sha256",
        ),
        ("headkv", "global", {"beta": 2.0}, "selection.allocation.headkv_profile_sha256"),
        ("uniform", "owner", {"b_min": 2}, "selection.allocation.b_min"),
    ],
)
def test_allocation_parameter_rules(
    method: str, scope: str, params: dict[str, Any], field: str
) -> None:
    data = mutated(base(), "selection.budget.scope", scope)
    expect_invalid(mutated(data, "selection.allocation", {"method": method, **params}), field)


def test_allocation_cap_below_floor_is_rejected() -> None:
    data = mutated(base(), "selection.allocation.floor_rows", 3)
    expect_invalid(
        mutated(data, "selection.allocation.cap_rows", 2), "selection.allocation.cap_rows"
    )


@pytest.mark.parametrize(
    "missing",
    [
        "recall_threshold",
        "page_size",
        "max_pages_per_step",
        "recall_cadence_steps",
        "recall_timeout_ms",
        "timeout_fallback",
    ],
)
def test_recallable_mode_requires_every_recall_field(missing: str) -> None:
    expect_invalid(
        mutated(base(), "recoverability", {**RECALLABLE, missing: None}),
        f"recoverability.{missing}",
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("recall_threshold", 1.0),
        ("recall_threshold", -0.01),
        ("page_size", 0),
        ("max_pages_per_step", 0),
        ("recall_cadence_steps", 0),
        ("recall_timeout_ms", -5),
        ("full_recall_on_quality_gate", 1.0),
        ("full_recall_on_quality_gate", 0.0),
        ("handoff_id", " "),
        ("handoff_id", "offload-a"),
    ],
)
def test_recall_field_ranges(field: str, value: Any) -> None:
    expect_invalid(
        mutated(base(), "recoverability", {**RECALLABLE, field: value}), f"recoverability.{field}"
    )


def test_threshold_zero_means_recall_every_omitted_page_and_has_its_own_identity() -> None:
    zero = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "recoverability", {**RECALLABLE, "recall_threshold": 0.0})
    )
    assert zero.recoverability.recall_threshold == 0.0
    gated = KVVisibilityPolicyManifest.from_dict(
        mutated(
            base(),
            "recoverability",
            {**RECALLABLE, "recall_threshold": 0, "full_recall_on_quality_gate": 0.5},
        )
    )
    assert gated.recoverability.full_recall_on_quality_gate == 0.5
    default = KVVisibilityPolicyManifest.from_dict(mutated(base(), "recoverability", RECALLABLE))
    assert len({zero.sha256, gated.sha256, default.sha256}) == 3
    again = KVVisibilityPolicyManifest.from_json(zero.canonical_json())
    assert again.sha256 == zero.sha256


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_key_code_bits_round_trip_and_have_their_own_identity(bits: int) -> None:
    coded = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "recoverability", {**RECALLABLE, "key_code_bits": bits})
    )
    assert coded.recoverability.key_code_bits == bits
    again = KVVisibilityPolicyManifest.from_json(coded.canonical_json())
    assert again == coded and again.sha256 == coded.sha256
    assert json.loads(coded.canonical_json())["recoverability"]["key_code_bits"] == bits
    plain = KVVisibilityPolicyManifest.from_dict(mutated(base(), "recoverability", RECALLABLE))
    assert coded.sha256 != plain.sha256


def test_a_manifest_without_key_code_bits_keeps_its_canonical_json() -> None:
    """Absent (or null) key_code_bits is not written: the recoverability object has exactly
    the keys it had before the field existed, so every stored manifest keeps its sha."""
    plain = KVVisibilityPolicyManifest.from_dict(mutated(base(), "recoverability", RECALLABLE))
    null = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "recoverability", {**RECALLABLE, "key_code_bits": None})
    )
    text = plain.canonical_json()
    assert b"key_code_bits" not in text and null.canonical_json() == text
    assert set(json.loads(text)["recoverability"]) == set(RECALLABLE)
    assert plain.recoverability.key_code_bits is None and null.sha256 == plain.sha256
    for manifest in default_manifests(TENSOR).values():
        assert b"key_code_bits" not in manifest.canonical_json()


@pytest.mark.parametrize("value", [0, 3, 8, True, "2"])
def test_key_code_bits_must_be_one_two_or_four(value: Any) -> None:
    expect_invalid(
        mutated(base(), "recoverability", {**RECALLABLE, "key_code_bits": value}),
        "recoverability.key_code_bits",
    )


def test_key_code_bits_need_a_recallable_mode() -> None:
    recoverability = base()["recoverability"]
    expect_invalid(
        mutated(base(), "recoverability", {**recoverability, "key_code_bits": 2}),
        "recoverability.key_code_bits",
    )


def test_the_omitted_value_term_round_trips_needs_codes_and_is_only_ever_true() -> None:
    data = {**RECALLABLE, "key_code_bits": 4, "omitted_value_term": True}
    term = KVVisibilityPolicyManifest.from_dict(mutated(base(), "recoverability", data))
    assert term.recoverability.omitted_value_term is True
    again = KVVisibilityPolicyManifest.from_json(term.canonical_json())
    assert again == term and again.sha256 == term.sha256
    coded = KVVisibilityPolicyManifest.from_dict(
        mutated(base(), "recoverability", {**RECALLABLE, "key_code_bits": 4}))
    assert coded.sha256 != term.sha256 and b"omitted_value_term" not in coded.canonical_json()
    for value in (False, 1, "true"):
        expect_invalid(mutated(base(), "recoverability", {**data, "omitted_value_term": value}),
                       "recoverability.omitted_value_term")
    expect_invalid(mutated(base(), "recoverability", {**RECALLABLE, "omitted_value_term": True}),
                   "recoverability.omitted_value_term")


def test_full_policy_has_nothing_to_recall() -> None:
    expect_invalid(mutated(base("full"), "recoverability", dict(RECALLABLE)), "recoverability.mode")


def test_lossy_replacement_with_consumer_schema_is_accepted() -> None:
    data = mutated(
        base(),
        "representation",
        {
            "rows": "replacement_rows",
            "fidelity": "lossy_replacement",
            "consumer_schema": "merged-rows.v1",
        },
    )
    assert (
        KVVisibilityPolicyManifest.from_dict(data).representation.consumer_schema
        == "merged-rows.v1"
    )


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("bogus", 1, "bogus"),
        ("selection.snapkv.bogus", 1, "selection.snapkv.bogus"),
        ("tensor.head_dim", DELETE, "tensor.head_dim"),
        ("tensor.head_dim", "8", "tensor.head_dim"),
        ("tensor.head_dim", 8.0, "tensor.head_dim"),
        ("tensor.head_dim", True, "tensor.head_dim"),
        ("selection.protected.observation_suffix", 1, "selection.protected.observation_suffix"),
        ("selection.budget.fraction", "0.25", "selection.budget.fraction"),
        ("tensor.q_to_kv_head_map", "0011", "tensor.q_to_kv_head_map"),
        ("tensor.q_to_kv_head_map", [0, 0, 1, "1"], "tensor.q_to_kv_head_map[3]"),
        ("selection", [1, 2], "selection"),
        ("name", 7, "name"),
    ],
)
def test_parsing_rejects_unknown_missing_and_mistyped_fields(
    path: str, value: Any, field: str
) -> None:
    expect_invalid(mutated(base(), path, value), field)


def test_from_json_rejects_duplicates_constants_and_garbage() -> None:
    text = default_manifests(TENSOR)["full"].canonical_json().decode()
    with pytest.raises(ManifestInvalid) as duplicate:
        KVVisibilityPolicyManifest.from_json(text[:-1] + ',"name":"full"}')
    assert duplicate.value.field == "name"
    with pytest.raises(ManifestInvalid) as constant:
        KVVisibilityPolicyManifest.from_json(
            text.replace('"checkpoint_generation":0', '"checkpoint_generation":NaN')
        )
    assert constant.value.field == "manifest"
    with pytest.raises(ManifestInvalid) as garbage:
        KVVisibilityPolicyManifest.from_json("{not json")
    assert garbage.value.field == "manifest"
    with pytest.raises(ManifestInvalid) as not_object:
        KVVisibilityPolicyManifest.from_json("[1]")
    assert not_object.value.field == "manifest"


def test_python_callers_may_pass_strings_and_lists() -> None:
    loose = TensorContract(2, 4, 2, 8, "float16", "float16", [0, 0, 1, 1])  # type: ignore[arg-type]
    assert loose == replace(TENSOR, q_to_kv_head_map=(0, 0, 1, 1))
    assert loose.k_dtype is DType.FLOAT16 and loose.bytes_per_row == 32
    with pytest.raises(ManifestInvalid) as info:
        TensorContract(2, 4, 2, 8, "float64", "float16")  # type: ignore[arg-type]
    assert info.value.field == "tensor.k_dtype"
