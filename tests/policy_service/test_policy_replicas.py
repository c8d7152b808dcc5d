"""Replicated policy services (issue 21): two stateless `kvrelay serve policy` processes on one
Redis behind one comma-separated target (gRPC round robin). The policy clients the gateway and
the workers build run whole request lifecycles; once both replicas have served (the clients'
first Session streams all open on whichever replica connected first, and are replaced within
a second by streams round robin spreads), one replica is SIGKILLed: no call fails."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator

import pytest
from policy_helpers import digest

from decode_worker.config import DecodeWorkerConfig
from policy_service.processes import PolicyProcess, policy_service_processes, spawn, wait_serving
from services.gateway.config import GatewayConfig
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import Phase, PolicyClient, PolicyClientConfig, StatePublication
from services.policy.client import grpc_target
from services.policy.session import SETTLE_S
from services.redis_embedded import EmbeddedRedis
from services.security.transport import TransportSecurity

LOOPS = 6
BEFORE_KILL = 24
AFTER_KILL = 48
DEADLINE_S = 60.0


def test_several_targets_become_one_round_robin_target() -> None:
    assert grpc_target("127.0.0.1:1") == "127.0.0.1:1"
    assert grpc_target("dns:///policy.kvrelay:50061") == "dns:///policy.kvrelay:50061"
    assert grpc_target("127.0.0.1:1, 127.0.0.2:2") == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert grpc_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    for bad in ("policy-0:1,policy-1:1", "127.0.0.1:1,[::1]:2", "127.0.0.1:1,"):
        with pytest.raises(ValueError, match="target"):
            PolicyClientConfig(bad)


def served_publishes(replica: PolicyProcess) -> float:
    """PublishState calls the replica answered OK, from its /metrics."""
    url = f"http://127.0.0.1:{replica.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (loopback)
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvrelay_rpc_requests_total") and "PublishState" in line and '"OK"' in line)


class Lifecycles:
    """Request lifecycles as the gateway and the workers drive them: the gateway begins, the
    prefill worker publishes PREFILLED, the decode worker reads the fence and publishes
    DECODING, the gateway ends. Any failed call is a failed request."""

    def __init__(self, gateway: PolicyClient, prefill: PolicyClient, decode: PolicyClient, sha: str) -> None:
        self.gateway, self.prefill, self.decode, self.sha = gateway, prefill, decode, sha
        self.completed = 0
        self.failures: list[BaseException] = []

    async def one(self, request_id: str) -> None:
        fence = await self.gateway.begin_request(request_id)
        g = fence.request_generation
        await self.prefill.publish_state(StatePublication(
            request_id, g, 0, 1, 1, digest(request_id, 1), self.sha, Phase.PREFILLED, prefill_worker="prefill-0"))
        current = await self.decode.get_fence(request_id)
        assert (current.state_generation, current.phase) == (1, Phase.PREFILLED)
        await self.decode.publish_state(StatePublication(
            request_id, g, 1, 2, 2, digest(request_id, 2), self.sha, Phase.DECODING, decode_worker="decode-0"))
        assert (await self.gateway.end_request(request_id, g)).ended

    async def loop(self, index: int, stop: asyncio.Event, deadline: float) -> None:
        serial = 0
        while not stop.is_set() and time.monotonic() < deadline:
            serial += 1
            try:
                await self.one(f"replicas-{index}-{serial}")
            except Exception as exc:  # noqa: BLE001 (every failure is counted and reported)
                self.failures.append(exc)
            else:
                self.completed += 1


def default_of(config: type, name: str) -> float:
    return float(next(f.default for f in dataclasses.fields(config) if f.name == name))


async def until(condition: object, deadline: float) -> None:
    assert callable(condition)
    while not condition():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def lifecycles_running(
    gateway_config: PolicyClientConfig, worker_config: PolicyClientConfig, manifest: KVVisibilityPolicyManifest,
    loops: int,
) -> AsyncIterator[tuple[Lifecycles, float]]:
    """`loops` lifecycle loops on a gateway client and two worker clients; yields them and
    their deadline; stops the loops, then closes the clients."""
    gateway, prefill, decode = PolicyClient(gateway_config), PolicyClient(worker_config), PolicyClient(worker_config)
    try:
        sha = (await gateway.register_manifest(manifest.canonical_json())).ref.sha256
        runs = Lifecycles(gateway, prefill, decode, sha)
        stop, deadline = asyncio.Event(), time.monotonic() + DEADLINE_S
        tasks = [asyncio.create_task(runs.loop(i, stop, deadline)) for i in range(loops)]
        try:
            yield runs, deadline
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        for client in (gateway, prefill, decode):
            await client.close()


async def until_served(replicas: list[PolicyProcess], runs: Lifecycles, deadline: float) -> list[float]:
    """Until every one of `replicas` has answered a PublishState (or a lifecycle failed)."""
    while True:
        served = [await asyncio.to_thread(served_publishes, r) for r in replicas]
        if runs.failures or all(served):
            return served
        assert time.monotonic() < deadline, f"not every replica served: {served}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_requests_ride_through_the_loss_of_one_policy_replica(
    redis_server: EmbeddedRedis, manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    async with policy_service_processes(redis_server.url, prefix, 2, metrics=True) as replicas:
        target = ",".join(replica.address for replica in replicas)
        # The clients as the gateway and the workers build them, with their default deadlines.
        gateway = PolicyClientConfig(target, timeout_s=default_of(GatewayConfig, "policy_timeout_s"))
        worker = PolicyClientConfig(target, timeout_s=default_of(DecodeWorkerConfig, "policy_timeout_s"))
        async with lifecycles_running(gateway, worker, manifests["snapkv"], LOOPS) as (runs, deadline):
            await until(lambda: runs.completed >= BEFORE_KILL or runs.failures, deadline)
            served = await until_served(replicas, runs, deadline)
            spread_s = time.monotonic() - (deadline - DEADLINE_S)
            replicas[0].kill()
            killed_at = runs.completed
            await until(lambda: runs.completed >= killed_at + AFTER_KILL or runs.failures, deadline)
    assert not runs.failures, [repr(f) for f in runs.failures[:3]]
    assert all(count > 0 for count in served), served  # round robin: both replicas served
    assert spread_s < 10 * SETTLE_S, f"both replicas served only after {spread_s:.1f} s"
    assert runs.completed >= BEFORE_KILL + AFTER_KILL


@pytest.mark.slow
async def test_a_replica_back_after_a_restart_gets_streams_again(
    redis_server: EmbeddedRedis, manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    """Streams that moved to the surviving replica are replaced after `session_max_age_s`, so
    the restarted one serves again (without replacement it would wait for the next failure)."""
    prefix = f"t{uuid.uuid4().hex[:12]}:"
    restarted: PolicyProcess | None = None
    async with policy_service_processes(redis_server.url, prefix, 2, metrics=True) as replicas:
        config = PolicyClientConfig(",".join(r.address for r in replicas), timeout_s=5.0, session_max_age_s=0.5)
        try:
            async with lifecycles_running(config, config, manifests["snapkv"], 2) as (runs, deadline):
                await until(lambda: runs.completed >= BEFORE_KILL or runs.failures, deadline)
                replicas[0].kill()
                killed_at = runs.completed
                await until(lambda: runs.completed >= killed_at + BEFORE_KILL or runs.failures, deadline)
                port = int(replicas[0].address.rsplit(":", 1)[1])
                restarted = spawn(redis_server.url, prefix, ("--plaintext",), True, port=port)
                await wait_serving(restarted.address, restarted.process, 30.0, TransportSecurity.local_plaintext())
                back_at = time.monotonic()
                await until_served([restarted], runs, deadline)
                back_s = time.monotonic() - back_at
        finally:
            if restarted is not None:
                restarted.stop()
    assert not runs.failures, [repr(f) for f in runs.failures[:3]]
    assert back_s < 10.0, back_s  # reconnect backoff (at most 1 s) plus a stream's age
