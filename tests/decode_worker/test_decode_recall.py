"""Recall inside the decode worker, over real gRPC, a real policy service on real redis and real
gloo pair groups fed by a test-side prefill worker: views of recallable manifests arrive with
their page summaries (and, for recallable_local, their omitted rows), the recall engine runs
in the decode loop, successor states are published through the fence, and a recall whose rows
cannot come back takes the manifest's fallback without hanging."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import torch
from decode_helpers import (
    OBS_WINDOW,
    PackedState,
    Sent,
    describe,
    new_request_id,
    pack_state,
    prompt_ids,
    run_prefill,
    sampling_proto,
)

from decode_worker.recall import SuccessorPublisher
from services.kvpolicy.ledger import ledger_for
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    TimeoutFallback,
    default_manifests,
)
from services.kvpolicy.receipt import Receipt
from services.model import LoadedModel, generate
from services.offload.merge import recall_successor
from services.offload.plan import offload_plan
from services.offload.recall import RecallKnobs, with_recall
from services.policy import Phase, PolicyClient, StaleGeneration, StatePublication
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import KVSender, OffloadRef, Sidecar, layer_of

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)
CALL_S = 20.0
PAGE = 4
DEAD_OFFLOAD = "127.0.0.1:9"  # nothing listens there: the offload tier is gone


def recall_manifest(base: KVVisibilityPolicyManifest, mode: RecoverabilityMode, fallback: TimeoutFallback,
                    name: str, gate: float | None = 1e-6,
                    code_bits: int | None = None) -> KVVisibilityPolicyManifest:
    knobs = RecallKnobs(threshold=0.0, page_size=PAGE, max_pages_per_step=64, cadence_steps=1, timeout_ms=2000,
                        fallback=fallback, full_recall_gate=gate)
    manifest = with_recall(base, knobs, mode=mode)
    contract = dataclasses.replace(manifest.recoverability, key_code_bits=code_bits)
    return dataclasses.replace(manifest, name=name, policy_manifest_id=f"{name}@1",
                               recoverability=contract)


@pytest.fixture(scope="module")
def manifests(loaded: LoadedModel) -> dict[str, KVVisibilityPolicyManifest]:
    defaults = default_manifests(loaded.tensor_contract, observation_window=OBS_WINDOW)
    snapkv = defaults["snapkv"]
    local, remote = RecoverabilityMode.RECALLABLE_LOCAL, RecoverabilityMode.RECALLABLE_REMOTE
    lossy, fail = TimeoutFallback.CONTINUE_LOSSY, TimeoutFallback.FAIL_REQUEST
    return {
        "snapkv": snapkv,
        "local": recall_manifest(snapkv, local, lossy, "snapkv-local"),
        "local-coded": recall_manifest(snapkv, local, lossy, "snapkv-local-coded", code_bits=2),
        "remote-lossy": recall_manifest(snapkv, remote, lossy, "snapkv-remote-lossy", gate=None),
        "remote-fail": recall_manifest(snapkv, remote, fail, "snapkv-remote-fail", gate=None),
    }


@pytest.fixture
def sender():
    kv_sender = KVSender("prefill-recall-test")
    yield kv_sender
    kv_sender.close()


async def begin_and_publish(policy: PolicyClient, manifest: KVVisibilityPolicyManifest, prompt: list[int],
                            loaded: LoadedModel) -> PackedState:
    request_id = new_request_id()
    fence = await policy.begin_request(request_id)
    packed = pack_state(manifest, run_prefill(loaded, prompt), request_id, request_generation=fence.request_generation)
    state = packed.state
    await policy.publish_state(StatePublication(
        state.request_id, state.request_generation, 0, 1, state.cache_generation, packed.receipt.digest,
        state.manifest_sha256, Phase.PREFILLED, prefill_worker="prefill-recall-test"))
    return packed


def sidecar_of(packed: PackedState, local: bool) -> Sidecar:
    """What the prefill worker's offload stage sends for `packed` (row codes when its manifest
    asks for them)."""
    result = packed.prefilled.result
    positions = packed.state.selected_positions
    plan = offload_plan(packed.manifest, result.source_k, result.source_v, positions)
    assert plan is not None
    return Sidecar(plan.summaries, plan.rows if local else None)


async def send_recallable(stub, sender: KVSender, worker, packed: PackedState, car: Sidecar | None, *,
                          recoverability: str, max_tokens: int = 8, degraded: str = "") -> Sent:
    """The prefill worker's send stage for a recallable view: descriptor with the sidecar and
    the offload fields, AcceptTransfer, every layer, then the sidecar."""
    mode = RecoverabilityMode(recoverability)
    remote = mode is RecoverabilityMode.RECALLABLE_REMOTE
    offload = OffloadRef(mode, handoff_id="h-1" if remote else "", address=DEAD_OFFLOAD if remote else "",
                         lease_ms=30_000 if remote else 0, degraded=degraded)
    sent = await asyncio.to_thread(describe, packed, sender, worker.rendezvous_address,
                                   sampling=sampling_proto(max_tokens), sidecar=car, offload=offload)
    message = sent.message
    await asyncio.to_thread(sent.start)
    reply = await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=message), timeout=CALL_S)
    assert reply.accepted
    assert sent.transfer is not None
    for layer in range(packed.view.num_layers):
        sent.transfer.send_layer(layer_of(packed.view, layer))
    if car is not None:
        sent.transfer.send_sidecar(car)
    return sent


def stream_request(sent: Sent) -> decode_pb2.StreamTokensRequest:
    key = sent.descriptor.key
    return decode_pb2.StreamTokensRequest(request_id=key.request_id, request_generation=key.request_generation,
                                          transfer_id=key.transfer_id)


async def collect(stub, sent: Sent) -> tuple[list[int], decode_pb2.DecodeSummary]:
    tokens, summary = [], None
    async for event in stub.StreamTokens(stream_request(sent), timeout=CALL_S):
        if event.HasField("token"):
            tokens.append(event.token.token_id)
        else:
            summary = event.summary
    assert summary is not None
    return tokens, summary


@pytest.mark.parametrize("name", ["local", "local-coded"])
async def test_recallable_local_recalls_every_page_and_decodes_like_the_full_cache(
    stub, worker, sender, policy, loaded, manifests, name: str
) -> None:
    prompt = prompt_ids(40, seed=11)
    packed = await begin_and_publish(policy, manifests[name], prompt, loaded)
    car = sidecar_of(packed, local=True)
    assert (car.summaries.row_codes is not None) == (name == "local-coded")
    sent = await send_recallable(stub, sender, worker, packed, car, recoverability="recallable_local")
    tokens, summary = await collect(stub, sent)

    # The full-recall gate fires at the first step: every omitted row comes back and the
    # rest decodes exactly as with the whole cache.
    assert tokens == generate(loaded, prompt, max_new_tokens=8)
    omitted = car.summaries.omitted_rows
    assert omitted > 0 and summary.recalled_rows == omitted and summary.recall_count == 1
    assert summary.ledger.recalled_bytes == car.host_rows.nbytes - car.host_rows.page_rows.numel() * 4 - car.summaries.page_offsets.numel() * 4
    assert list(summary.fallbacks) == []
    assert (summary.generations.state_generation, summary.generations.parent_state_generation) == (2, 1)
    fence = await policy.get_fence(packed.state.request_id)
    assert fence.state_generation == 2  # the recall's successor went through the fence
    ledger = car.charge(
        ledger_for(packed.manifest, packed.prefilled.length, packed.state.selected_positions))
    assert summary.ledger.bytes_moved == ledger.traffic_bytes == sent.descriptor.nbytes


@pytest.mark.parametrize("fallback", ["remote-lossy", "remote-fail"])
async def test_a_recall_whose_tier_is_gone_takes_the_declared_fallback(
    stub, worker, sender, policy, loaded, manifests, fallback: str
) -> None:
    packed = await begin_and_publish(policy, manifests[fallback], prompt_ids(40, seed=12), loaded)
    sent = await send_recallable(stub, sender, worker, packed, sidecar_of(packed, local=False),
                                 recoverability="recallable_remote", max_tokens=6)
    started = time.monotonic()
    if fallback == "remote-lossy":
        tokens, summary = await collect(stub, sent)
        assert len(tokens) == summary.output_tokens >= 1 and summary.recalled_rows == 0
        assert summary.fallbacks and set(summary.fallbacks) == {"recall_unavailable:continue_lossy"}
        assert summary.generations.state_generation == 1  # nothing was published
    else:
        tokens = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for event in stub.StreamTokens(stream_request(sent), timeout=CALL_S):
                tokens.append(event.token.token_id)
        error = caught.value
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        detail = error_detail(error)
        assert detail is not None and detail.reason == common_pb2.ERROR_REASON_RECALL_TIMEOUT
        assert tokens == [packed.prefilled.first_token]  # the first token stays valid
    assert time.monotonic() - started < 2.0 + 5.0  # one recall deadline, plus the decode
    await asyncio.wait_for(_budget_freed(worker), 5.0)


async def test_a_degraded_offload_decodes_lossy_and_says_why(stub, worker, sender, policy, loaded, manifests) -> None:
    packed = await begin_and_publish(policy, manifests["remote-lossy"], prompt_ids(30, seed=13), loaded)
    sent = await send_recallable(stub, sender, worker, packed, None, recoverability="omitted_irrecoverable",
                                 degraded="offload_refused:store_full", max_tokens=4)
    tokens, summary = await collect(stub, sent)
    assert len(tokens) == summary.output_tokens and list(summary.fallbacks) == ["offload_refused:store_full"]


async def test_host_rows_that_do_not_match_their_summaries_are_rejected(
    stub, worker, sender, policy, loaded, manifests
) -> None:
    packed = await begin_and_publish(policy, manifests["local"], prompt_ids(30, seed=14), loaded)
    car = sidecar_of(packed, local=True)
    assert car.host_rows is not None
    forged = dataclasses.replace(car.host_rows, k=car.host_rows.k + 1.0)
    sent = await send_recallable(stub, sender, worker, packed, Sidecar(car.summaries, forged),
                                 recoverability="recallable_local")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, sent)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(caught.value).field == "sidecar.omitted_k"  # type: ignore[union-attr]


async def test_row_codes_that_do_not_match_the_host_rows_are_rejected(
    stub, worker, sender, policy, loaded, manifests
) -> None:
    prompt = prompt_ids(30, seed=16)
    packed = await begin_and_publish(policy, manifests["local-coded"], prompt, loaded)
    car = sidecar_of(packed, local=True)
    assert car.summaries.row_codes is not None
    shifted = torch.roll(car.summaries.row_codes, 1, dims=0)  # every row's codes on the next row
    assert not torch.equal(shifted, car.summaries.row_codes)
    forged = dataclasses.replace(car.summaries, row_codes=shifted)
    sent = await send_recallable(stub, sender, worker, packed, Sidecar(forged, car.host_rows),
                                 recoverability="recallable_local")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(stub, sent)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(caught.value).field == "sidecar.row_codes"


async def test_a_successor_built_on_a_superseded_state_is_refused_by_the_fence(policy, loaded, manifests) -> None:
    packed = await begin_and_publish(policy, manifests["local"], prompt_ids(30, seed=15), loaded)
    state = packed.state
    omitted = next(p for p in range(state.frontier) if p not in state.selected_positions[0][0])
    grid = [[[omitted] if (layer, owner) == (0, 0) else [] for owner in range(state.num_owners)]
            for layer in range(state.num_layers)]
    publisher = SuccessorPublisher(policy, asyncio.get_running_loop(), prefill_worker="p", decode_worker="d",
                                   timeout_s=5.0)
    elsewhere = recall_successor(state, grid, cache_generation=2)
    await policy.publish_state(StatePublication(  # another worker's recall got there first
        state.request_id, state.request_generation, 1, 2, 2, Receipt.for_state(elsewhere).digest,
        state.manifest_sha256, Phase.RECALLED))
    with pytest.raises(StaleGeneration):
        await asyncio.to_thread(publisher, recall_successor(state, grid, cache_generation=3))
    assert publisher.rejected is not None and publisher.rejected.current.state_generation == 2
    assert publisher.published == []
    more = next(p for p in range(state.frontier) if p not in state.selected_positions[1][1])
    grid_more = [[[more] if (layer, owner) == (1, 1) else [] for owner in range(state.num_owners)]
                 for layer in range(state.num_layers)]
    following = recall_successor(elsewhere, grid_more, cache_generation=4, frontier=state.frontier + 1)
    await asyncio.to_thread(publisher, following)  # built on the current state: accepted
    assert (await policy.get_fence(state.request_id)).state_generation == 3


async def _budget_freed(worker) -> None:
    while worker.servicer.scheduler.budget.used_bytes:
        await asyncio.sleep(0.02)
