"""A decode worker SIGKILLed in the middle of a transfer: the prefill worker gives up within
its transfer deadline and reports it, the gateway retries on the other decode worker with a
new request generation, and the client gets the full answer.

The doomed worker is a spare decode worker process reached through a forwarding gRPC proxy
in this test, so the kill lands at an exact point: the worker has accepted the transfer (its
KV is reserved and its receives are posted) and the prefill worker has not yet heard so.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from e2e_helpers import UpStack, get_fence, needle_ids

from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
from services.gateway.client import generate_request
from services.gateway.server import GatewayServer
from services.launcher.stack import ServiceProcess, WorkerPorts
from services.model import LoadedModel, generate
from services.redis_embedded import free_loopback_port
from services.rpc.errors import ERROR_DETAIL_KEY
from services.rpc.kvrelay.v1 import decode_pb2, decode_pb2_grpc, gateway_pb2_grpc
from services.rpc.server import ServerConfig, ServiceBinding, start_server

pytestmark = pytest.mark.timeout(180)
PREFILL_TRANSFER_TIMEOUT_S = 10.0  # E2E_ARGS in conftest.py


async def relay_error(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    metadata = [(k, v) for k, v in (exc.trailing_metadata() or ()) if k == ERROR_DETAIL_KEY]
    await context.abort(exc.code(), exc.details() or "", trailing_metadata=tuple(metadata))


class KillAfterAccept(decode_pb2_grpc.DecodeWorkerServicer):
    """Forwards every DecodeWorker call to `target`; once `target` has accepted a transfer it
    is SIGKILLed before the answer goes back to the prefill worker."""

    def __init__(self, target: ServiceProcess) -> None:
        self.target = target
        self.channel = grpc.aio.insecure_channel(target.address)
        self.stub = decode_pb2_grpc.DecodeWorkerStub(self.channel)
        self.killed_at: float | None = None

    async def GetTransferEndpoint(self, request, context):  # type: ignore[no-untyped-def]
        try:
            return await self.stub.GetTransferEndpoint(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)

    async def AcceptTransfer(self, request, context):  # type: ignore[no-untyped-def]
        try:
            reply = await self.stub.AcceptTransfer(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)
        assert reply.accepted
        await asyncio.to_thread(self.target.kill)
        self.killed_at = time.monotonic()
        return reply

    async def StreamTokens(self, request, context) -> AsyncIterator[decode_pb2.DecodeEvent]:  # type: ignore[no-untyped-def]
        try:
            async for event in self.stub.StreamTokens(request, timeout=60):
                yield event
        except grpc.aio.AioRpcError as exc:
            await relay_error(context, exc)


@pytest.fixture
def spare(stack: UpStack) -> Iterator[ServiceProcess]:
    worker = stack.launch_decode("decode-spare", WorkerPorts(free_loopback_port(), free_loopback_port()))
    yield worker
    worker.kill()


async def test_decode_worker_killed_mid_transfer_is_retried_elsewhere(
    stack: UpStack, loaded: LoadedModel, spare: ServiceProcess
) -> None:
    proxy = KillAfterAccept(spare)
    binding = ServiceBinding("kvrelay.v1.DecodeWorker",
                             lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(proxy, s))
    proxy_server = await start_server(ServerConfig(port=0, shutdown_grace_s=0), [binding])
    # Listed first, so the first attempt (fewest outstanding, listing order) goes through the proxy.
    gateway = await GatewayServer.start(GatewayConfig(
        checkpoint=stack.config.checkpoint,
        prefill_workers=WorkerSource(addresses=(stack.prefill_addresses[0],)),
        decode_workers=WorkerSource(addresses=(proxy_server.address, stack.decode_addresses[0])),
        policy_address=stack.policy_address,
        server=ServerConfig(port=0, shutdown_grace_s=0),
        discovery=DiscoveryConfig(health_interval_s=0.5),
    ))
    ids = needle_ids(loaded, 200, 21)
    request = generate_request(ids, policy="full", max_tokens=10, detokenize=False, request_id="e2e-failover-1")
    try:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            started = time.monotonic()
            events = [e async for e in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=90)]
            finished = time.monotonic()
    finally:
        await gateway.stop(0)
        await proxy_server.stop(0)
        await proxy.channel.close()

    assert proxy.killed_at is not None and not spare.running
    tokens = [e.token.token_id for e in events[:-1]]
    assert tokens == generate(loaded, ids, max_new_tokens=10)
    summary = events[-1].summary
    assert summary.decode_worker == stack.decode_addresses[0]
    # The prefill worker let go of the dead peer within its transfer deadline (plus the retry).
    assert finished - proxy.killed_at < PREFILL_TRANSFER_TIMEOUT_S + 5.0, finished - started
    fence = await get_fence(stack.policy_address, "e2e-failover-1")
    assert fence.request_generation == summary.generations.request_generation
    assert fence.decode_worker != proxy_server.address
