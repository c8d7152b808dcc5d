"""Failover without loss (issue 21): a mutation is acknowledged only once a replica has it
(WAIT on the connection that wrote it), a replica that cannot confirm in time makes the call
fail UNAVAILABLE instead of acknowledging it, and after the master of a slot is SIGKILLed and
a replica promoted, every acknowledged state reads back whole."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis
from policy_helpers import service_config

from policy_service.failover import failover_drill, publication
from policy_service.server import PolicyServer
from policy_service.store import KeySchema
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import (
    PolicyClient,
    PolicyClientConfig,
    PolicyUnavailable,
)
from services.redis_cluster import EmbeddedRedisCluster
from services.redis_embedded import EmbeddedRedis, EmbeddedRedisConfig


@contextlib.contextmanager
def stopped(process_id: int | None) -> Iterator[None]:
    """The process paused (SIGSTOP) for the block: a replica that cannot acknowledge."""
    assert process_id is not None
    os.kill(process_id, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process_id, signal.SIGCONT)


@pytest.fixture
def master_and_replica() -> Iterator[tuple[EmbeddedRedis, EmbeddedRedis]]:
    with EmbeddedRedis() as master:
        replica = EmbeddedRedis(EmbeddedRedisConfig(password=master.password, extra_config=(
            f"replicaof 127.0.0.1 {master.port}", f'masterauth "{master.password}"')))
        with replica:
            deadline = time.monotonic() + 10
            with redis.Redis.from_url(replica.url, decode_responses=True) as direct:
                while direct.info("replication").get("master_link_status") != "up":
                    assert time.monotonic() < deadline, "replica never linked to its master"
                    time.sleep(0.05)
            yield master, replica


async def test_a_write_no_replica_confirms_is_unavailable_never_acknowledged(
    master_and_replica: tuple[EmbeddedRedis, EmbeddedRedis],
    manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    master, replica = master_and_replica
    server = await PolicyServer.start(service_config(master.url, redis_wait_timeout_ms=50))
    try:
        assert server.recovery.store.scripts.durability.replicas == 1  # the default: it has one
        config = PolicyClientConfig(server.address, timeout_s=1.0, max_attempts=2)
        async with PolicyClient(config) as client:
            sha = (await client.register_manifest(manifests["snapkv"].canonical_json())).ref.sha256
            fence = await client.begin_request("lagging")
            await client.publish_state(publication("lagging", fence.request_generation, 1, sha))
            with stopped(replica.pid), pytest.raises(PolicyUnavailable, match="replicas confirmed"):
                await client.publish_state(publication("lagging", fence.request_generation, 2, sha))
            # Its retry is safe: the publish is found already there, and now waits for the
            # earlier, unconfirmed write. The same for an end.
            again = await client.publish_state(publication("lagging", fence.request_generation, 2, sha))
            assert again.already_published and again.fence.state_generation == 2
            with stopped(replica.pid), pytest.raises(PolicyUnavailable, match="replicas confirmed"):
                await client.end_request("lagging", fence.request_generation)
            assert (await client.end_request("lagging", fence.request_generation)).ended
            with stopped(replica.pid), pytest.raises(PolicyUnavailable):
                await client.end_request("lagging", fence.request_generation)  # 'already' waits too
        keys = KeySchema(server.config.key_prefix)
        with redis.Redis.from_url(replica.url, decode_responses=True) as direct:
            held = direct.hgetall(keys.request("lagging"))
        assert (held["state_generation"], held["phase"]) == ("2", "ended")
    finally:
        await server.stop(0)


@pytest.fixture
def own_cluster() -> Iterator[EmbeddedRedisCluster]:
    """A cluster of its own: the test kills one of its masters."""
    with EmbeddedRedisCluster() as cluster:
        yield cluster


@pytest.mark.slow
async def test_every_acknowledged_state_survives_a_master_killed_mid_publish(
    own_cluster: EmbeddedRedisCluster, manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    server = await PolicyServer.start(service_config(own_cluster.url))
    try:
        assert server.recovery.store.scripts.durability.replicas == 1  # the default: it has them
        result = await failover_drill(own_cluster, server.address, server.config.key_prefix,
                                      manifests["snapkv"].canonical_json(), publishers=8, before_kill=10)
    finally:
        await server.stop(0)
    print(f"failover drill: {result}")
    # Nothing acknowledged missing, nothing half-written, nothing acknowledged while the
    # promoted master had no replica to confirm it; acknowledgements resumed once it had.
    assert result.lossless, result
    assert result.acknowledged >= 10 * 8 and result.read_back == result.acknowledged
    assert result.resumed >= 3 * 8 and result.retries > 0
