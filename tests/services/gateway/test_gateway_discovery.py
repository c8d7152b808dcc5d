"""Worker discovery: parsing static and DNS sources, least-outstanding picking, and a pool
that follows real gRPC health services and re-resolved DNS answers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

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


async def test_pool_without_healthy_workers_raises_unavailable() -> None:
    server = await start_worker()
    address = server.address
    await server.stop(0)
    pool = WorkerPool("decode", SERVICE, WorkerSource(addresses=(address,)), FAST)
    await pool.start()
    try:
        with pytest.raises(NoHealthyWorker, match="no healthy decode worker"):
            async with pool.lease():
                pass
    finally:
        await pool.close()


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
