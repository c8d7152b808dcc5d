"""The policy store on Redis Cluster (issue 21, item 1): every script's keys in one hash slot,
request generations strictly increasing for a request id across key expiry and data loss
without a global counter, manifests read through any node, owner binding kept, and clear
errors for a URL that does not match the server. Runs on one redis-server and on a local
three-master cluster (`redis_url` parametrized)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from pathlib import Path

import pytest
import redis
from policy_helpers import BACKENDS, digest, service_config
from redis.crc import key_slot

from policy_service.config import PolicyServiceConfig, is_cluster_url, plain_redis_url
from policy_service.server import PolicyServer, PolicyStartupError
from policy_service.store import DEFAULT_HIGH_WATER_MARGIN_MS, KeySchema, PolicyStore
from services import redis_cluster as cluster_nodes
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import (
    NotFound,
    Phase,
    PolicyClient,
    PolicyClientConfig,
    StatePublication,
)
from services.policy.errors import PolicyPermissionDenied
from services.redis_cluster import EmbeddedClusterConfig, EmbeddedRedisCluster
from services.redis_embedded import EmbeddedRedis

AHEAD_US = 10**10  # a high-water mark ~2.8 h ahead of Redis's clock (a clock that stepped back)


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


@pytest.mark.parametrize("prefix", ["kvr:", "t0123abcd:", "a.b-c/"])
def test_every_script_touches_one_hash_slot(prefix: str) -> None:
    keys = KeySchema(prefix)
    registry = {keys.manifest("a" * 64), keys.manifest("b" * 64), keys.policy("snapkv"),
                keys.manifest_index(), keys.epoch()}
    assert len({slot(k) for k in registry}) == 1  # register_manifest, epoch, manifest reads
    ids = [f"req-{i}" for i in range(64)] + ["a:b@c/d.e-f", "0", "x" * 128]
    for request_id in ids:  # begin_request (2 keys); publish, fence, end use the first
        assert len({slot(k) for k in keys.begin_keys(request_id)}) == 1, request_id
        assert keys.begin_keys(request_id)[0] == keys.request(request_id)
    # Requests spread over the slots (no hot key), independent of the prefix.
    assert len({slot(keys.request(r)) for r in ids}) > 60
    assert slot(keys.request("req-1")) == slot(KeySchema("other:").request("req-1"))


def test_prefixes_with_braces_are_refused_and_cluster_urls_accepted() -> None:
    for prefix in ("kvr{", "}kvr:", ""):
        with pytest.raises(ValueError, match="prefix"):
            KeySchema(prefix)
        with pytest.raises(ValueError, match="key_prefix"):
            PolicyServiceConfig(key_prefix=prefix)
    url = "rediss+cluster://u:p@redis-0.redis:6379/0"
    assert PolicyServiceConfig(redis_url=url).redis_url == url
    assert is_cluster_url(url) and not is_cluster_url("rediss://redis:6379/0")
    assert plain_redis_url(url) == "rediss://u:p@redis-0.redis:6379/0"


def raw_client(url: str) -> redis.Redis | redis.RedisCluster:
    """A synchronous client of the test's Redis (cluster-aware when the URL says so)."""
    if is_cluster_url(url):
        return redis.RedisCluster.from_url(plain_redis_url(url), decode_responses=True)
    return redis.Redis.from_url(url, decode_responses=True)


@pytest.fixture
def direct(redis_url: str) -> Iterator[redis.Redis | redis.RedisCluster]:
    client = raw_client(redis_url)
    try:
        yield client
    finally:
        client.close()


