"""Readiness: gRPC health says NOT_SERVING until every dependency answers and follows them
afterwards — a probe that flips, and the real policy service losing its Redis, which the
services that depend on it see through `PolicyClient.check_serving`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.policy import PolicyClient, PolicyClientConfig, StaleGeneration
from services.rpc.readiness import Readiness, ReadinessCheck, readiness_problems
from services.rpc.server import ServerConfig, start_server
from services.telemetry.metrics import STALE_REJECTIONS

pytestmark = pytest.mark.timeout(90)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
FAST = ServerConfig(port=0, readiness_interval_s=0.1, readiness_timeout_s=0.1, shutdown_grace_s=0.0)


async def _status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return int(reply.status)


async def _wait_status(address: str, status: int, timeout_s: float = 10.0, service: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while (current := await _status(address, service)) != status:
        assert time.monotonic() < deadline, f"health stayed {current}, expected {status}"
        await asyncio.sleep(0.05)


def test_problems_name_the_failed_checks() -> None:
    assert readiness_problems([("redis", None), ("policy", "UNAVAILABLE")]) == ["policy: UNAVAILABLE"]
    assert readiness_problems([("redis", None)]) == []


async def test_health_follows_the_probes_from_the_first_answer() -> None:
    answer: dict[str, str | None] = {"reason": "warming up"}

    async def probe() -> str | None:
        return answer["reason"]

    async def hangs() -> str | None:
        await asyncio.sleep(60)
        return None

    checks = [ReadinessCheck("model", probe)]
    server = await start_server(FAST, [], checks)
    try:
        assert await _status(server.address) == NOT_SERVING
        answer["reason"] = None
        await _wait_status(server.address, SERVING)
        answer["reason"] = "gone"
        await _wait_status(server.address, NOT_SERVING)
    finally:
        await server.stop(0)
    slow = await start_server(FAST, [], [ReadinessCheck("slow", hangs)])
    try:
        assert await _status(slow.address) == NOT_SERVING
        assert slow.readiness.problems == ["slow: no answer within 0.1 s"]
    finally:
        await slow.stop(0)


async def test_a_slow_dependency_is_tolerated_a_few_times_a_refusing_one_never() -> None:
    """Every worker probes the same policy service: one slow second of it must not turn them
    all NOT_SERVING together. Slow while ready: tolerated twice, not ready the third time in
    a row. A no, or a probe that raises, is not ready at once; slow before ever being ready is
    not ready either."""
    answer: dict[str, object] = {"reason": None}

    async def probe() -> str | None:
        if answer["reason"] == "slow":
            raise TimeoutError("policy: no answer in time")  # a probe's own deadline
        if answer["reason"] == "hang":
            await asyncio.sleep(5)
        return answer["reason"]  # type: ignore[return-value]

    servicer = health.aio.HealthServicer()
    readiness = Readiness(servicer, ["svc"], [ReadinessCheck("policy", probe)], interval_s=0.2, timeout_s=0.05,
                          unready_after_timeouts=3)
    answer["reason"] = "hang"
    assert not await readiness.evaluate()  # never ready yet: a timeout is not tolerated
    answer["reason"] = None
    assert await readiness.evaluate()
    for reason in ("slow", "hang"):
        assert await readiness.evaluate() and await readiness.evaluate()
        answer["reason"] = reason
        assert await readiness.evaluate() and await readiness.evaluate()
        assert not await readiness.evaluate()
        assert readiness.problems is not None and "no answer" in readiness.problems[0]
        answer["reason"] = None
        assert await readiness.evaluate()
    answer["reason"] = "NOT_SERVING"
    assert not await readiness.evaluate()
    assert readiness.problems == ["policy: NOT_SERVING"]
    with pytest.raises(ValueError, match="unready_after_timeouts"):
        Readiness(servicer, [], [], unready_after_timeouts=0)


async def test_while_not_ready_it_looks_again_four_times_as_often() -> None:
    calls: list[float] = []

    async def probe() -> str | None:
        calls.append(time.monotonic())
        return None if len(calls) > 3 else "down"

    readiness = Readiness(health.aio.HealthServicer(), [], [ReadinessCheck("dep", probe)], interval_s=0.4,
                          timeout_s=0.1)
    assert not await readiness.evaluate()
    readiness.start()
    try:
        await _until(lambda: _true(len(calls) >= 5), timeout_s=5)
    finally:
        await readiness.stop()
    gaps = [later - earlier for earlier, later in zip(calls, calls[1:], strict=False)]
    assert all(gap < 0.3 for gap in gaps[:3]), gaps  # 0.1 s apart while down
    assert gaps[3] >= 0.35, gaps  # the full interval once ready again


async def _true(value: bool) -> bool:
    return value


async def test_the_policy_check_reports_a_stopped_policy_service_as_refusing_within_the_probe() -> None:
    """The workers' check gives up before the probe's deadline, so a policy service that is
    gone reads as UNAVAILABLE (not ready at once), not as a slow answer."""
    server = await PolicyServer.start(PolicyServiceConfig(server=FAST))
    address = server.address
    await server.stop(0)
    client = PolicyClient(PolicyClientConfig(address, timeout_s=5.0))
    try:
        readiness = Readiness(health.aio.HealthServicer(), [], [client.readiness_check(0.5)], timeout_s=0.5)
        started = time.monotonic()
        assert not await readiness.evaluate()
        assert time.monotonic() - started < 0.5
        assert readiness.problems is not None and "UNAVAILABLE" in readiness.problems[0], readiness.problems
    finally:
        await client.close()


async def _until(predicate: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def test_policy_service_is_ready_while_redis_answers_and_dependents_see_it() -> None:
    config = PolicyServiceConfig(server=FAST)
    server = await PolicyServer.start(config)
    client = PolicyClient(PolicyClientConfig(server.address, timeout_s=1.0))
    try:
        assert await _status(server.address, "kvrelay.v1.PolicyService") == SERVING
        assert await client.check_serving() is None
        assert server.embedded is not None
        await asyncio.to_thread(server.embedded.close)  # Redis goes away under the service
        await _wait_status(server.address, NOT_SERVING, service="kvrelay.v1.PolicyService")
        reason = await client.check_serving()
        assert reason is not None and "NOT_SERVING" in reason
    finally:
        await client.close()
        server.embedded = None  # already closed
        await server.stop(0)
    await _until(lambda: _unreachable(client.config.target), timeout_s=10)


async def _unreachable(target: str) -> bool:
    async with PolicyClient(PolicyClientConfig(target, timeout_s=0.5)) as client:
        reason = await client.check_serving()
    return reason is not None and "UNAVAILABLE" in reason


async def test_stale_generations_are_counted_where_the_policy_service_refuses_them() -> None:
    server = await PolicyServer.start(PolicyServiceConfig(server=FAST))
    before = STALE_REJECTIONS.labels("policy")._value.get()
    try:
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=5.0)) as client:
            first = await client.begin_request("stale-1")
            await client.begin_request("stale-1")  # fences out generation 1
            with pytest.raises(StaleGeneration, match="request_generation"):
                await client.end_request("stale-1", first.request_generation)
    finally:
        await server.stop(0)
    assert STALE_REJECTIONS.labels("policy")._value.get() == before + 1
