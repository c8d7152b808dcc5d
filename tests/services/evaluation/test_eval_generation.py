"""In-process compressed generation against independent references: the runtime's full-cache
`generate` for manifest `full`, and a dense masked decode (every row kept, omitted rows hidden by
a -inf mask, query heads walked one by one) for compressed manifests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from eval_helpers import MaskedDenseDecode, needle_prompt_ids

from services.evaluation.generation import admit, compress_prompt, compressed_generate, feed
from services.kvpolicy.manifest import GQAReduction, KVVisibilityPolicyManifest, SnapKVParams
from services.model import InvalidModelInput, LoadedModel, generate

PROMPT_LEN = 120
STEPS = 5


def expand(manifest: KVVisibilityPolicyManifest) -> KVVisibilityPolicyManifest:
    """The same SnapKV manifest with per-query-head owners (GQA reduction `expand`)."""
    params = manifest.selection.snapkv
    assert params is not None
    snapkv = SnapKVParams(params.observation_window, gqa_reduction=GQAReduction.EXPAND)
    selection = dataclasses.replace(manifest.selection, snapkv=snapkv)
    return dataclasses.replace(manifest, name="snapkv-expand", policy_manifest_id="snapkv-expand@1",
                               selection=selection)


def test_full_manifest_is_the_runtime_full_cache_generate(
    needle_model: LoadedModel, small_manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    ids = needle_prompt_ids(needle_model, PROMPT_LEN, seed=1)
    result = compressed_generate(needle_model, small_manifests["full"], ids, max_new_tokens=8)
    assert list(result.tokens) == generate(needle_model, ids, max_new_tokens=8)
    assert result.ledger.omitted_rows == 0
    assert result.ledger.visible_rows == needle_model.config.num_layers * 2 * PROMPT_LEN


POLICIES = ["snapkv", "snapkv-pyramid", "snapkv-expand", "window", "sink-recent"]


@pytest.mark.parametrize("policy", POLICIES)
def test_compressed_decode_equals_dense_masked_decode(
    needle_model: LoadedModel, small_manifests: dict[str, KVVisibilityPolicyManifest], policy: str
) -> None:
    manifest = small_manifests.get(policy) or expand(small_manifests["snapkv"])
    ids = needle_prompt_ids(needle_model, PROMPT_LEN, seed=2)
    result = compressed_generate(needle_model, manifest, ids, max_new_tokens=STEPS)
    prompt = result.prompt
    assert result.ledger.omitted_rows > 0 and result.ledger.visible_rows == prompt.view.total_rows

    config = needle_model.config
    owner_of = config.q_to_kv_head_map  # query head -> owner (its K/V head, or itself)
    if manifest.owners_are_query_heads:
        owner_of = tuple(range(config.num_q_heads))
    reference = MaskedDenseDecode(
        needle_model, prompt.forward.result, prompt.selection.positions, owner_of
    )
    expected = [int(prompt.forward.result.logits.argmax())]
    while len(expected) < STEPS:
        expected.append(int(reference.step(expected[-1]).argmax()))
    assert list(result.tokens) == expected

    # Logits, not only argmaxes: teacher-force the same tokens through both.
    cache = admit(needle_model, prompt, extra_rows=STEPS)
    again = MaskedDenseDecode(
        needle_model, prompt.forward.result, prompt.selection.positions, owner_of
    )
    for token in expected:
        torch.testing.assert_close(feed(needle_model, cache, [token]), again.step(token),
                                   atol=1e-4, rtol=1e-4)


def test_a_shared_forward_must_carry_the_manifests_window(
    needle_model: LoadedModel, small_manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    ids = needle_prompt_ids(needle_model, PROMPT_LEN, seed=3)
    static = compress_prompt(needle_model, small_manifests["window"], ids)  # captures no window
    with pytest.raises(InvalidModelInput) as error:
        compress_prompt(needle_model, small_manifests["snapkv"], ids, shared_forward=static.forward)
    assert error.value.field == "shared_forward"
    shared = compress_prompt(needle_model, small_manifests["snapkv"], ids).forward
    again = compress_prompt(needle_model, small_manifests["snapkv-adakv"], ids, shared_forward=shared)
    alone = compress_prompt(needle_model, small_manifests["snapkv-adakv"], ids)
    assert again.selection == alone.selection
    assert again.compressed.receipt.digest == alone.compressed.receipt.digest
