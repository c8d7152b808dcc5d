"""A burst of 64 concurrent valid requests completes without RESOURCE_EXHAUSTED.

The gateway caps what each prefill worker has outstanding and queues the rest within a bounded
wait; a prefill worker that still refuses for lack of room (here a spare one with a queue of 2,
smaller than that cap) is asked again after a backoff, preferring the other worker. Prints the
burst's p50/p99 latency (tiny e2e checkpoint, two prefill workers, two decode workers).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator

import grpc
import pytest
from e2e_helpers import UpStack, needle_ids

from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
from services.gateway.client import generate_request
from services.gateway.server import GatewayServer
from services.launcher.stack import ServiceProcess
from services.model import LoadedModel
from services.redis_embedded import free_loopback_port
from services.rpc.kvrelay.v1 import gateway_pb2_grpc
from services.rpc.server import ServerConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
BURST = 64
ADMISSION_S = 60.0


@pytest.fixture
def small_queue(stack: UpStack) -> Iterator[ServiceProcess]:
    """A spare prefill worker that runs 1 prompt and queues 2 (the default queues 16)."""
    worker = stack.launch_prefill("prefill-small-queue", free_loopback_port(), ("--max-queued", "2"))
    try:
        yield worker
    finally:
        worker.kill()


async def one(stub: gateway_pb2_grpc.GatewayStub, ids: list[int], index: int) -> tuple[str, float, str]:
    started = time.monotonic()
    request = generate_request(ids, policy="snapkv", max_tokens=16, detokenize=False, request_id=f"e2e-burst-{index}")
    try:
        events = [event async for event in stub.Generate(request, timeout=ADMISSION_S + 60)]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, time.monotonic() - started, exc.details() or ""
    return "OK", time.monotonic() - started, events[-1].summary.prefill_worker


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def test_a_burst_of_64_requests_queues_instead_of_failing(
    stack: UpStack, loaded: LoadedModel, small_queue: ServiceProcess
) -> None:
    # The small-queue worker first: ties go to it, so it is offered more than it can hold.
    gateway = await GatewayServer.start(GatewayConfig(
        checkpoint=stack.config.checkpoint,
        prefill_workers=WorkerSource(addresses=(small_queue.address, stack.prefill_addresses[0])),
        decode_workers=WorkerSource(addresses=tuple(stack.decode_addresses)),
        policy_address=stack.policy_address,
        server=ServerConfig(port=0, shutdown_grace_s=0),
        discovery=DiscoveryConfig(health_interval_s=0.5),
        admission_timeout_s=ADMISSION_S,
    ))
    ids = needle_ids(loaded, 60, 3)
    try:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            assert (await one(stub, ids, -1))[0] == "OK"  # warm: pair groups exist, manifests cached
            started = time.monotonic()
            results = await asyncio.gather(*(one(stub, ids, i) for i in range(BURST)))
            wall = time.monotonic() - started
    finally:
        await gateway.stop(0)

    outcomes = collections.Counter(status for status, _, _ in results)
    assert outcomes == {"OK": BURST}, [r for r in results if r[0] != "OK"][:3]
    served_by = collections.Counter(worker for _, _, worker in results)
    assert set(served_by) == {"prefill-small-queue", "prefill-0"}, served_by
    latencies = [seconds for _, seconds, _ in results]
    print(f"\nburst of {BURST}: all OK in {wall:.2f} s, p50 {quantile(latencies, 0.5):.2f} s, "
          f"p99 {quantile(latencies, 0.99):.2f} s; prefilled by {dict(served_by)}")
    assert max(latencies) < ADMISSION_S
