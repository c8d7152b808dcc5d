"""The prefill worker's OffloadService over real gRPC, a real policy service on a real redis, and
a real gloo pair group to a KVReceiver in this process (the decode worker's side of a recall).

The stored rows are symbolic (K[l,h,t,c] = 1000 l + 100 h + 10 t + c, V = 5000 + K), so a
recalled row proves its own (layer, owner, position). Covered: Recall returns exactly the
stored rows at their original positions (inline and over the pair group, through the decode
worker's `RemotePageFetcher`); superseded request or parent state generations are
FAILED_PRECONDITION with the current fence; unknown, released or malformed calls are
NOT_FOUND / INVALID_ARGUMENT naming the field; store bytes return to zero on Release, on lease
expiry and when the policy service ends the request; the store never exceeds its bound and a
request that does not fit degrades (recorded)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from kv_helpers import symbolic_kv

from decode_worker.recall import RemoteHandoff, RemotePageFetcher
from prefill_worker.offload import Offloaded, OffloadTier
from prefill_worker.offload_service import SERVICE_NAME, OffloadServicer, sweep
from prefill_worker.wire import DecodeTarget, PrefillCall
from services.kvpolicy.ledger import ledger_for
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, RecoverabilityMode
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.state import KVPolicyState
from services.model import LoadedModel, SamplingParams
from services.offload.errors import RecallUnavailable
from services.offload.pages import PageRef, PageSummaries
from services.offload.plan import offload_plan
from services.offload.recall import RecallKnobs, with_recall
from services.offload.store import OffloadStoreConfig, OnFull
from services.policy import PolicyClient, StatePublication
from services.policy.types import Phase
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import offload_pb2, offload_pb2_grpc
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server
from services.telemetry.metrics import registry_for
from services.transfer import KVReceiver, KVSender
from services.transfer.recall import RecallCall, answer_from_proto, call_to_proto

pytestmark = pytest.mark.timeout(60)
TOKENS, PAGE = 24, 4
SELECTED = [[[0, 1, 9, 23], [0, 5, 6, 23]], [[2, 3, 4, 23], [0, 12, 23]]]


@pytest.fixture(scope="module")
def manifests(model: LoadedModel) -> dict[str, KVVisibilityPolicyManifest]:
    from services.kvpolicy.manifest import default_manifests

    base = default_manifests(model.tensor_contract, observation_window=4, recent_window=8, sinks=1)["snapkv"]
    knobs = RecallKnobs(threshold=0.0, page_size=PAGE, max_pages_per_step=4, cadence_steps=1, timeout_ms=5000)
    return {"snapkv-recall": with_recall(base, knobs, mode=RecoverabilityMode.RECALLABLE_REMOTE)}


@dataclass
class Offload:
    tier: OffloadTier
    servicer: OffloadServicer
    server: RpcServer
    stub: offload_pb2_grpc.OffloadServiceStub
    sender: KVSender


async def start_offload(policy: PolicyClient, store: OffloadStoreConfig) -> Offload:
    tier = OffloadTier(store)
    sender = KVSender(f"prefill-{uuid.uuid4().hex[:6]}")
    servicer = OffloadServicer(tier, policy, sender, torch.device("cpu"), policy_timeout_s=5.0, send_timeout_s=10.0)
    binding = ServiceBinding(SERVICE_NAME, lambda s: offload_pb2_grpc.add_OffloadServiceServicer_to_server(servicer, s))
    server = await start_server(ServerConfig(port=0, shutdown_grace_s=0.2), [binding])
    tier.address = server.address
    channel = grpc.aio.insecure_channel(server.address)
    return Offload(tier, servicer, server, offload_pb2_grpc.OffloadServiceStub(channel), sender)


@pytest.fixture
async def offload(policy: PolicyClient) -> AsyncIterator[Offload]:
    started = await start_offload(policy, OffloadStoreConfig(capacity_bytes=1 << 20, lease_s=30.0))
    yield started
    await started.servicer.close()
    await started.server.stop(0)
    started.sender.close()


@dataclass(frozen=True)
class Held:
    request_id: str
    generation: int
    offloaded: Offloaded
    summaries: PageSummaries


async def hold_request(
    offload: Offload, policy: PolicyClient, manifest: KVVisibilityPolicyManifest, request_id: str | None = None
) -> Held:
    """Begin a request, publish its state 1, and offload its omitted (symbolic) rows."""
    request_id = request_id or f"req-{uuid.uuid4().hex[:8]}"
    generation = (await policy.begin_request(request_id)).request_generation
    state = KVPolicyState(request_id, manifest.sha256, generation, 1, 0, 1, TOKENS, SELECTED)
    await policy.publish_state(StatePublication(
        request_id, generation, 0, 1, 1, Receipt.for_state(state).digest, manifest.sha256, Phase.PREFILLED))
    k, v = symbolic_kv(2, 2, TOKENS, manifest.tensor.head_dim)
    plan = offload_plan(manifest, k, v, SELECTED)
    call = PrefillCall(request_id, generation, (3,), SamplingParams(), 4, manifest.sha256, DecodeTarget("127.0.0.1:1", "d"))
    offloaded = offload.tier.hold(call, plan, 1)
    assert plan is not None
    return Held(request_id, generation, offloaded, plan.summaries)


def recall_request(held: Held, pages: list[PageRef], parent: int = 1, **fields: object) -> offload_pb2.RecallRequest:
    call = RecallCall(held.request_id, held.generation, parent, held.offloaded.handoff_id, tuple(pages), inline=True)
    message = call_to_proto(call)
    for name, value in fields.items():
        setattr(message, name, value)
    return message


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


def assert_symbolic(page, summaries: PageSummaries) -> None:
    """Every row is K[l, h, t, :] of its own page's positions (and V = 5000 + K)."""
    index = summaries.global_index(page.ref)
    first, count = int(summaries.page_first[index]), int(summaries.page_count[index])
    assert page.positions.tolist() == list(range(first, first + count))
    d_h = page.k.shape[1]
    for row, t in enumerate(page.positions.tolist()):
        expected = 1000.0 * page.ref.layer + 100 * page.ref.owner + 10 * t + torch.arange(d_h).float()
        assert torch.equal(page.k[row], expected) and torch.equal(page.v[row], expected + 5000)


