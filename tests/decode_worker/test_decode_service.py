"""The decode worker over real gRPC, a real policy service on real redis, and real gloo pair
groups fed by a test-side prefill worker (the transfer layer's KVSender)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from decode_helpers import (
    KV_BUDGET_BYTES,
    LEASE_TIMEOUT_S,
    VOCAB,
    PackedState,
    Sent,
    describe,
    k_bit_flipped,
    new_request_id,
    over_budget,
    pack_state,
    prompt_ids,
    run_prefill,
    sampling_proto,
    send_all,
    tampered,
    v_shifted,
)

from services.kvpolicy.ledger import ledger_for
from services.model import DecodeCache, SamplingParams, decode_tokens, generate
from services.policy import Phase, PolicyClient, StatePublication
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import Deadline, KVSender

pytestmark = pytest.mark.timeout(90)
torch.set_num_threads(1)
CALL_S = 15.0


@pytest.fixture
def sender():
    kv_sender = KVSender("prefill-test")
    yield kv_sender
    kv_sender.close()


async def begin_and_publish(policy: PolicyClient, manifest, prefilled, request_id: str) -> PackedState:
    """What the gateway and prefill worker do before sending: BeginRequest, pack, PublishState."""
    fence = await policy.begin_request(request_id)
    packed = pack_state(manifest, prefilled, request_id, request_generation=fence.request_generation)
    await policy.publish_state(publication(packed, parent=0))
    return packed


def publication(packed: PackedState, parent: int, digest: str | None = None) -> StatePublication:
    state = packed.state
    return StatePublication(
        request_id=state.request_id,
        request_generation=state.request_generation,
        parent_state_generation=parent,
        state_generation=parent + 1,
        cache_generation=state.cache_generation,
        receipt_digest=digest or packed.receipt.digest,
        manifest_sha256=state.manifest_sha256,
        phase=Phase.PREFILLED,
        prefill_worker="prefill-test",
    )


async def transfer(stub, sender: KVSender, worker, packed: PackedState, view=None, **describe_args) -> Sent:
    """Reserve, AcceptTransfer, send every layer (the prefill worker's send stage)."""
    sent = await asyncio.to_thread(describe, packed, sender, worker.rendezvous_address, view=view, **describe_args)
    await asyncio.to_thread(sent.start)
    response = await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=sent.message), timeout=CALL_S)
    assert response.accepted and response.transfer_id == sent.descriptor.transfer_id
    assert response.decode_worker == worker.config.worker_id and response.reserved_bytes > 0
    send_all(sent, view if view is not None else packed.view)
    return sent


def stream_request(sent: Sent) -> decode_pb2.StreamTokensRequest:
    key = sent.descriptor.key
    return decode_pb2.StreamTokensRequest(
        request_id=key.request_id, request_generation=key.request_generation, transfer_id=key.transfer_id
    )


async def collect(stub, sent: Sent) -> tuple[list[common_pb2.TokenEvent], decode_pb2.DecodeSummary]:
    tokens, summary = [], None
    async for event in stub.StreamTokens(stream_request(sent), timeout=CALL_S):
        if event.HasField("token"):
            tokens.append(event.token)
        else:
            summary = event.summary
    assert summary is not None
    return tokens, summary


async def stream_error(stub, sent: Sent) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await collect(stub, sent)
    return error.value


