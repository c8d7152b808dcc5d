"""Worker discovery: parsing static and DNS sources, least-outstanding picking, a pool that
follows real gRPC health services and re-resolved DNS answers, and admission: leases beyond a
per-worker cap wait their turn, first come first served, within a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.admission import WaitQueue, WorkersBusy
from services.gateway.discovery import (
    Candidate,
    DiscoveryConfig,
    NoHealthyWorker,
    WorkerPool,
    WorkerSource,
    pick,
    resolve_dns,
)
from services.rpc.kvrelay.v1 import decode_pb2_grpc
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server

SERVICE = "kvrelay.v1.DecodeWorker"
FAST = DiscoveryConfig(health_interval_s=0.05, health_timeout_s=0.5, resolve_interval_s=0.05)


def test_parse_static_list_and_dns_names() -> None:
    assert WorkerSource.parse("a:1, b:2,[::1]:3").addresses == ("a:1", "b:2", "[::1]:3")
    dns = WorkerSource.parse("dns:///decode.kvrelay.svc:50063")
    assert (dns.dns_host, dns.dns_port, str(dns)) == ("decode.kvrelay.svc", 50063, "dns:///decode.kvrelay.svc:50063")
    assert WorkerSource.parse("dns:decode:7").dns_host == "decode"
    for bad in ("", "nohost", "a:0", "a:70000", "dns:///noport", "a:1,b"):
        with pytest.raises(ValueError, match="decode_workers"):
            WorkerSource.parse(bad, "decode_workers")


def test_pick_prefers_healthy_least_outstanding_then_least_recent() -> None:
    workers = [Candidate("a", True, 2, 1), Candidate("b", True, 1, 5), Candidate("c", True, 1, 3),
               Candidate("d", False, 0, 0)]
    assert pick(workers) == "c"
    assert pick(workers, frozenset({"c"})) == "b"
    assert pick([Candidate("x", True, 0, 0), Candidate("y", True, 0, 0)]) == "x"  # listing order
    assert pick([Candidate("only", True, 9, 9)], frozenset({"only"})) == "only"  # avoided, but the only one
    assert pick([Candidate("down", False, 0, 0)]) is None
    assert pick([]) is None


async def test_localhost_resolves_to_loopback() -> None:
    addresses = await resolve_dns("localhost", 50063)
    assert "127.0.0.1:50063" in addresses or "[::1]:50063" in addresses


async def start_worker() -> RpcServer:
    servicer = decode_pb2_grpc.DecodeWorkerServicer()
    binding = ServiceBinding(SERVICE, lambda s: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, s))
    return await start_server(ServerConfig(port=0, shutdown_grace_s=0), [binding])


async def wait_until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_pool_leases_by_outstanding_and_follows_health() -> None:
    servers = [await start_worker(), await start_worker()]
    first, second = (server.address for server in servers)
    pool = WorkerPool("decode", SERVICE, WorkerSource(addresses=(first, second)), FAST)
    await pool.start()
    try:
        assert all(c.healthy for c in pool.candidates())
        async with pool.lease() as one, pool.lease() as two:
            assert {one.address, two.address} == {first, second}
            assert [c.outstanding for c in pool.candidates()] == [1, 1]
        assert [c.outstanding for c in pool.candidates()] == [0, 0]
        pool.mark_failed(first)
        async with pool.lease() as lent:
            assert lent.address == second
        await servers[1].stop(0)
        await wait_until(lambda: not pool.candidates()[1].healthy)
        await wait_until(lambda: pool.candidates()[0].healthy)  # the next passing check restores it
        async with pool.lease(frozenset({first})) as lent:
            assert lent.address == first
    finally:
        await pool.close()
        await servers[0].stop(0)


class SlowHealth(health_pb2_grpc.HealthServicer):
    """A health service that answers SERVING, after `delay_s` (a worker busy decoding)."""

    def __init__(self) -> None:
        self.delay_s = 0.0
        self.checks = 0

    async def Check(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.checks += 1
        await asyncio.sleep(self.delay_s)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def test_a_slow_worker_stays_healthy_until_it_misses_several_checks_in_a_row() -> None:
    health = SlowHealth()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = DiscoveryConfig(health_interval_s=0.05, health_timeout_s=0.1, resolve_interval_s=60,
                             unhealthy_after_timeouts=3)
    pool = WorkerPool("decode", SERVICE, WorkerSource(addresses=(f"127.0.0.1:{port}",)), config)
    try:
        await pool.refresh()
        assert pool.candidates()[0].healthy
        health.delay_s = 0.3  # every check now times out
        for _ in range(2):  # two misses in a row: still lent out
            await pool.refresh()
            assert pool.candidates()[0].healthy
        await pool.refresh()  # the third: unhealthy
        assert not pool.candidates()[0].healthy
        health.delay_s = 0.0
        await pool.refresh()  # one answer in time restores it, and resets the count
        assert pool.candidates()[0].healthy
        health.delay_s = 0.3
        await pool.refresh()
        assert pool.candidates()[0].healthy
        assert health.checks == 6
    finally:
        await pool.close()
        await server.stop(0)
    with pytest.raises(ValueError, match="unhealthy_after_timeouts"):
        DiscoveryConfig(unhealthy_after_timeouts=0)


async def test_pool_without_healthy_workers_raises_unavailable_saying_what_each_answered() -> None:
    gone, refusing = await start_worker(), await start_worker()
    await gone.stop(0)
    await refusing.health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    pool = WorkerPool("decode", SERVICE, WorkerSource(addresses=(gone.address, refusing.address)), FAST)
    await pool.start()
    try:
        with pytest.raises(NoHealthyWorker) as caught:
            async with pool.lease():
                pass
        message = str(caught.value)
        assert message.startswith(f"no healthy decode worker among {gone.address},{refusing.address} (")
        assert f"{gone.address} UNAVAILABLE: " in message and f"{refusing.address} NOT_SERVING" in message
    finally:
        await pool.close()
        await refusing.stop(0)


async def test_dns_source_is_re_resolved() -> None:
    servers = [await start_worker(), await start_worker()]
    answers: list[list[str]] = [[servers[0].address]]

    async def resolver(host: str, port: int) -> Sequence[str]:
        assert (host, port) == ("decode.test", 50063)
        return answers[-1]

    pool = WorkerPool("decode", SERVICE, WorkerSource.parse("dns:///decode.test:50063"), FAST, resolver=resolver)
    await pool.start()
    try:
        assert [c.address for c in pool.candidates()] == [servers[0].address]
        answers.append([servers[1].address, servers[0].address])
        await wait_until(lambda: {c.address for c in pool.candidates() if c.healthy} == {s.address for s in servers})
        answers.append([servers[1].address])
        await wait_until(lambda: [c.address for c in pool.candidates()] == [servers[1].address])
    finally:
        await pool.close()
        for server in servers:
            await server.stop(0)


def test_pick_skips_workers_at_their_cap() -> None:
    workers = [Candidate("a", True, 2, 1), Candidate("b", True, 1, 5), Candidate("c", False, 0, 0)]
    assert pick(workers, max_outstanding=2) == "b"
    assert pick(workers, frozenset({"b"}), max_outstanding=2) == "b"  # avoided, but the only one with room
    assert pick(workers, max_outstanding=1) is None


async def test_waiters_take_turns_in_order_and_give_up_at_their_deadline() -> None:
    free = [0]

    def take() -> str | None:
        if free[0]:
            free[0] -= 1
            return "slot"
        return None

    counts: list[int] = []
    queue: WaitQueue[str] = WaitQueue(max_waiting=2, on_waiting=counts.append)
    served: list[str] = []

    async def waiter(name: str) -> None:
        await queue.take(take, 5.0, lambda: "all busy")
        served.append(name)

    first = asyncio.ensure_future(waiter("first"))
    await wait_until(lambda: queue.waiting == 1)
    second = asyncio.ensure_future(waiter("second"))
    await wait_until(lambda: queue.waiting == 2)
    with pytest.raises(WorkersBusy, match="2 requests are already waiting"):
        await queue.take(take, 5.0, lambda: "all busy")
    free[0] = 1  # one slot: the first waiter gets it, the second keeps waiting
    queue.notify()
    await asyncio.wait_for(first, 5)
    assert served == ["first"] and queue.waiting == 1
    free[0] = 1
    queue.notify()
    await asyncio.wait_for(second, 5)
    assert served == ["first", "second"] and queue.waiting == 0
    started = time.monotonic()
    with pytest.raises(WorkersBusy, match="all busy for the 0.2 s"):
        await queue.take(take, 0.2, lambda: "all busy")
    assert 0.2 <= time.monotonic() - started < 2.0
    assert queue.waiting == 0
    assert counts == [1, 2, 1, 0, 1, 0]  # the gauge saw every change, ending at 0


async def test_a_cancelled_waiter_leaves_and_passes_its_turn_on() -> None:
    free = [0]
    queue: WaitQueue[int] = WaitQueue(max_waiting=4)

    def take() -> int | None:
        if free[0]:
            free[0] -= 1
            return 1
        return None

    leaving = asyncio.ensure_future(queue.take(take, 5.0, lambda: "busy"))
    await wait_until(lambda: queue.waiting == 1)
    staying = asyncio.ensure_future(queue.take(take, 5.0, lambda: "busy"))
    await wait_until(lambda: queue.waiting == 2)
    free[0] = 1
    queue.notify()  # wakes the first waiter, which is cancelled before it runs
    leaving.cancel()
    assert await asyncio.wait_for(staying, 5) == 1
    assert leaving.cancelled() and queue.waiting == 0


async def test_a_pool_lease_waits_for_room_then_for_no_healthy_worker() -> None:
    server = await start_worker()
    pool = WorkerPool("prefill", SERVICE, WorkerSource(addresses=(server.address,)), FAST, max_outstanding=1)
    await pool.start()
    try:
        async with pool.lease() as held:
            waiting = asyncio.ensure_future(_lease_address(pool, 5.0))
            await wait_until(lambda: pool.waiting == 1)
            with pytest.raises(WorkersBusy, match="1 healthy prefill workers had 1 requests outstanding"):
                async with pool.lease(wait_s=0.1):
                    pass
        assert await asyncio.wait_for(waiting, 5) == held.address  # its turn came when the first left
        async with pool.lease():
            waiting = asyncio.ensure_future(_lease_address(pool, 5.0))
            await wait_until(lambda: pool.waiting == 1)
            await server.stop(0)  # the only worker goes: the waiter hears so, not a timeout
            with pytest.raises(NoHealthyWorker):
                await asyncio.wait_for(waiting, 5)
    finally:
        await pool.close()


async def _lease_address(pool: WorkerPool, wait_s: float) -> str:
    async with pool.lease(wait_s=wait_s) as endpoint:
        return endpoint.address
