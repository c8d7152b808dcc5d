"""The three recoverability modes end to end through the gateway of the shared `kvrelay up`
stack (separate processes, real gRPC, Redis and gloo), on the tiny e2e checkpoint.

- `omitted_irrecoverable` (SnapKV): nothing besides the view travels; no recall.
- `recallable_remote`: the page summaries travel with the view, the omitted rows stay in the
  prefill worker's offload store and come back over the pair group when the decode worker
  recalls them.
- `recallable_local`: summaries and omitted rows travel with the view (the decode worker's
  host tier), and recall reads them there.

The recall manifests put the full-recall gate just above zero, so the first decode step
recalls every omitted page: the answer then equals the model's own full-cache greedy answer,
every omitted row is counted as recalled, and the recall's successor state (generation 2)
went through the policy service's fence. In every mode the bytes moved equal the ledger.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from e2e_helpers import UpStack, fence_of, needle_ids

from services.gateway.client import GatewayClient, generate_request
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    default_manifests,
)
from services.model import LoadedModel, generate
from services.offload.recall import RecallKnobs, with_recall
from services.policy import PolicyClient, PolicyClientConfig

pytestmark = pytest.mark.timeout(180)
MAX_TOKENS = 8
KNOBS = RecallKnobs(threshold=0.0, page_size=8, max_pages_per_step=64, cadence_steps=1, timeout_ms=5000,
                    full_recall_gate=1e-6)


def recall_manifest(loaded: LoadedModel, mode: RecoverabilityMode) -> KVVisibilityPolicyManifest:
    manifest = with_recall(default_manifests(loaded.tensor_contract)["snapkv"], KNOBS, mode=mode)
    name = f"snapkv-{mode.value.replace('_', '-')}-e2e"
    return dataclasses.replace(manifest, name=name, policy_manifest_id=f"{name}@1")


async def register(policy_address: str, manifests: list[KVVisibilityPolicyManifest]) -> None:
    async with PolicyClient(PolicyClientConfig(policy_address, timeout_s=10.0)) as client:
        for manifest in manifests:
            await client.register_manifest(manifest.canonical_json())


@pytest.mark.parametrize("mode", list(RecoverabilityMode), ids=lambda m: m.value)
def test_each_recoverability_mode_through_the_gateway(stack: UpStack, loaded: LoadedModel, mode: RecoverabilityMode) -> None:
    if mode is RecoverabilityMode.OMITTED_IRRECOVERABLE:
        policy = "snapkv"
    else:
        manifest = recall_manifest(loaded, mode)
        asyncio.run(register(stack.policy_address, [manifest]))
        policy = manifest.name
    ids = needle_ids(loaded, 300, 31)
    request_id = f"e2e-recall-{mode.value}"
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        result = client.generate(generate_request(ids, policy=policy, max_tokens=MAX_TOKENS, detokenize=False,
                                                  request_id=request_id))
    summary, ledger = result.summary, result.summary.ledger
    assert summary.omitted_rows > 0 and list(summary.fallbacks) == []
    metadata = ledger.position_map_bytes + ledger.row_offsets_bytes + ledger.page_summary_bytes
    assert summary.bytes_moved == ledger.visible_payload_bytes + metadata + ledger.host_tier_bytes

    if mode is RecoverabilityMode.OMITTED_IRRECOVERABLE:
        assert ledger.page_summary_bytes == ledger.host_tier_bytes == 0
        assert summary.recalled_rows == 0 and summary.generations.state_generation == 1
        return
    assert list(result.token_ids) == generate(loaded, ids, max_new_tokens=MAX_TOKENS)
    assert summary.recalled_rows == summary.omitted_rows
    assert ledger.recalled_bytes == summary.omitted_rows * (ledger.bytes_per_row + 4)  # K, V and a position
    assert ledger.page_summary_bytes > 0
    if mode is RecoverabilityMode.RECALLABLE_LOCAL:
        # K, V and a position per omitted row, plus P + 1 int32 page row starts.
        page_rows = (ledger.host_tier_bytes - ledger.recalled_bytes) // 4
        min_pages = -(-summary.omitted_rows // KNOBS.page_size)
        assert (ledger.host_tier_bytes - ledger.recalled_bytes) % 4 == 0
        assert min_pages + 1 <= page_rows <= summary.omitted_rows + 1
    else:
        assert ledger.host_tier_bytes == 0
    assert (summary.generations.state_generation, summary.generations.parent_state_generation) == (2, 1)
    fence = fence_of(stack.policy_address, request_id)
    assert fence.state_generation == 2 and fence.request_generation == summary.generations.request_generation


def test_row_codes_travel_and_rank_through_the_gateway(stack: UpStack, loaded: LoadedModel) -> None:
    """A remote-recall manifest with 2-bit row codes: the codes travel with the summaries (the
    ledger counts them), the decode worker recalls with the codes ranking (its full-recall gate
    still reads the bound: every omitted row comes back, the answer is the full cache's), and the
    served `snapkv-recall-codes` and `snapkv-recall-values` policies are registered by default
    and decode without fallbacks, the second with page value means on the wire and on the
    decode host."""
    coded = dataclasses.replace(KNOBS, code_bits=2)
    manifest = with_recall(default_manifests(loaded.tensor_contract)["snapkv"], coded,
                           name="snapkv-codes-e2e")
    plain = recall_manifest(loaded, RecoverabilityMode.RECALLABLE_REMOTE)
    asyncio.run(register(stack.policy_address, [manifest, plain]))
    ids = needle_ids(loaded, 300, 31)
    runs = {}
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        for policy in (manifest.name, plain.name, "snapkv-recall-codes", "snapkv-recall-values"):
            runs[policy] = client.generate(generate_request(
                ids, policy=policy, max_tokens=MAX_TOKENS, detokenize=False, request_id=f"e2e-codes-{policy}"))
    head_dim = loaded.tensor_contract.head_dim
    for policy, result in runs.items():
        summary, ledger = result.summary, result.summary.ledger
        assert list(summary.fallbacks) == [], policy
        metadata = ledger.position_map_bytes + ledger.row_offsets_bytes + ledger.page_summary_bytes
        assert summary.bytes_moved == ledger.visible_payload_bytes + metadata, policy
    coded_run, plain_run = runs[manifest.name], runs[plain.name]
    assert list(coded_run.token_ids) == generate(loaded, ids, max_new_tokens=MAX_TOKENS)
    assert coded_run.summary.recalled_rows == coded_run.summary.omitted_rows > 0
    codes_bytes = coded_run.summary.omitted_rows * head_dim * 2 // 8
    assert coded_run.summary.ledger.page_summary_bytes == plain_run.summary.ledger.page_summary_bytes + codes_bytes
    served = runs["snapkv-recall-codes"].summary
    assert served.ledger.page_summary_bytes >= served.omitted_rows * head_dim * 2 // 8 > 0
    values = runs["snapkv-recall-values"].summary
    assert values.omitted_rows == served.omitted_rows  # the same selection, so the same pages
    pages = values.ledger.page_summary_bytes - served.ledger.page_summary_bytes  # the means
    assert pages > 0 and pages % (head_dim * 4) == 0  # d_h float32 values a page
    grid = values.ledger.code_table_bytes - served.ledger.code_table_bytes
    assert grid > 0 and grid % (head_dim * 2) == 0  # d_h bfloat16 values a grid page