async def eventually(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition did not hold in time"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def traffic_bytes(packed: PackedState) -> int:
    return ledger_for(packed.manifest, packed.prefilled.length, packed.state.selected_positions).traffic_bytes


async def test_full_policy_streams_the_runtime_greedy_output(stub, worker, sender, policy, loaded, manifests):
    prompt = prompt_ids(23, seed=1)
    prefilled = run_prefill(loaded, prompt)
    request_id = new_request_id()
    packed = await begin_and_publish(policy, manifests["full"], prefilled, request_id)
    sent = await transfer(stub, sender, worker, packed, sampling=sampling_proto(10))

    tokens, summary = await collect(stub, sent)
    assert [t.token_id for t in tokens] == generate(loaded, prompt, max_new_tokens=10)
    assert [t.index for t in tokens] == list(range(len(tokens)))
    assert summary.output_tokens == len(tokens)
    assert summary.finish_reason == (
        common_pb2.FINISH_REASON_LENGTH if len(tokens) == 10 else common_pb2.FINISH_REASON_STOP
    )
    generations = summary.generations
    assert (generations.request_generation, generations.state_generation) == (packed.state.request_generation, 1)
    assert generations.cache_generation == packed.state.cache_generation + len(tokens) - 1
    assert summary.ledger.bytes_moved == traffic_bytes(packed) == sent.descriptor.layout.nbytes
    assert summary.ledger.visible_payload_bytes == packed.view.payload_bytes
    assert await asyncio.to_thread(sent.transfer.wait_for_send, Deadline.after(CALL_S)) == traffic_bytes(packed)
    await eventually(lambda: worker.servicer.scheduler.budget.used_bytes == 0, 5.0)
    await eventually(lambda: worker.servicer.open_transfers == 0, 5.0)
    # Ending the request is the gateway's (tests/services/gateway); the decode worker leaves
    # the fence as the prefill worker published it.
    fence = await policy.get_fence(request_id)
    assert (fence.phase, fence.state_generation) == (Phase.PREFILLED, 1)


async def test_compressed_views_decode_what_the_receipt_retained(stub, worker, sender, policy, loaded, manifests):
    sends = []
    for index, name in enumerate(("snapkv", "snapkv-pyramid", "sink-recent")):
        prefilled = run_prefill(loaded, prompt_ids(30 + index, seed=10 + index))
        packed = await begin_and_publish(policy, manifests[name], prefilled, new_request_id())
        sends.append((packed, await transfer(stub, sender, worker, packed, sampling=sampling_proto(6))))
    results = await asyncio.gather(*(collect(stub, sent) for _, sent in sends))
    for (packed, _), (tokens, summary) in zip(sends, results, strict=True):
        cache = DecodeCache(loaded.config, loaded.dtype, loaded.device, batch_capacity=1)
        cache.admit_view("expected", packed.view, frontier=packed.prefilled.length)
        logits = packed.prefilled.result.logits[None]  # [1, V]
        expected = decode_tokens(loaded, cache, logits, 6, SamplingParams())
        assert [t.token_id for t in tokens] == expected
        assert summary.ledger.bytes_moved == traffic_bytes(packed)
        assert summary.verified_receipt_digest == packed.receipt.digest
        assert summary.retained_rows == packed.view.total_rows == packed.state.retained_rows
    assert worker.servicer.rejections == {}
    await eventually(lambda: worker.servicer.scheduler.budget.used_bytes == 0, 5.0)


@pytest.mark.parametrize("forgery", ["tampered_position_map", "wrong_digest"])
async def test_view_that_does_not_recompute_its_receipt_is_rejected(
    forgery, stub, worker, sender, policy, loaded, manifests
):
    prefilled = run_prefill(loaded, prompt_ids(33, seed=2))
    packed = await begin_and_publish(policy, manifests["snapkv"], prefilled, new_request_id())
    if forgery == "tampered_position_map":
        sent = await transfer(stub, sender, worker, packed, view=tampered(packed.view))
    else:
        sent = await transfer(stub, sender, worker, packed, digest=hashlib.sha256(b"forged").hexdigest())

    error = await stream_error(stub, sent)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(error)
    assert detail.field == "receipt.digest"
    assert detail.reason == common_pb2.ERROR_REASON_TRANSFER_FAILED
    assert worker.servicer.rejections == {"ViewRejected:receipt.digest": 1}
    assert worker.servicer.scheduler.budget.used_bytes == 0
    assert worker.servicer.scheduler.steps == 0  # nothing was decoded


@pytest.mark.parametrize(
    ("forge", "field"),
    [(v_shifted, "packed_v[0]"), (k_bit_flipped, "packed_k[0]"), (over_budget, "receipt.owner_budgets[0][0]")],
)
async def test_view_whose_bytes_or_rows_break_the_receipt_is_rejected_before_admission(
    forge, field, stub, worker, sender, policy, loaded, manifests
):
    """The real decode path: a V row shifted against K, a flipped bit in K, one row over an
    owner's budget — each well formed, each claiming the published receipt — is refused naming
    the layer's tensor or the owner's budget, and nothing is admitted or decoded."""
    prefilled = run_prefill(loaded, prompt_ids(33, seed=2))
    packed = await begin_and_publish(policy, manifests["snapkv"], prefilled, new_request_id())
    sent = await transfer(stub, sender, worker, packed, view=forge(packed.view))

    error = await stream_error(stub, sent)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(error)
    assert (detail.field, detail.reason) == (field, common_pb2.ERROR_REASON_TRANSFER_FAILED)
    assert worker.servicer.rejections == {f"ViewRejected:{field}": 1}
    assert worker.servicer.scheduler.budget.used_bytes == 0
    assert worker.servicer.scheduler.steps == 0  # nothing was decoded


@pytest.mark.parametrize("superseded_by", ["successor_state", "new_request_generation"])
async def test_superseded_state_is_rejected_by_the_fence(superseded_by, stub, worker, sender, policy, loaded, manifests):
    prefilled = run_prefill(loaded, prompt_ids(25, seed=3))
    request_id = new_request_id()
    packed = await begin_and_publish(policy, manifests["snapkv-pyramid"], prefilled, request_id)
    if superseded_by == "successor_state":
        await policy.publish_state(publication(packed, parent=1, digest=hashlib.sha256(b"s2").hexdigest()))
        field = "state_generation"
    else:
        await policy.begin_request(request_id)
        field = "request_generation"
    sent = await transfer(stub, sender, worker, packed)

    error = await stream_error(stub, sent)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(error)
    assert (detail.field, detail.reason) == (field, common_pb2.ERROR_REASON_STALE_GENERATION)
    current = await policy.get_fence(request_id)
    assert detail.current.request_generation == current.request_generation
    assert detail.current.state_generation == current.state_generation
    assert worker.servicer.rejections == {f"StaleTransfer:{field}": 1}
    assert worker.servicer.scheduler.budget.used_bytes == 0


async def test_accept_over_the_kv_budget_is_resource_exhausted(stub, worker, sender, policy, loaded, manifests):
    prefilled = run_prefill(loaded, prompt_ids(12, seed=4))
    packed = await begin_and_publish(policy, manifests["full"], prefilled, new_request_id())
    sent = await asyncio.to_thread(
        describe, packed, sender, worker.rendezvous_address, sampling=sampling_proto(100_000)
    )
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=sent.message), timeout=CALL_S)
    sent.refused()
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = error_detail(error.value)
    assert (detail.field, detail.reason) == ("kv_budget_bytes", common_pb2.ERROR_REASON_CAPACITY)
    assert str(KV_BUDGET_BYTES) in detail.message
    assert worker.servicer.scheduler.budget.used_bytes == 0 and worker.servicer.open_transfers == 0

    # The worker keeps serving: the same request fits with a sane max_tokens.
    tokens, _ = await collect(stub, await transfer(stub, sender, worker, packed, sampling=sampling_proto(3)))
    assert len(tokens) >= 1


