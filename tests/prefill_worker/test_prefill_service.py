"""The PrefillWorker servicer through real gRPC: a real policy service on a real redis, and a
recording decode worker with a real KVReceiver (gloo on loopback) on the other end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from prefill_helpers import RecordingDecodeWorker, prompt_ids

from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import PrefillServer
from services.kvpolicy import snapkv
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.kvpolicy.receipt import Receipt, payload_digest
from services.model import LoadedModel, generate
from services.policy import PolicyClient
from services.policy.types import Phase
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.rpc.server import RpcServer, ServerConfig
from services.transfer import PairGroupConfig

pytestmark = pytest.mark.timeout(120)
PROMPT_LEN = 48


@pytest.fixture
async def prefill(
    request: pytest.FixtureRequest, model: LoadedModel, policy: PolicyClient, policy_server: object
) -> AsyncIterator[PrefillServer]:
    overrides = getattr(request, "param", {})
    config = PrefillWorkerConfig(
        checkpoint=model.path,
        worker_id="prefill-test",
        server=ServerConfig(port=0, shutdown_grace_s=0.5),
        policy_address=policy_server.address,  # type: ignore[attr-defined]
        accept_timeout_s=2.0,
        transfer_timeout_s=10.0,
        pair_groups=PairGroupConfig(max_groups=4),
        **overrides,
    )
    server = await PrefillServer.start(config, model=model)
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(prefill: PrefillServer) -> AsyncIterator[prefill_pb2_grpc.PrefillWorkerStub]:
    async with grpc.aio.insecure_channel(prefill.address) as channel:
        yield prefill_pb2_grpc.PrefillWorkerStub(channel)


def prefill_request(
    request_id: str, generation: int, manifest: KVVisibilityPolicyManifest, decode: RpcServer, **overrides: object
) -> prefill_pb2.PrefillRequest:
    fields: dict[str, object] = {
        "request_id": request_id,
        "request_generation": generation,
        "prompt_token_ids": prompt_ids(PROMPT_LEN, seed=7),
        "sampling": common_pb2.SamplingParams(max_tokens=4),
        "manifest_sha256": manifest.sha256,
        "decode_worker_address": decode.address,
        "decode_worker_id": "decode-test",
    }
    fields.update(overrides)
    return prefill_pb2.PrefillRequest(**fields)  # type: ignore[arg-type]


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_prefill_publishes_and_hands_the_view_to_the_decode_worker(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    model: LoadedModel,
    policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    recorder, decode = decode_worker
    manifest = manifests["snapkv-pyramid"]
    fence = await policy.begin_request("req-ok")
    reply = await stub.Prefill(prefill_request("req-ok", fence.request_generation, manifest, decode), timeout=60)

    current = await policy.get_fence("req-ok")
    assert current.phase is Phase.PREFILLED and current.state_generation == 1
    assert current.receipt_digest == reply.receipt.digest and current.prefill_worker == "prefill-test"
    assert current.decode_worker == "decode-test" and current.manifest_sha256 == manifest.sha256

    descriptor = reply.transfer
    assert [d.transfer_id for d in recorder.accepted] == [descriptor.transfer_id]
    # Output token 0 travels with the transfer (the response does not repeat it).
    assert "first_token_id" not in prefill_pb2.PrefillResponse.DESCRIPTOR.fields_by_name
    assert descriptor.first_token_id == generate(model, prompt_ids(PROMPT_LEN, seed=7), 1)[0]  # greedy
    assert descriptor.prompt_tokens == PROMPT_LEN
    assert descriptor.sampling.max_tokens == 4 and descriptor.deadline_unix_ms > time.time() * 1000
    received = await recorder.received(descriptor.transfer_id)

    # The receiver's view recomputes the published digest (positions from its position map,
    # the budgets the receipt carries, the digest of the bytes that arrived).
    generations = reply.receipt.generations
    layers, owners = manifest.tensor.num_layers, manifest.num_owners
    budgets = list(reply.receipt.owner_budgets)
    recomputed = Receipt(
        request_id="req-ok",
        manifest_sha256=reply.receipt.manifest_sha256,
        request_generation=generations.request_generation,
        state_generation=generations.state_generation,
        parent_state_generation=generations.parent_state_generation,
        cache_generation=generations.cache_generation,
        frontier=reply.receipt.frontier,
        position_origin=reply.receipt.position_origin,
        selected_positions=received.view.selected_positions(),
        protected_positions=snapkv.protected_positions(manifest, PROMPT_LEN),
        owner_budgets=tuple(tuple(budgets[layer * owners : (layer + 1) * owners]) for layer in range(layers)),
        payload=payload_digest(received.view),
        digest=reply.receipt.digest,
    )
    assert recomputed.state_generation == 1 and recomputed.parent_state_generation == 0

    ledger = reply.ledger
    traffic = ledger.visible_payload_bytes + ledger.position_map_bytes + ledger.row_offsets_bytes
    assert received.bytes_moved == ledger.bytes_moved == traffic == descriptor.ledger.bytes_moved
    assert reply.receipt.retained_rows == received.view.total_rows
    assert reply.receipt.omitted_rows > 0 and ledger.visible_payload_bytes < ledger.full_payload_bytes
    assert reply.prefill_worker == "prefill-test" and reply.prefill_ms > 0


async def test_unknown_manifest_is_not_found(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    recorder, decode = decode_worker
    fence = await policy.begin_request("req-nf")
    message = prefill_request("req-nf", fence.request_generation, manifests["full"], decode, manifest_sha256="0" * 64)
    error = await rpc_error(stub.Prefill(message, timeout=30))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    detail = error_detail(error)
    assert detail is not None and detail.field == "manifest_sha256"
    assert recorder.endpoint_calls == 0 and recorder.accepted == []


async def test_empty_prompt_is_invalid_and_names_the_field(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    _, decode = decode_worker
    message = prefill_request("req-empty", 1, manifests["full"], decode, prompt_token_ids=[])
    error = await rpc_error(stub.Prefill(message, timeout=30))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(error)
    assert detail is not None and detail.field == "prompt_token_ids"
    assert detail.reason == common_pb2.ERROR_REASON_REQUEST_INVALID


async def test_stale_generation_fails_the_precondition_and_sends_nothing(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    recorder, decode = decode_worker
    old = await policy.begin_request("req-stale")
    new = await policy.begin_request("req-stale")  # a retry fenced the first attempt out
    message = prefill_request("req-stale", old.request_generation, manifests["snapkv"], decode)
    error = await rpc_error(stub.Prefill(message, timeout=30))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(error)
    assert detail is not None and detail.reason == common_pb2.ERROR_REASON_STALE_GENERATION
    assert detail.current.request_generation == new.request_generation
    assert recorder.endpoint_calls == 0 and recorder.accepted == []
    current = await policy.get_fence("req-stale")
    assert current.state_generation == 0 and current.receipt_digest == ""


@pytest.mark.parametrize("prefill", [{"max_in_flight": 1, "max_queued": 1}], indirect=True)
async def test_capacity_beyond_the_queue_is_resource_exhausted(
    prefill: PrefillServer,
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    """One call holds the only slot (its AcceptTransfer is held), one waits, the third is
    refused at once. The held call is then refused by the decode worker (UNAVAILABLE naming
    it); the queued one goes through."""
    recorder, decode = decode_worker
    recorder.release.clear()
    recorder.refuse_next = 1
    manifest = manifests["window"]
    calls = []
    for index in range(2):
        fence = await policy.begin_request(f"req-cap-{index}")
        calls.append(asyncio.ensure_future(
            stub.Prefill(prefill_request(f"req-cap-{index}", fence.request_generation, manifest, decode), timeout=60)
        ))
        await wait_until(lambda index=index: len(recorder.accepted) == 1 and prefill.admission.queued == index)
    fence = await policy.begin_request("req-cap-2")
    started = time.monotonic()
    error = await rpc_error(stub.Prefill(prefill_request("req-cap-2", fence.request_generation, manifest, decode), timeout=30))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 5
    assert error_detail(error).reason == common_pb2.ERROR_REASON_CAPACITY  # type: ignore[union-attr]

    recorder.release.set()
    refused = await rpc_error(calls[0])
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode-test" in refused.details() and decode.address in refused.details()
    assert error_detail(refused).reason == common_pb2.ERROR_REASON_TRANSFER_FAILED  # type: ignore[union-attr]
    second = await asyncio.wait_for(calls[1], 60)
    assert (await recorder.received(second.transfer.transfer_id)).bytes_moved == second.ledger.bytes_moved
    assert len(prefill.handoff.sender.group_ids()) == 1  # the refused transfer's group was torn down


async def test_unreachable_decode_worker_is_unavailable_naming_it(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    _, decode = decode_worker
    gone = decode.address
    await decode.stop(0)
    fence = await policy.begin_request("req-gone")
    started = time.monotonic()
    message = prefill_request("req-gone", fence.request_generation, manifests["full"], decode)
    error = await rpc_error(stub.Prefill(message, timeout=30))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and gone in error.details()
    assert time.monotonic() - started < 10  # bounded by accept_timeout_s, not the call deadline


async def wait_until(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_cancelled_call_tears_its_pair_group_down_and_frees_its_slot(
    prefill: PrefillServer,
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest],
    decode_worker: tuple[RecordingDecodeWorker, RpcServer],
) -> None:
    recorder, decode = decode_worker
    recorder.release.clear()  # the handoff stalls in AcceptTransfer, its pair group reserved
    fence = await policy.begin_request("req-cancel")
    call = stub.Prefill(prefill_request("req-cancel", fence.request_generation, manifests["full"], decode), timeout=60)
    await wait_until(lambda: len(recorder.accepted) == 1 and len(prefill.handoff.sender.group_ids()) == 1)
    call.cancel()
    await wait_until(lambda: prefill.handoff.sender.group_ids() == [] and prefill.admission.in_flight == 0, 5.0)
    with pytest.raises(asyncio.CancelledError):
        await call
