"""Manifest bounds: every integer is range-checked naming its field, the bounds admit real
models, validation costs microseconds whatever the input, and errors echo ~100 characters."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest

from services.kvpolicy.errors import ManifestInvalid
from services.kvpolicy.manifest import (
    MAX_GENERATION,
    MAX_HEADS,
    MAX_TOKENS,
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)

TENSOR = TensorContract(2, 4, 2, 8, DType.FLOAT16, DType.FLOAT16)
MAX_MESSAGE_CHARS = 400
RECALLABLE = {
    "mode": "recallable_remote", "handoff_id": None, "recall_threshold": 0.9, "page_size": 8,
    "max_pages_per_step": 4, "recall_cadence_steps": 1, "recall_timeout_ms": 200,
    "timeout_fallback": "continue_lossy", "full_recall_on_quality_gate": None,
}


def base(name: str = "snapkv") -> dict[str, Any]:
    data = default_manifests(TENSOR)[name].to_dict()
    return {**data, "recoverability": RECALLABLE} if name == "snapkv" else data


def mutated(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[leaf] = value
    return out


def refused(data: dict[str, Any] | str, field: str) -> ManifestInvalid:
    with pytest.raises(ManifestInvalid) as info:
        if isinstance(data, str):
            KVVisibilityPolicyManifest.from_json(data)
        else:
            KVVisibilityPolicyManifest.from_dict(data)
    assert info.value.field == field, str(info.value)
    assert len(str(info.value)) < MAX_MESSAGE_CHARS, str(info.value)[:500]
    return info.value


# (policy, path, largest valid value); one past it is refused, and so is 2**63.
INTEGER_FIELDS = [
    ("snapkv", "policy_generation", MAX_GENERATION),
    ("snapkv", "checkpoint_generation", MAX_GENERATION),
    ("snapkv", "selection.snapkv.observation_window", MAX_TOKENS),
    ("snapkv", "selection.snapkv.pooling_kernel", 1023),
    ("snapkv-pyramid", "selection.allocation.floor_rows", MAX_TOKENS),
    ("snapkv-pyramid", "selection.allocation.cap_rows", MAX_TOKENS),
    ("snapkv", "recoverability.page_size", MAX_TOKENS),
    ("snapkv", "recoverability.max_pages_per_step", MAX_TOKENS),
    ("snapkv", "recoverability.recall_cadence_steps", MAX_TOKENS),
    ("snapkv", "recoverability.recall_timeout_ms", 3_600_000),
    ("window", "selection.recent_window", MAX_TOKENS),
    ("sink-recent", "selection.protected.sinks", MAX_TOKENS),
    ("full", "tensor.num_layers", 1024),
    ("full", "tensor.head_dim", 4096),
]


@pytest.mark.parametrize(("name", "path", "largest"), INTEGER_FIELDS, ids=[f[1] for f in INTEGER_FIELDS])
def test_every_integer_is_range_checked_naming_its_field(name: str, path: str, largest: int) -> None:
    data = base(name)
    if path == "selection.snapkv.observation_window":  # budgets must exceed the window
        data = mutated(data, "selection.budget", {"scope": "owner", "fraction": None,
                                                  "rows_per_owner": MAX_TOKENS})
        data = mutated(data, "selection.allocation.cap_rows", None)
        largest = MAX_TOKENS - 1
    if path == "selection.allocation.cap_rows" or path == "selection.allocation.floor_rows":
        data = mutated(data, "selection.allocation.cap_rows", MAX_TOKENS)
    if path == "policy_generation":  # policy_manifest_id is name@policy_generation
        data = mutated(data, "policy_manifest_id", f"{data['name']}@{largest}")
    KVVisibilityPolicyManifest.from_dict(mutated(data, path, largest))
    refused(mutated(data, path, largest + 2), path)
    refused(mutated(data, path, 2**63), path)
    refused(mutated(data, path, -(2**63)), path)


def test_bounds_admit_real_models() -> None:
    llama_405b = TensorContract(126, 128, 8, 128, DType.BFLOAT16, DType.BFLOAT16)
    gemma2_27b = TensorContract(46, 32, 16, 128, DType.BFLOAT16, DType.BFLOAT16)
    gemma2_9b = TensorContract(42, 16, 8, 256, DType.BFLOAT16, DType.BFLOAT16)
    for tensor in (llama_405b, gemma2_27b, gemma2_9b):
        manifest = default_manifests(tensor)["snapkv"]
        assert KVVisibilityPolicyManifest.from_json(manifest.canonical_json()) == manifest


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"tensor.num_kv_heads": 10**7, "tensor.gqa_grouping": "custom"}, "tensor.num_kv_heads"),
        ({"tensor.num_q_heads": 10**7, "tensor.q_to_kv_head_map": [0, 1] * 512}, "tensor.num_q_heads"),
        ({"tensor.q_to_kv_head_map": list(range(10**5))}, "tensor.q_to_kv_head_map"),
        ({"tensor.num_layers": 1024, "tensor.num_q_heads": 1024, "tensor.num_kv_heads": 1024,
          "tensor.q_to_kv_head_map": list(range(1024))}, "tensor.num_q_heads"),
    ],
    ids=["10M K/V heads, custom map", "10M query heads", "100K-entry map", "1024 x 1024 heads"],
)
def test_huge_shapes_are_refused_before_anything_is_expanded(changes: dict[str, Any], field: str) -> None:
    data = base()
    for path, value in changes.items():
        data = mutated(data, path, value)
    text = json.dumps(data)
    started = time.perf_counter()
    refused(text, field)
    assert time.perf_counter() - started < 1.0  # the defect took 4 s; this bounds blocking, it is no benchmark


def test_a_5000_digit_integer_is_refused_naming_its_field() -> None:
    text = json.dumps(mutated(base(), "policy_generation", 7))
    text = text.replace('"policy_generation": 7', f'"policy_generation": {"9" * 5000}')
    error = refused(text, "policy_generation")
    assert "5000 digits" in error.reason
    deep = json.dumps(mutated(base(), "tensor.q_to_kv_head_map", [7, 0, 1, 1]))
    refused(deep.replace("[7, ", f"[{'1' * 5000}, "), "tensor.q_to_kv_head_map[0]")


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("name", "x" * 10_000, "name"),
        ("policy_manifest_id", "x" * 10_000, "policy_manifest_id"),
        ("selection.unit", "u" * 10_000, "selection.unit"),
        ("tensor.num_layers", "9" * 10_000, "tensor.num_layers"),
        ("tensor.k_dtype", ["x" * 10_000] * 1000, "tensor.k_dtype"),
        ("tensor.q_to_kv_head_map", [0, 0, 1, 10**90], "tensor.q_to_kv_head_map"),
        ("recoverability.handoff_id", "h" * 10_000, "recoverability.handoff_id"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_long_bad_values_are_echoed_in_bounded_messages(path: str, value: Any, field: str) -> None:
    refused(mutated(base(), path, value), field)


def test_a_long_unknown_key_is_a_bounded_field_path() -> None:
    data = base()
    data["k" * 10_000] = 1
    with pytest.raises(ManifestInvalid) as info:
        KVVisibilityPolicyManifest.from_dict(data)
    assert info.value.field.startswith("kkk") and len(info.value.field) < 100


def test_more_kv_heads_than_query_heads_is_refused_not_a_crash() -> None:
    data = mutated(mutated(base("full"), "tensor.q_to_kv_head_map", []), "tensor.num_kv_heads", 8)
    refused(data, "tensor.num_kv_heads")
    custom = mutated(mutated(base("full"), "tensor.gqa_grouping", "custom"), "tensor.q_to_kv_head_map", [])
    refused(mutated(mutated(custom, "tensor.num_q_heads", 5), "tensor.num_kv_heads", 2), "tensor.gqa_grouping")


def test_head_map_length_is_bounded_by_the_number_of_heads() -> None:
    assert MAX_HEADS == 1024
    refused(mutated(base(), "tensor.q_to_kv_head_map", [0] * (MAX_HEADS + 1)), "tensor.q_to_kv_head_map")