async def test_stream_of_an_unknown_transfer_is_not_found(stub):
    request = decode_pb2.StreamTokensRequest(request_id="req-x", request_generation=1, transfer_id="nope")
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in stub.StreamTokens(request, timeout=CALL_S):
            pass
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_detail(error.value).field == "transfer_id"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: setattr(m.sampling, "top_p", 2.0), "descriptor.sampling.top_p"),
        (lambda m: setattr(m.sampling, "temperature", -1.0), "descriptor.sampling.temperature"),
        (lambda m: setattr(m.sampling, "max_tokens", 0), "descriptor.sampling.max_tokens"),
        (lambda m: setattr(m, "first_token_id", VOCAB), "descriptor.first_token_id"),
        (lambda m: setattr(m.receipt, "manifest_sha256", "abc"), "descriptor.receipt.manifest_sha256"),
        (lambda m: setattr(m.ledger, "visible_payload_bytes", 1), "descriptor.ledger"),
        (lambda m: setattr(m, "rendezvous_address", "127.0.0.1:1/gloo/5"), "descriptor.rendezvous_address"),
        (lambda m: m.tensors.pop(), "descriptor.tensors"),
    ],
)
async def test_malformed_descriptor_is_invalid_argument_naming_the_field(
    mutate, field, stub, worker, sender, loaded, manifests
):
    packed = pack_state(manifests["full"], run_prefill(loaded, prompt_ids(8, seed=5)), new_request_id())
    sent = await asyncio.to_thread(describe, packed, sender, worker.rendezvous_address)
    mutate(sent.message)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=sent.message), timeout=CALL_S)
    sent.refused()
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(error.value).field == field
    assert worker.servicer.scheduler.budget.used_bytes == 0


