"""The failover drill: publish through a real policy service on a Redis Cluster, SIGKILL the
master of the requests' slots mid-publish, let its replica take over, and read every
acknowledged state back from the promoted replica (what `kvrelay bench policy --scale`
reports and tests/policy_service/test_policy_failover.py asserts).

Publishers each advance one request (all of whose slots one master owns), retrying a state
the service answered UNAVAILABLE (safe: a publish of the same state is idempotent). Once the
replica serves the slots, the read-back happens before anything else can write: the killed
node is then restarted (it rejoins as the new master's replica, so acknowledgements resume)
and the publishers must get more states acknowledged, then everything is read back again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from policy_service.config import plain_redis_url
from policy_service.store import KeySchema
from services.policy import (
    Phase,
    PolicyClient,
    PolicyClientConfig,
    PolicyUnavailable,
    StatePublication,
)
from services.redis_cluster import EmbeddedRedisCluster
from services.redis_embedded import EmbeddedRedis


@dataclass(frozen=True)
class FailoverResult:
    """`acknowledged`: states the service acknowledged before the master died, all of which
    `read_back` from the promoted replica whole unless `missing` / `torn` say otherwise;
    `acknowledged_while_unreplicated`: acknowledgements while the promoted master had no
    replica (must be 0); `resumed`: acknowledgements after the old master rejoined."""

    requests: int
    acknowledged: int
    read_back: int
    missing: int
    torn: int
    acknowledged_while_unreplicated: int
    resumed: int
    retries: int
    failover_s: float

    @property
    def lossless(self) -> bool:
        return self.read_back == self.acknowledged and not (self.missing or self.torn
                                                            or self.acknowledged_while_unreplicated)


def receipt(request_id: str, state: int) -> str:
    return hashlib.sha256(f"{request_id}:{state}".encode()).hexdigest()


def publication(request_id: str, generation: int, state: int, sha: str) -> StatePublication:
    return StatePublication(request_id, generation, state - 1, state, state, receipt(request_id, state),
                            sha, Phase.PREFILLED)


class Publisher:
    """Publishes successive states of one request; a state counts once acknowledged."""

    def __init__(self, client: PolicyClient, request_id: str, generation: int, sha: str) -> None:
        self.client, self.request_id, self.generation, self.sha = client, request_id, generation, sha
        self.acknowledged = 0
        self.retries = 0

    async def run(self, until: asyncio.Event, deadline: float) -> None:
        while not until.is_set() and time.monotonic() < deadline:
            state = self.acknowledged + 1
            try:
                await self.client.publish_state(publication(self.request_id, self.generation, state, self.sha))
            except PolicyUnavailable:
                self.retries += 1
                await asyncio.sleep(0.05)
                continue
            self.acknowledged = state


@contextlib.contextmanager
def cluster_client(cluster: EmbeddedRedisCluster, startup: EmbeddedRedis) -> Iterator[redis.RedisCluster]:
    client = redis.RedisCluster.from_url(plain_redis_url(cluster.url_via(startup)), decode_responses=True)
    try:
        yield client
    finally:
        client.close()


def ids_on_one_master(direct: redis.RedisCluster, keys: KeySchema, count: int) -> tuple[list[str], int]:
    """`count` request ids whose slots one master owns, and that master's port."""
    owner = {f"failover-{i}": direct.get_node_from_key(keys.request(f"failover-{i}")).port for i in range(200)}
    port = Counter(owner.values()).most_common(1)[0][0]
    return [rid for rid, p in owner.items() if p == port][:count], int(port)


def promoted(cluster: EmbeddedRedisCluster, survivor: EmbeddedRedis, key: str, old_port: int) -> bool:
    """Whether a node other than the killed one now serves `key` as master."""
    with contextlib.suppress(redis.RedisError, redis.exceptions.RedisClusterException), \
            cluster_client(cluster, survivor) as client:
        node = client.get_node_from_key(key)
        return bool(node.port != old_port and client.ping(target_nodes=node))
    return False


def read_back(direct: redis.RedisCluster, keys: KeySchema, publisher: Publisher, sha: str) -> tuple[bool, bool]:
    """(missing, torn) for one request as Redis holds it: missing if a state it acknowledged
    is not there (at most the one unacknowledged publish in flight more is allowed), torn if
    its fields are not all of one publish."""
    held = direct.hgetall(keys.request(publisher.request_id))
    if not held:
        return True, False
    state = int(held["state_generation"])
    missing = not publisher.acknowledged <= state <= publisher.acknowledged + 1
    fields = (int(held["cache_generation"]), held["receipt_digest"], held["manifest_sha"], held["phase"])
    return missing, fields != (state, receipt(publisher.request_id, state), sha, "prefilled")


async def until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"failover drill: {what} not reached in time")
        await asyncio.sleep(0.02)


async def failover_drill(cluster: EmbeddedRedisCluster, service_address: str, key_prefix: str,
                         manifest_json: bytes, publishers: int = 8, before_kill: int = 10,
                         timeout_s: float = 30.0) -> FailoverResult:
    """Run the drill against the policy service at `service_address` (on `cluster`, with
    `key_prefix`); kills and restarts one of `cluster`'s masters."""
    keys = KeySchema(key_prefix)
    with cluster_client(cluster, cluster.nodes[0]) as direct:
        ids, port = ids_on_one_master(direct, keys, publishers)
    victim = next(node for node in cluster.nodes if node.port == port)
    survivor = next(node for node in cluster.nodes if node.running and node is not victim)
    deadline = time.monotonic() + timeout_s
    async with PolicyClient(PolicyClientConfig(service_address, timeout_s=2.0)) as client:
        sha = (await client.register_manifest(manifest_json)).ref.sha256
        runs = [Publisher(client, f.request_id, f.request_generation, sha)
                for f in [await client.begin_request(rid) for rid in ids]]
        done = asyncio.Event()
        tasks = [asyncio.create_task(p.run(done, deadline)) for p in runs]
        try:
            await until(lambda: sum(p.acknowledged for p in runs) >= before_kill * len(runs), deadline, "first acks")
            killed = time.monotonic()
            victim.kill()  # SIGKILL mid-publish: no shutdown, no last word to its replica
            await until(lambda: promoted(cluster, survivor, keys.request(ids[0]), port), deadline, "promotion")
            failover_s = time.monotonic() - killed
            acknowledged = [p.acknowledged for p in runs]
            with cluster_client(cluster, survivor) as after:
                checks = [read_back(after, keys, p, sha) for p in runs]
            unreplicated = sum(p.acknowledged for p in runs) - sum(acknowledged)
            victim.start()  # same port and node id: rejoins as the new master's replica
            await until(lambda: all(p.acknowledged >= a + 3 for p, a in zip(runs, acknowledged, strict=True)),
                        deadline, "acknowledgements after the old master rejoined")
        finally:
            done.set()
            await asyncio.gather(*tasks)
    with cluster_client(cluster, survivor) as final:
        final_checks = [read_back(final, keys, p, sha) for p in runs]
    missing = sum(m for m, _ in checks + final_checks)
    torn = sum(t for _, t in checks + final_checks)
    return FailoverResult(
        requests=len(runs), acknowledged=sum(acknowledged),
        read_back=sum(a for a, (m, t) in zip(acknowledged, checks, strict=True) if not (m or t)),
        missing=missing, torn=torn, acknowledged_while_unreplicated=unreplicated,
        resumed=sum(p.acknowledged for p in runs) - sum(acknowledged),
        retries=sum(p.retries for p in runs), failover_s=failover_s,
    )