async def test_recall_returns_exactly_the_stored_rows_inline_and_over_the_pair_group(
    offload: Offload, policy: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    held = await hold_request(offload, policy, manifests["snapkv-recall"])
    assert held.offloaded.mode is RecoverabilityMode.RECALLABLE_REMOTE and held.offloaded.lease_ms == 30_000
    refs = [held.summaries.page_ref(p) for p in (held.summaries.num_pages - 1, 0, 2)]

    reply = await offload.stub.Recall(recall_request(held, refs), timeout=10)
    answer = answer_from_proto(reply)
    assert answer.transfer is None and [p.ref for p in answer.inline] == sorted(refs, key=lambda r: (r.layer, r.owner, r.page_index))
    for page in answer.inline:
        assert_symbolic(page, held.summaries)
    assert answer.nbytes == sum(p.nbytes for p in answer.inline)

    receiver = KVReceiver()
    try:
        offload.tier.bind_decode(held.offloaded.handoff_id, receiver.address)  # as the send stage does
        handoff = RemoteHandoff(held.request_id, held.generation, held.offloaded.handoff_id, offload.server.address)
        fetch = RemotePageFetcher(handoff, offload.stub, receiver, asyncio.get_running_loop(), lambda: 1)
        pages = await asyncio.to_thread(fetch, refs, 10.0)
        assert {p.ref for p in pages} == set(refs) and len(pages) == len(refs)
        for page in pages:
            assert_symbolic(page, held.summaries)
        rows = sum(int(p.positions.shape[0]) for p in pages)
        assert fetch.bytes_moved == rows * 2 * 16 * 4 + rows * 4 + 2 * 3 * 4  # K, V, positions, offsets
    finally:
        receiver.close()
    assert offload.tier.store is not None and offload.tier.store.used_bytes > 0  # a recall keeps the rows


async def test_superseded_generations_are_rejected_with_the_current_fence(
    offload: Offload, policy: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    manifest = manifests["snapkv-recall"]
    held = await hold_request(offload, policy, manifest)
    page = [held.summaries.page_ref(0)]
    state = KVPolicyState(held.request_id, manifest.sha256, held.generation, 2, 1, 3, TOKENS, SELECTED)
    await policy.publish_state(StatePublication(
        held.request_id, held.generation, 1, 2, 3, Receipt.for_state(state).digest, manifest.sha256, Phase.RECALLED))
    stale_parent = await rpc_error(offload.stub.Recall(recall_request(held, page, parent=1), timeout=10))
    assert stale_parent.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(stale_parent)
    assert detail is not None and detail.field == "parent_state_generation" and detail.current.state_generation == 2
    assert (await offload.stub.Recall(recall_request(held, page, parent=2), timeout=10)).pages
    receiver = KVReceiver()
    try:  # the decode worker's fetcher asking on behalf of the superseded state: rejected
        handoff = RemoteHandoff(held.request_id, held.generation, held.offloaded.handoff_id, offload.server.address)
        fetch = RemotePageFetcher(handoff, offload.stub, receiver, asyncio.get_running_loop(), lambda: 1)
        with pytest.raises(RecallUnavailable, match="FAILED_PRECONDITION"):
            await asyncio.to_thread(fetch, page, 5.0)
    finally:
        receiver.close()

    newer = await policy.begin_request(held.request_id)
    superseded = await rpc_error(offload.stub.Recall(recall_request(held, page, parent=2), timeout=10))
    assert superseded.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(superseded)
    assert detail is not None and detail.field == "request_generation"
    assert detail.current.request_generation == newer.request_generation
    assert offload.tier.store is not None and offload.tier.store.used_bytes == 0  # fenced out, dropped


async def test_unknown_malformed_and_released_calls_name_the_field(
    offload: Offload, policy: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    held = await hold_request(offload, policy, manifests["snapkv-recall"])
    page = [held.summaries.page_ref(0)]
    unknown = await rpc_error(offload.stub.Recall(recall_request(held, page, handoff_id="nope"), timeout=10))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and error_detail(unknown).field == "handoff_id"  # type: ignore[union-attr]
    empty = recall_request(held, page)
    del empty.pages[:]
    malformed = await rpc_error(offload.stub.Recall(empty, timeout=10))
    assert malformed.code() == grpc.StatusCode.INVALID_ARGUMENT and error_detail(malformed).field == "pages"  # type: ignore[union-attr]
    outside = await rpc_error(offload.stub.Recall(recall_request(held, [PageRef(0, 0, 99)]), timeout=10))
    assert outside.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(outside).field == "pages[0].page_index"  # type: ignore[union-attr]

    offload.tier.bind_decode(held.offloaded.handoff_id, "127.0.0.1:1")  # the view went there
    elsewhere = recall_request(held, page, inline=False, rendezvous_address="127.0.0.1:2")
    misdirected = await rpc_error(offload.stub.Recall(elsewhere, timeout=10))
    assert misdirected.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(misdirected).field == "rendezvous_address"  # type: ignore[union-attr]

    store = offload.tier.store
    assert store is not None
    used = store.used_bytes
    release = offload_pb2.ReleaseRequest(request_id=held.request_id, request_generation=held.generation,
                                         handoff_id=held.offloaded.handoff_id)
    assert (await offload.stub.Release(release, timeout=10)).freed_bytes == used > 0
    assert store.used_bytes == 0 and (await offload.stub.Release(release, timeout=10)).freed_bytes == 0
    gone = await rpc_error(offload.stub.Recall(recall_request(held, page), timeout=10))
    assert gone.code() == grpc.StatusCode.NOT_FOUND

    ended = await hold_request(offload, policy, manifests["snapkv-recall"])
    assert store.used_bytes > 0
    await policy.end_request(ended.request_id, ended.generation)
    await sweep(offload.tier, policy, timeout_s=5.0)  # what the prefill worker runs periodically
    assert store.used_bytes == 0


async def test_leases_hold_while_renewed_and_expire_after(
    policy: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    offload = await start_offload(policy, OffloadStoreConfig(capacity_bytes=1 << 20, lease_s=0.6))
    try:
        held = await hold_request(offload, policy, manifests["snapkv-recall"])
        store = offload.tier.store
        assert store is not None
        renew = offload_pb2.RenewLeaseRequest(request_id=held.request_id, request_generation=held.generation,
                                              handoff_id=held.offloaded.handoff_id)
        for _ in range(6):  # 1.2 s, twice the lease
            await asyncio.sleep(0.2)
            assert (await offload.stub.RenewLease(renew, timeout=5)).entries == 1
        offload.tier.expire()
        assert store.used_bytes > 0
        await asyncio.sleep(0.8)
        await sweep(offload.tier, policy, timeout_s=5.0)
        assert store.used_bytes == 0
        expired = await rpc_error(offload.stub.RenewLease(renew, timeout=5))
        assert expired.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await offload.server.stop(0)
        offload.sender.close()


async def test_the_store_never_exceeds_its_bound_and_overflow_degrades(
    policy: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    manifest = manifests["snapkv-recall"]
    k, v = symbolic_kv(2, 2, TOKENS, manifest.tensor.head_dim)
    plan = offload_plan(manifest, k, v, SELECTED)
    assert plan is not None
    capacity = plan.rows.nbytes * 3 // 2
    before = refusals("store_full")
    offload = await start_offload(policy, OffloadStoreConfig(capacity_bytes=capacity, lease_s=30.0, on_full=OnFull.REFUSE))
    try:
        first = await hold_request(offload, policy, manifest)
        second = await hold_request(offload, policy, manifest)
        store = offload.tier.store
        assert store is not None
        assert first.offloaded.handoff_id and first.offloaded.sidecar is not None
        assert second.offloaded.mode is RecoverabilityMode.OMITTED_IRRECOVERABLE
        assert second.offloaded.degraded == "offload_refused:store_full" and second.offloaded.sidecar is None
        assert 0 < store.used_bytes <= capacity
        assert refusals("store_full") == before + 1
        ledger = ledger_for(manifest, TOKENS, SELECTED)
        assert second.offloaded.ledger(ledger) == ledger  # degraded: nothing travels besides the view
        charged = first.offloaded.ledger(ledger)
        assert charged.page_summary_bytes == plan.summaries.nbytes and charged.host_tier_bytes == 0
        assert charged.traffic_bytes == ledger.traffic_bytes + plan.summaries.nbytes

        tiny = await start_offload(policy, OffloadStoreConfig(capacity_bytes=plan.rows.nbytes - 1, lease_s=30.0))
        try:
            too_big = await hold_request(tiny, policy, manifest)
            assert too_big.offloaded.degraded == "offload_refused:larger_than_capacity"
            assert tiny.tier.store is not None and tiny.tier.store.used_bytes == 0
        finally:
            await tiny.server.stop(0)
            tiny.sender.close()
    finally:
        await offload.server.stop(0)
        offload.sender.close()


def refusals(reason: str) -> float:
    """The prefill role's kvrelay_offload_refusals_total{reason} as its /metrics shows it."""
    return registry_for("prefill").get_sample_value("kvrelay_offload_refusals_total", {"reason": reason}) or 0.0


async def test_an_unreachable_offload_tier_is_unavailable_within_the_deadline() -> None:
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel("127.0.0.1:9") as channel:  # nothing listens on discard
        receiver = KVReceiver()
        try:
            handoff = RemoteHandoff("req-gone", 1, "h", "127.0.0.1:9")
            fetch = RemotePageFetcher(handoff, offload_pb2_grpc.OffloadServiceStub(channel), receiver, loop, lambda: 1)
            started = loop.time()
            with pytest.raises(RecallUnavailable):
                await asyncio.to_thread(fetch, [PageRef(0, 0, 0)], 0.5)
            assert loop.time() - started < 1.5
        finally:
            receiver.close()