async def test_client_cancel_frees_the_kv_at_once(stub, worker, sender, policy, loaded, manifests):
    prefilled = run_prefill(loaded, prompt_ids(20, seed=6))
    packed = await begin_and_publish(policy, manifests["snapkv"], prefilled, new_request_id())
    sent = await transfer(stub, sender, worker, packed, sampling=sampling_proto(2000, stop_token_ids=[]))
    call = stub.StreamTokens(stream_request(sent), timeout=CALL_S)
    for _ in range(3):
        event = await call.read()
        assert event.HasField("token")
    assert worker.servicer.scheduler.budget.used_bytes > 0
    call.cancel()
    await eventually(lambda: worker.servicer.scheduler.budget.used_bytes == 0, 5.0)
    assert worker.servicer.scheduler.active == 0 and worker.servicer.open_transfers == 0


async def test_transfer_whose_stream_never_opens_is_released_after_its_lease(
    stub, worker, sender, policy, loaded, manifests
):
    prefilled = run_prefill(loaded, prompt_ids(16, seed=7))
    packed = await begin_and_publish(policy, manifests["full"], prefilled, new_request_id())
    sent = await transfer(stub, sender, worker, packed, sampling=sampling_proto(50))
    assert worker.servicer.scheduler.budget.used_bytes > 0 and worker.servicer.open_transfers == 1
    # Decoding may finish before anyone listens; the accepted transfer itself lives until the lease.
    waited = await eventually(lambda: worker.servicer.open_transfers == 0, LEASE_TIMEOUT_S + 3.0)
    assert waited >= LEASE_TIMEOUT_S - 0.5
    assert worker.servicer.scheduler.budget.used_bytes == 0
    error = await stream_error(stub, sent)
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_endpoint_names_the_rendezvous_store(stub, worker):
    endpoint = await stub.GetTransferEndpoint(decode_pb2.GetTransferEndpointRequest(source_worker="p"), timeout=CALL_S)
    assert endpoint.rendezvous_address == worker.rendezvous_address
    assert list(endpoint.backends) == ["gloo"] and endpoint.decode_worker == worker.config.worker_id


async def test_duplicate_accept_and_second_stream_are_refused(stub, worker, sender, policy, loaded, manifests):
    prefilled = run_prefill(loaded, prompt_ids(14, seed=8))
    packed = await begin_and_publish(policy, manifests["full"], prefilled, new_request_id())
    sent = await transfer(stub, sender, worker, packed, sampling=sampling_proto(4))
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=sent.message), timeout=CALL_S)
    assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert error_detail(again.value).field == "descriptor.transfer_id"

    stale = stream_request(sent)
    stale.request_generation += 1
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in stub.StreamTokens(stale, timeout=CALL_S):
            pass
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_detail(error.value).field == "request_generation"

    first = stub.StreamTokens(stream_request(sent), timeout=CALL_S)
    assert (await first.read()).HasField("token")
    second = await stream_error(stub, sent)
    assert second.code() == grpc.StatusCode.ALREADY_EXISTS
    events = []
    while (event := await first.read()) is not grpc.aio.EOF:
        events.append(event)
    assert events[-1].HasField("summary") and events[-1].summary.output_tokens == len(events)
    await eventually(lambda: worker.servicer.scheduler.budget.used_bytes == 0, 5.0)
