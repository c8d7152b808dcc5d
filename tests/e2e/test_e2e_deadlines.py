"""A decode worker that hangs (SIGSTOP: alive, but silent) holds no request past its deadline.

A stream it was serving ends with UNAVAILABLE naming it at the gateway's inter-event deadline
while a stream on the other decode worker goes on; a request sent to it just as it stopped is
given up by the prefill worker at its accept timeout (its pair-group store never answers) and
retried on the other decode worker; once it continues (SIGCONT) it serves again, and every
request is ended in the policy service. The stopped worker is a spare decode worker process
and the gateway an in-process one with short deadlines, so the test is quick.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from e2e_helpers import UpStack, get_fence, needle_ids

from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
from services.gateway.client import generate_request
from services.gateway.server import GatewayServer
from services.launcher.stack import ServiceProcess, WorkerPorts
from services.model import LoadedModel
from services.policy.types import Phase
from services.redis_embedded import free_loopback_port
from services.rpc.kvrelay.v1 import gateway_pb2, gateway_pb2_grpc
from services.rpc.server import ServerConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
EVENT_S = 2.0  # the gateway's deadline between two events
ACCEPT_S = 5.0  # each control call of the stack's prefill workers to a decode worker (their default)
SLACK_S = 3.0


@pytest.fixture
def stopped(stack: UpStack) -> Iterator[ServiceProcess]:
    """A spare decode worker; whatever the test does to it, it is continued and killed after."""
    worker = stack.launch_decode("decode-stopped", WorkerPorts(free_loopback_port(), free_loopback_port()))
    try:
        yield worker
    finally:
        if worker.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGCONT)
        worker.kill()


async def stream(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest,
                 started: asyncio.Event | None = None, after: int = 1,
                 ) -> tuple[str, float, list[gateway_pb2.GenerateEvent]]:
    """(status, when it ended on the monotonic clock, events) of one Generate; `started` is
    set once `after` events arrived."""
    events = []
    try:
        async for event in stub.Generate(request, timeout=60):
            events.append(event)
            if started is not None and len(events) >= after:
                started.set()
        return "OK", time.monotonic(), events
    except grpc.aio.AioRpcError as exc:
        return f"{exc.code().name}: {exc.details()}", time.monotonic(), events


async def ended(policy_address: str, request_id: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await get_fence(policy_address, request_id)).phase is Phase.ENDED:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_stopped_decode_worker_holds_no_request_past_its_deadline(
    stack: UpStack, loaded: LoadedModel, stopped: ServiceProcess
) -> None:
    healthy = stack.decode_addresses[0]
    # One prefill worker, so the request sent at the stop finds its idle pair group to the
    # stopped worker (made by the first stream) and asks that worker's store about it.
    gateway = await GatewayServer.start(GatewayConfig(
        checkpoint=stack.config.checkpoint,
        prefill_workers=WorkerSource(addresses=(stack.prefill_addresses[0],)),
        decode_workers=WorkerSource(addresses=(stopped.address, healthy)),
        policy_address=stack.policy_address,
        server=ServerConfig(port=0, shutdown_grace_s=0),
        discovery=DiscoveryConfig(health_interval_s=0.3, health_timeout_s=1.0),
        prefill_timeout_s=30.0, first_event_timeout_s=2 * EVENT_S, event_timeout_s=EVENT_S,
    ))
    ids = needle_ids(loaded, 120, 5)
    try:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            # Two long streams: the first on the worker to stop (listing order), the second on the other.
            # The stop comes once both are streaming (two events each): on a loaded machine the
            # doomed worker had sent one token when the survivor's first arrived.
            on_stopped, on_healthy = asyncio.Event(), asyncio.Event()
            doomed = asyncio.ensure_future(stream(stub, generate_request(
                ids, policy="full", max_tokens=3000, detokenize=False, request_id="e2e-stop-doomed"),
                on_stopped, after=2))
            await asyncio.wait_for(on_stopped.wait(), 60)
            survivor = asyncio.ensure_future(stream(stub, generate_request(
                ids, policy="full", max_tokens=3000, detokenize=False, request_id="e2e-stop-survivor"),
                on_healthy, after=2))
            await asyncio.wait_for(on_healthy.wait(), 60)

            assert stopped.pid is not None
            os.kill(stopped.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            # Picked before any health check notices: the least recently picked worker, the stopped one.
            retried = await stream(stub, generate_request(ids, policy="full", max_tokens=8, detokenize=False,
                                                          request_id="e2e-stop-retried"))
            status, doomed_end, events = await doomed
            survivor_status = survivor.result()[0] if survivor.done() else "still streaming"
            survivor.cancel()

            os.kill(stopped.pid, signal.SIGCONT)
            continued_at = time.monotonic()
            pool = gateway.decode_pool
            while not next(c.healthy for c in pool.candidates() if c.address == stopped.address):
                assert time.monotonic() - continued_at < 20, "the continued worker never passed a health check"
                await asyncio.sleep(0.05)
            again = await stream(stub, generate_request(ids, policy="full", max_tokens=8, detokenize=False,
                                                        request_id="e2e-stop-again"))
            recovered_s = time.monotonic() - continued_at
    finally:
        await gateway.stop(0)

    # The stream on the stopped worker: UNAVAILABLE naming it, at the inter-event deadline.
    assert status.startswith("UNAVAILABLE") and stopped.address in status, status
    doomed_s, retried_s = doomed_end - stopped_at, retried[1] - stopped_at
    assert len(events) > 1 and doomed_s < EVENT_S + SLACK_S, doomed_s
    assert survivor_status in ("OK", "still streaming"), survivor_status  # the other worker's stream went on
    # The request sent at the stop: given up at the accept timeout, answered by the other worker.
    assert retried[0] == "OK", retried[0]
    assert retried[2][-1].summary.decode_worker == healthy
    assert retried_s < ACCEPT_S + SLACK_S, retried_s
    # Continued, the worker serves again (the least recently picked one).
    assert again[0] == "OK" and again[2][-1].summary.decode_worker == stopped.address, again[0]
    print(f"\nstopped decode worker: stream ended after {doomed_s:.2f} s (deadline {EVENT_S} s), "
          f"request at the stop answered in {retried_s:.2f} s (accept timeout {ACCEPT_S} s), "
          f"serving again {recovered_s:.2f} s after SIGCONT")
    for request_id in ("e2e-stop-doomed", "e2e-stop-survivor", "e2e-stop-retried", "e2e-stop-again"):
        assert await ended(stack.policy_address, request_id), request_id
