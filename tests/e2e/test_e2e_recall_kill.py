"""A prefill worker SIGKILLed while two requests are recallable from its offload store: each
decode worker's recall gives up within its deadline and takes the manifest's fallback —
`continue_lossy` finishes the request and records the fallback, `fail_request` ends it with
UNAVAILABLE (reason RECALL_TIMEOUT) after the tokens already streamed — and nothing hangs.

The doomed worker is a spare prefill process that advertises a forwarding OffloadService
proxy in this test as its offload address, so the kill lands at an exact point: both decode
workers have asked Recall, the prefill worker has answered and queued the rows on the pair
groups, and the decode workers have not yet heard the answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator

import grpc
import pytest
from e2e_helpers import UpStack, needle_ids

from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
from services.gateway.client import generate_request
from services.gateway.server import GatewayServer
from services.kvpolicy.manifest import RecoverabilityMode, TimeoutFallback, default_manifests
from services.launcher.stack import ServiceProcess
from services.model import LoadedModel
from services.offload.recall import RecallKnobs, with_recall
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import free_loopback_port
from services.rpc.errors import ERROR_DETAIL_KEY, error_detail
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2_grpc, offload_pb2_grpc
from services.rpc.server import ServerConfig, ServiceBinding, start_server

pytestmark = pytest.mark.timeout(180)
RECALL_TIMEOUT_MS = 8000
HOLD_S = 6.0  # how long the first recall waits for the second before the kill anyway
MAX_TOKENS = 6


class KillOnRecall(offload_pb2_grpc.OffloadServiceServicer):
    """Forwards OffloadService calls to `target`. Recalls are held until `expected` have
    arrived; then each is answered by `target`, which is SIGKILLed before the answers return."""

    def __init__(self, target: ServiceProcess, expected: int) -> None:
        self.target = target
        self.expected = expected
        self.arrived = 0
        self.all_arrived = asyncio.Event()
        self.killed_at: float | None = None
        self._answered = 0
        self._killed = asyncio.Event()
        self._kill_lock = asyncio.Lock()
        self.channel = grpc.aio.insecure_channel(target.address)
        self.stub = offload_pb2_grpc.OffloadServiceStub(self.channel)

    async def Recall(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.arrived += 1
        if self.arrived >= self.expected:
            self.all_arrived.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_arrived.wait(), HOLD_S)
        try:
            reply = await self.stub.Recall(request, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)
        self._answered += 1
        if self._answered < self.expected:  # the other answer is on its way: kill before either returns
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._killed.wait(), HOLD_S)
        await self._kill()
        return reply

    async def _kill(self) -> None:
        async with self._kill_lock:
            if self.killed_at is None:
                await asyncio.to_thread(self.target.kill)
                self.killed_at = time.monotonic()
                self._killed.set()

    async def RenewLease(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        try:
            return await self.stub.RenewLease(request, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)

    async def Release(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        try:
            return await self.stub.Release(request, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)


async def relay_error(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    metadata = [(k, v) for k, v in (exc.trailing_metadata() or ()) if k == ERROR_DETAIL_KEY]
    await context.abort(exc.code(), exc.details() or "", trailing_metadata=tuple(metadata))


@pytest.fixture
def doomed_port() -> int:
    return free_loopback_port()


@pytest.fixture
def proxy_port() -> int:
    return free_loopback_port()


@pytest.fixture
def doomed(stack: UpStack, doomed_port: int, proxy_port: int) -> Iterator[ServiceProcess]:
    worker = stack.launch_prefill("prefill-doomed", doomed_port,
                                  ("--offload-address", f"127.0.0.1:{proxy_port}", "--offload-lease-s", "60"))
    yield worker
    worker.kill()


def manifest(loaded: LoadedModel, fallback: TimeoutFallback):  # type: ignore[no-untyped-def]
    knobs = RecallKnobs(threshold=0.0, page_size=8, max_pages_per_step=64, cadence_steps=1,
                        timeout_ms=RECALL_TIMEOUT_MS, fallback=fallback)
    recall = with_recall(default_manifests(loaded.tensor_contract)["snapkv"], knobs,
                         mode=RecoverabilityMode.RECALLABLE_REMOTE)
    name = f"snapkv-kill-{fallback.value.replace('_', '-')}"
    return dataclasses.replace(recall, name=name, policy_manifest_id=f"{name}@1")


async def generate(gateway_address: str, request) -> tuple[list[int], object, float]:  # type: ignore[no-untyped-def]
    """(token ids, the summary or the RPC error, when the call ended)."""
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(gateway_address) as channel:
        try:
            async for event in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=90):
                if event.HasField("summary"):
                    return tokens, event.summary, time.monotonic()
                tokens.append(event.token.token_id)
        except grpc.aio.AioRpcError as exc:
            return tokens, exc, time.monotonic()
    raise AssertionError("the stream ended without a summary or an error")


async def test_prefill_worker_killed_while_recallable_takes_each_fallback_within_the_deadline(
    stack: UpStack, loaded: LoadedModel, doomed: ServiceProcess, proxy_port: int
) -> None:
    lossy, fail = manifest(loaded, TimeoutFallback.CONTINUE_LOSSY), manifest(loaded, TimeoutFallback.FAIL_REQUEST)
    async with PolicyClient(PolicyClientConfig(stack.policy_address, timeout_s=10.0)) as policy:
        for m in (lossy, fail):
            await policy.register_manifest(m.canonical_json())
    proxy = KillOnRecall(doomed, expected=2)
    binding = ServiceBinding("kvrelay.v1.OffloadService",
                             lambda s: offload_pb2_grpc.add_OffloadServiceServicer_to_server(proxy, s))
    proxy_server = await start_server(ServerConfig(port=proxy_port, shutdown_grace_s=0), [binding])
    # One prefill worker (the doomed one), both decode workers: the two requests decode on
    # different workers, so each decode loop is held by its own recall only.
    gateway = await GatewayServer.start(GatewayConfig(
        checkpoint=stack.config.checkpoint,
        prefill_workers=WorkerSource(addresses=(doomed.address,)),
        decode_workers=WorkerSource(addresses=tuple(stack.decode_addresses)),
        policy_address=stack.policy_address,
        server=ServerConfig(port=0, shutdown_grace_s=0),
        discovery=DiscoveryConfig(health_interval_s=0.5),
    ))
    ids = needle_ids(loaded, 300, 41)
    try:
        first = asyncio.create_task(generate(gateway.address, generate_request(
            ids, manifest_sha256=lossy.sha256, max_tokens=MAX_TOKENS, detokenize=False, request_id="e2e-kill-lossy")))
        await asyncio.sleep(0.3)  # the first request holds its decode worker: the second gets the other
        second = asyncio.create_task(generate(gateway.address, generate_request(
            ids, manifest_sha256=fail.sha256, max_tokens=MAX_TOKENS, detokenize=False, request_id="e2e-kill-fail")))
        (lossy_tokens, lossy_end, lossy_at), (fail_tokens, fail_end, fail_at) = await asyncio.gather(first, second)
    finally:
        await gateway.stop(0)
        await proxy_server.stop(0)
        await proxy.channel.close()

    assert proxy.killed_at is not None and not doomed.running and proxy.arrived >= 2
    deadline_s = RECALL_TIMEOUT_MS / 1000.0
    # continue_lossy: the request finishes, every recall after the kill recorded as a fallback.
    assert not isinstance(lossy_end, grpc.aio.AioRpcError), lossy_end
    assert len(lossy_tokens) == lossy_end.output_tokens >= 1  # type: ignore[attr-defined]
    fallbacks = set(lossy_end.fallbacks)  # type: ignore[attr-defined]
    assert fallbacks and fallbacks <= {"recall_timeout:continue_lossy", "recall_unavailable:continue_lossy"}
    assert lossy_end.recalled_rows == 0  # type: ignore[attr-defined]
    assert lossy_at - proxy.killed_at < deadline_s + 5.0
    # fail_request: the stream ends with the recall's status after the first token.
    assert isinstance(fail_end, grpc.aio.AioRpcError)
    assert fail_end.code() == grpc.StatusCode.UNAVAILABLE
    detail = error_detail(fail_end)
    assert detail is not None and detail.reason == common_pb2.ERROR_REASON_RECALL_TIMEOUT
    assert len(fail_tokens) >= 1
    assert fail_at - proxy.killed_at < deadline_s + 5.0
