"""Generation through the whole stack (gateway -> prefill -> gloo transfer -> decode) against
the model runtime in one process: `full` is token-for-token identical; SnapKV + PyramidKV
retains exactly the rows the kvpolicy core selects for that prompt (the decode worker admits
only a view whose recomputed receipt digest matches the published one), and the bytes that
moved equal the ledger."""

from __future__ import annotations

import pytest
from e2e_helpers import UpStack, fence_of, needle_ids

from services.gateway.client import GatewayClient, generate_request
from services.kvpolicy.compress import StateIdentity, compress
from services.kvpolicy.ledger import ledger_for
from services.kvpolicy.manifest import default_manifests
from services.model import LoadedModel, PrefillOptions, generate, prefill
from services.rpc.kvrelay.v1 import common_pb2

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(("tokens", "seed"), [(48, 1), (400, 2)])
def test_full_policy_greedy_equals_one_process(stack: UpStack, loaded: LoadedModel, tokens: int, seed: int) -> None:
    ids = needle_ids(loaded, tokens, seed)
    expected = generate(loaded, ids, max_new_tokens=12)
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        result = client.generate(generate_request(ids, policy="full", max_tokens=12, detokenize=False))
    assert list(result.token_ids) == expected
    summary, ledger = result.summary, result.summary.ledger
    assert summary.omitted_rows == 0 and summary.retained_rows == 2 * 2 * tokens
    assert ledger.visible_payload_bytes == ledger.full_payload_bytes == 2 * 2 * tokens * 16 * 8
    assert summary.bytes_moved == ledger.visible_payload_bytes + ledger.position_map_bytes + ledger.row_offsets_bytes
    assert summary.output_tokens == len(expected) and summary.prompt_tokens == tokens
    finished = common_pb2.FINISH_REASON_LENGTH if len(expected) == 12 else common_pb2.FINISH_REASON_STOP
    assert summary.finish_reason == finished


def test_text_prompt_is_tokenized_like_the_runtime(stack: UpStack, loaded: LoadedModel) -> None:
    ids = needle_ids(loaded, 64, 3)
    text = loaded.require_tokenizer().decode(ids)
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        by_text = client.generate(generate_request(text, policy="full", max_tokens=6))
    assert list(by_text.token_ids) == generate(loaded, ids, max_new_tokens=6)
    assert by_text.text == loaded.require_tokenizer().decode(list(by_text.token_ids))
    assert by_text.summary.prompt_tokens == len(ids)


def test_snapkv_pyramid_retains_the_receipts_rows_and_moves_the_ledgers_bytes(
    stack: UpStack, loaded: LoadedModel
) -> None:
    ids = needle_ids(loaded, 300, 4)
    request_id = "e2e-pyramid-1"
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        result = client.generate(generate_request(ids, policy="snapkv-pyramid", max_tokens=8, request_id=request_id))
    manifest = default_manifests(loaded.tensor_contract)["snapkv-pyramid"]
    summary = result.summary
    assert summary.manifest_sha256 == manifest.sha256

    # The selection the kvpolicy core makes for this prompt, computed here, in this process.
    length = len(ids)
    forward = prefill(loaded.model, ids, PrefillOptions(obs_window=manifest.selection.snapkv.observation_window))
    fence = fence_of(stack.policy_address, request_id)
    compressed = compress(manifest, forward, StateIdentity(request_id, fence.request_generation))
    selected = compressed.state.selected_positions
    assert fence.request_generation == summary.generations.request_generation
    assert (fence.state_generation, fence.manifest_sha256) == (1, manifest.sha256)
    assert compressed.receipt.digest == fence.receipt_digest
    budgets = [len(owner) for layer in selected for owner in layer]
    assert len(set(budgets)) > 1  # PyramidKV: deeper layers keep fewer rows

    ledger = ledger_for(manifest, length, selected)
    assert (summary.retained_rows, summary.omitted_rows) == (ledger.visible_rows, ledger.omitted_rows)
    assert summary.omitted_rows > 0
    assert summary.bytes_moved == ledger.traffic_bytes
    assert summary.ledger.visible_payload_bytes == ledger.visible_payload_bytes
    assert summary.ledger.full_payload_bytes == ledger.full_payload_bytes