async def expired(store: PolicyStore, request_id: str, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            await store.get_fence(request_id)
        except NotFound:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{request_id} still present after {timeout_s} s")


@pytest.mark.parametrize("redis_url", BACKENDS, indirect=True)
async def test_request_generation_increases_across_key_expiry_and_loss(
    policy_server: PolicyServer, direct: redis.Redis | redis.RedisCluster
) -> None:
    keys = KeySchema(policy_server.config.key_prefix)

    def fresh() -> PolicyStore:
        """A store that never handed out a generation (caller's floor 1): only what Redis
        holds, and its clock, can keep the next generation above the last."""
        return PolicyStore(policy_server.redis, keys)

    generations = []
    for _ in range(3):  # cases 2/3: begun, expired, begun again
        generations.append((await fresh().begin_request("reused", 50)).request_generation)
        await expired(fresh(), "reused")
    assert generations == sorted(set(generations)), generations

    # Case 2: the last generation ran ahead of Redis's clock (as after a backward step): the
    # high-water key, which outlives the request key, keeps the next one above.
    ahead = generations[-1] + AHEAD_US
    direct.set(keys.request_high_water("reused"), str(ahead), px=60_000)
    assert not direct.exists(keys.request("reused"))
    after = await fresh().begin_request("reused", 50)
    assert after.request_generation == ahead + 1
    # Its expiry instant is on Redis's clock: the generation's own instant plus the margin.
    seconds, micros = direct.time()
    now_ms = seconds * 1000 + micros // 1000
    expected_ttl = after.request_generation // 1000 + DEFAULT_HIGH_WATER_MARGIN_MS - now_ms
    assert abs(direct.pttl(keys.request_high_water("reused")) - expected_ttl) < 5_000
    # Case 1: the live request key (its generation ahead too) is read by the same script.
    service: PolicyStore = policy_server.recovery.store
    live = await service.begin_request("reused", 50)
    assert live.request_generation == ahead + 2

    # Case 4: Redis lost both keys while its clock is behind the last generation: the
    # caller's floor (the service's own high-water mark) keeps the next one above.
    direct.delete(keys.request("reused"), keys.request_high_water("reused"))
    lost = await service.begin_request("reused", 50)
    assert lost.request_generation == ahead + 3


@pytest.mark.parametrize("redis_url", BACKENDS, indirect=True)
async def test_a_request_id_stays_bound_to_the_identity_that_began_it(
    policy_server: PolicyServer,
) -> None:
    store: PolicyStore = policy_server.recovery.store
    fence = await store.begin_request("owned", 60_000, owner="alice")
    with pytest.raises(PolicyPermissionDenied) as denied:
        await store.begin_request("owned", 60_000, owner="mallory")
    assert denied.value.field == "request_id"
    with pytest.raises(PolicyPermissionDenied):
        await store.end_request("owned", fence.request_generation, 1_000, owner="mallory")
    again = await store.begin_request("owned", 60_000, owner="alice")
    assert again.request_generation > fence.request_generation
    assert (await store.end_request("owned", again.request_generation, 1_000, owner="alice")).ended


@pytest.fixture
async def two_services(
    redis_cluster: EmbeddedRedisCluster,
) -> AsyncIterator[tuple[PolicyServer, PolicyServer]]:
    """Two policy services on the cluster, one key prefix, different startup nodes."""
    first = await PolicyServer.start(service_config(redis_cluster.url))
    try:
        other_node = redis_cluster.url_via(redis_cluster.nodes[-1])
        second = await PolicyServer.start(service_config(other_node, key_prefix=first.config.key_prefix))
        try:
            yield first, second
        finally:
            await second.stop(0)
    finally:
        await first.stop(0)


async def test_manifests_registered_through_one_node_serve_requests_on_every_master(
    two_services: tuple[PolicyServer, PolicyServer], redis_cluster: EmbeddedRedisCluster,
    manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    first, second = two_services
    async with PolicyClient(PolicyClientConfig(first.address)) as one, \
            PolicyClient(PolicyClientConfig(second.address)) as two:
        sha = (await one.register_manifest(manifests["snapkv"].canonical_json())).ref.sha256
        assert (await two.get_manifest(sha)).ref.sha256 == sha
        assert sha in {ref.sha256 for ref in await two.list_manifests()}
        for i in range(24):
            fence = await two.begin_request(f"spread-{i}")
            published = await two.publish_state(StatePublication(
                request_id=fence.request_id, request_generation=fence.request_generation,
                parent_state_generation=0, state_generation=1, cache_generation=1,
                receipt_digest=digest(i), manifest_sha256=sha, phase=Phase.PREFILLED,
            ))
            assert published.fence.manifest_sha256 == sha
    prefix = first.config.key_prefix
    per_master = []
    for node in redis_cluster.masters():
        with redis_cluster.client(node) as master:
            per_master.append(sum(1 for _ in master.scan_iter(match=f"{prefix}req:*", count=1000)))
    assert len(per_master) == 3 and all(per_master) and sum(per_master) == 24, per_master


async def test_a_url_that_does_not_match_the_server_is_refused_clearly(
    redis_server: EmbeddedRedis, redis_cluster: EmbeddedRedisCluster
) -> None:
    single_as_cluster = redis_server.url.replace("redis://", "redis+cluster://", 1)
    with pytest.raises(PolicyStartupError, match="cluster") as failure:
        await PolicyServer.start(service_config(single_as_cluster))
    assert redis_server.password not in str(failure.value)
    cluster_as_single = redis_cluster.url.replace("redis+cluster://", "redis://", 1)
    with pytest.raises(PolicyStartupError, match="redis\\+cluster://") as failure:
        await PolicyServer.start(service_config(cluster_as_single))
    assert redis_cluster.password not in str(failure.value)


def test_the_local_cluster_has_three_masters_each_with_a_replica(
    redis_cluster: EmbeddedRedisCluster,
) -> None:
    masters = redis_cluster.masters()
    assert len(masters) == 3 and len(redis_cluster.nodes) == 6
    with redis_cluster.client(masters[0]) as node:
        info = node.cluster("info")
        assert (info["cluster_state"], int(info["cluster_slots_assigned"])) == ("ok", 16384)
        assert int(info["cluster_known_nodes"]) == 6 and int(info["cluster_size"]) == 3
    for master in masters:
        with redis_cluster.client(master) as node:
            assert int(node.info("replication")["connected_slaves"]) == 1


def test_cluster_ports_stay_out_of_the_ephemeral_range_with_their_bus_ports() -> None:
    """Port-0 binds and source ports come from the ephemeral range: a node's pair drawn there
    could be taken by another server of the same run before the node binds it (a CI run lost
    a whole cluster that way)."""
    default = cluster_nodes.pair_candidates((32768, 60999))
    assert default[0] == 10000 and default[-1] == 22767 and len(default) == 12768
    assert cluster_nodes.ephemeral_range() == tuple(
        int(part) for part in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    low, high = cluster_nodes.ephemeral_range()
    for port in cluster_nodes.pair_candidates((low, high)):
        assert not low <= port <= high and not low <= port + 10000 <= high
    # A range that leaves no pair outside it: draw anywhere, the node start retries.
    assert len(cluster_nodes.pair_candidates((1024, 65535))) == 65536 - 10000 - 10000


def test_a_node_that_loses_its_port_between_the_draw_and_the_bind_starts_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race made real: the first port drawn is held by a listening socket the draw's check
    does not see, so redis-server fails to bind it; the node starts on the next draw."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    held = holder.getsockname()[1]
    draws: list[int] = []
    real_draw = cluster_nodes.cluster_port

    def racing_draw(taken: Collection[int], candidates: Sequence[int]) -> int:
        draws.append(held if not draws else real_draw(taken, candidates))
        return draws[-1]

    monkeypatch.setattr(cluster_nodes, "cluster_port", racing_draw)
    cluster = EmbeddedRedisCluster(EmbeddedClusterConfig(replicas_per_master=0))
    try:
        cluster.start()
        ports = [node.port for node in cluster.nodes]
        assert draws[0] == held and held not in ports and len(set(ports)) == 3
        assert draws[1:] == ports
        with cluster.client(cluster.nodes[0]) as node:
            assert node.cluster("info")["cluster_state"] == "ok"
    finally:
        cluster.close()
        holder.close()
