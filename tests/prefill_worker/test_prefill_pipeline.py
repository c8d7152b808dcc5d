"""The compute stages (the forward, then the compression core's score → allocate → select → pack) in-process on a tiny random
checkpoint: what each policy retains, that the receipt binds exactly the packed view, and
that the first token is the model's own next token."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prefill_helpers import prompt_ids

from prefill_worker.errors import ManifestUnsupported
from prefill_worker.manifests import check_servable
from prefill_worker.pipeline import PrefillJob, forward
from prefill_worker.wire import DecodeTarget, PrefillCall
from services.kvpolicy.compress import Selection, allocate, pack, score, select
from services.kvpolicy.fit import Deployment
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    RecoverabilityContract,
    RecoverabilityMode,
    TensorContract,
    TimeoutFallback,
)
from services.kvpolicy.receipt import Receipt, payload_digest, receipt_digest, verify_receipt
from services.kvpolicy.static import static_positions
from services.model import LoadedModel, SamplingParams, generate
from services.model import prefill as model_prefill

PROMPT_LEN = 64


def job_for(manifest: KVVisibilityPolicyManifest, sampling: SamplingParams = SamplingParams()) -> PrefillJob:
    call = PrefillCall(
        request_id="req-pipeline",
        request_generation=3,
        prompt_ids=tuple(prompt_ids(PROMPT_LEN, seed=1)),
        sampling=sampling,
        max_tokens=8,
        manifest_sha256=manifest.sha256,
        decode=DecodeTarget("127.0.0.1:1", "decode-0"),
    )
    return PrefillJob(call, manifest)


def run_stages(model: LoadedModel, job: PrefillJob):  # noqa: ANN201 - test helper
    fwd = forward(model, job, chunk_size=24)  # several chunks per layer
    scores = score(job.manifest, fwd.result)
    budgets = allocate(job.manifest, fwd.prompt_len, scores)
    selection = select(job.manifest, fwd.prompt_len, scores, budgets)
    return fwd, selection, pack(job.manifest, fwd.result, selection, job.identity)


def recomputed_digest(receipt: Receipt, positions: list[list[list[int]]]) -> str:
    """The digest from the generations and the positions a receiver reads off the view."""
    return receipt_digest({**receipt.body(), "selected_positions": positions})


def test_full_policy_packs_the_source_kv_unchanged(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    job = job_for(manifests["full"])
    fwd, selection, packed = run_stages(model, job)
    source_k, source_v = fwd.result.source_k, fwd.result.source_v  # [L, H_kv, T, d_h]
    head_dim = source_k.shape[-1]
    assert selection.budgets is None and selection.protected == ()
    assert torch.equal(packed.view.packed_k, source_k.reshape(-1, head_dim))
    assert torch.equal(packed.view.packed_v, source_v.reshape(-1, head_dim))
    assert packed.ledger.omitted_rows == 0
    assert packed.ledger.visible_rows == source_k.numel() // head_dim
    assert recomputed_digest(packed.receipt, packed.view.selected_positions()) == packed.receipt.digest
    verify_receipt(packed.receipt, manifest_sha256=job.manifest.sha256, view=packed.view)


def test_first_token_is_the_models_greedy_next_token(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    job = job_for(manifests["snapkv"])
    fwd = forward(model, job, chunk_size=512)
    assert fwd.first_token == generate(model, list(job.call.prompt_ids), max_new_tokens=1)[0]
    assert fwd.first_token == int(model_prefill(model.model, list(job.call.prompt_ids)).logits.argmax())


def test_seeded_first_token_depends_on_the_seed_only(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    hot = [SamplingParams(temperature=5.0, seed=seed) for seed in range(8)]
    tokens = [forward(model, job_for(manifests["full"], params), 512).first_token for params in hot]
    again = [forward(model, job_for(manifests["full"], params), 64).first_token for params in hot]
    assert tokens == again
    assert len(set(tokens)) > 1  # a hot distribution over 97 tokens: seeds do matter


@pytest.mark.parametrize("policy", ["snapkv", "snapkv-pyramid", "snapkv-adakv"])
def test_snapkv_retains_exactly_the_allocation(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest], policy: str
) -> None:
    manifest = manifests[policy]
    _, selection, packed = run_stages(model, job_for(manifest))
    assert selection.budgets is not None
    protected = set(selection.protected)
    capacity = manifest.selection.capacity(PROMPT_LEN)
    per_owner = capacity - manifest.selection.protected_rows
    assert sum(map(sum, selection.budgets)) == manifest.tensor.num_layers * manifest.num_owners * per_owner
    for layer, owners in enumerate(packed.view.selected_positions()):
        for owner, positions in enumerate(owners):
            assert len(positions) == selection.budgets[layer][owner] + len(protected)
            assert protected <= set(positions)
    assert packed.ledger.visible_rows == packed.view.total_rows < packed.ledger.full_rows
    assert packed.ledger.traffic_bytes == packed.view.payload_bytes + packed.view.metadata_bytes
    assert recomputed_digest(packed.receipt, packed.view.selected_positions()) == packed.receipt.digest


def test_pyramid_gives_lower_layers_more_rows(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    _, selection, _ = run_stages(model, job_for(manifests["snapkv-pyramid"]))
    assert selection.budgets is not None
    assert sum(selection.budgets[0]) > sum(selection.budgets[-1])


def test_selection_follows_the_scores(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    """Each owner keeps its highest-scoring prefix rows: every kept row scores at least as
    high as every dropped one."""
    manifest = manifests["snapkv"]
    job = job_for(manifest)
    fwd = forward(model, job, 512)
    scores = score(manifest, fwd.result)  # [L, H_kv, T - W_obs]
    assert scores is not None
    budgets = allocate(manifest, fwd.prompt_len, scores)
    selection = select(manifest, fwd.prompt_len, scores, budgets)
    prefix = scores.shape[-1]
    for layer, owners in enumerate(selection.positions):
        for owner, positions in enumerate(owners):
            kept = [p for p in positions if p < prefix]
            dropped = sorted(set(range(prefix)) - set(kept))
            assert float(scores[layer, owner, kept].min()) >= float(scores[layer, owner, dropped].max())


@pytest.mark.parametrize("policy", ["window", "sink-recent"])
def test_static_policies_keep_their_positions_without_scoring(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest], policy: str
) -> None:
    manifest = manifests[policy]
    fwd, selection, packed = run_stages(model, job_for(manifest))
    # nothing captured for a static policy, and the worker never keeps the window's rows
    assert fwd.result.observation is None and fwd.result.observation_vote is None
    expected = list(static_positions(manifest.selection, PROMPT_LEN))
    assert len(expected) < PROMPT_LEN
    assert packed.view.selected_positions() == [[expected] * manifest.num_owners] * manifest.tensor.num_layers
    verify_receipt(packed.receipt, manifest_sha256=manifest.sha256, view=packed.view)


def test_state_is_the_first_successor_of_the_request(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    _, _, packed = run_stages(model, job_for(manifests["snapkv"]))
    state = packed.state
    assert (state.request_generation, state.parent_state_generation, state.state_generation) == (3, 0, 1)
    assert state.frontier == PROMPT_LEN
    # The receipt binds the state, each owner's row capacity and the packed bytes.
    assert state.owner_budgets is not None and packed.receipt.owner_budgets == state.owner_budgets
    assert packed.receipt.digest == Receipt.for_state(state, payload_digest(packed.view)).digest


def test_a_different_view_gets_a_different_digest(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    manifest = manifests["snapkv"]
    job = job_for(manifest)
    fwd, selection, packed = run_stages(model, job)
    owners = [list(map(list, layer)) for layer in selection.positions]
    dropped = next(p for p in range(PROMPT_LEN) if p not in owners[0][0])
    owners[0][0] = sorted(owners[0][0][1:] + [dropped])
    positions = tuple(map(tuple, (map(tuple, layer) for layer in owners)))
    tampered = pack(job.manifest, fwd.result, Selection(positions, selection.protected, selection.budgets),
                    job.identity)
    assert tampered.receipt.digest != packed.receipt.digest


def test_check_servable_names_the_field_it_cannot_serve(
    model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    check_servable(manifests["snapkv"], Deployment(model.tensor_contract, offload_store=False))
    other = TensorContract(3, 4, 2, 16, DType.FLOAT32, DType.FLOAT32)
    with pytest.raises(ManifestUnsupported) as bad_contract:
        check_servable(manifests["snapkv"], Deployment(other))
    assert bad_contract.value.field == "tensor.num_layers"
    bf16 = dataclasses.replace(model.tensor_contract, k_dtype=DType.BFLOAT16, v_dtype=DType.BFLOAT16)
    with pytest.raises(ManifestUnsupported) as bad_dtype:
        check_servable(manifests["snapkv"], Deployment(bf16))
    assert bad_dtype.value.field == "tensor.k_dtype"
    recall = RecoverabilityContract(
        RecoverabilityMode.RECALLABLE_REMOTE, recall_threshold=0.1, page_size=16,
        max_pages_per_step=4, recall_cadence_steps=1, recall_timeout_ms=100,
        timeout_fallback=TimeoutFallback.CONTINUE_LOSSY,
    )
    recallable = dataclasses.replace(manifests["snapkv"], recoverability=recall)
    with pytest.raises(ManifestUnsupported) as bad_mode:
        check_servable(recallable, Deployment(model.tensor_contract, offload_store=False))
    assert bad_mode.value.field == "recoverability.mode"
    check_servable(recallable, Deployment(model.tensor_contract, offload_store=True))

