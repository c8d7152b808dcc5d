"""Redis Sentinel (issue 21, "failover without loss"): the policy service on a
`redis+sentinel://` URL, served by redis-py's Sentinel client, acknowledges a publish only once
a replica has it; after the master is SIGKILLed and the sentinels promote a replica, every
acknowledged state reads back whole through the policy service. Also: the URL's parsing
errors name the field and never show the password, and clear start-up errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
from policy_helpers import service_config
from redis.asyncio import Redis

from policy_service.config import (
    PolicyServiceConfig,
    RedisUrlInvalid,
    SentinelUrl,
    parse_sentinel_url,
    redact_url,
)
from policy_service.failover import Publisher, receipt
from policy_service.sentinel import BlockingSentinelConnectionPool
from policy_service.server import PolicyServer, PolicyStartupError
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import Fence, Phase, PolicyClient, PolicyClientConfig, PolicyUnavailable
from services.redis_sentinel import EmbeddedSentinelDeployment

REQUESTS = 8
BEFORE_KILL = 5  # states acknowledged per request before the master is killed
AFTER_PROMOTION = 3  # and after the promotion, through the new master


def test_sentinel_urls_parse_into_sentinels_master_and_database() -> None:
    url = "rediss+sentinel://kvr:p%40ss@s1:26380,[::1],s3/mymaster/2?ssl_ca_certs=/ca.pem"
    assert parse_sentinel_url(url) == SentinelUrl(
        sentinels=(("s1", 26380), ("::1", 26379), ("s3", 26379)), master_name="mymaster", db=2,
        username="kvr", password="p@ss", tls=True, query="ssl_ca_certs=/ca.pem")
    assert parse_sentinel_url("redis+sentinel://h/m") == SentinelUrl((("h", 26379),), "m")
    assert PolicyServiceConfig(redis_url="redis+sentinel://:pw@h:1,h:2/m/0").redis_url is not None


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://:s3cret@h:1", "master-name"),
        ("redis+sentinel://:s3cret@h:1/", "master-name"),
        ("redis+sentinel://:s3cret@h:1/m/0/extra", "master-name"),
        ("redis+sentinel://:s3cret@h:1/bad%20name", "master-name"),
        ("redis+sentinel://:s3cret@h:1/m/x", "database"),
        ("redis+sentinel://:s3cret@h:0/m", "port"),
        ("redis+sentinel://:s3cret@h:99999/m", "port"),
        ("redis+sentinel://:s3cret@h:1,,h:2/m", "no valid host"),
        ("redis+sentinel://:s3cret@/m", "no valid host"),
        ("redis+sentinel://:s3cret@[::1/m", "does not parse"),
        ("redis+sentinel://:s3cret@[::1]x/m", "malformed"),
        ("redis+sentinels://:s3cret@h:1/m", "scheme"),
    ],
)
def test_a_bad_sentinel_url_names_the_field_and_hides_the_password(url: str, why: str) -> None:
    with pytest.raises(RedisUrlInvalid, match=why) as caught:
        PolicyServiceConfig(redis_url=url)
    assert str(caught.value).startswith("redis_url: ") and caught.value.field == "redis_url"
    assert "s3cret" not in str(caught.value)


def test_sentinel_passwords_never_reach_logs() -> None:
    hosts = "s1:26379,[::1]:26380/mymaster/0"
    url = f"redis+sentinel://kvr:s3cret@{hosts}?password=other&ssl_ca_certs=/ca.pem"
    assert redact_url(url) == f"redis+sentinel://kvr:***@{hosts}?password=***&ssl_ca_certs=/ca.pem"


@pytest.fixture(scope="module")
def deployment() -> Iterator[EmbeddedSentinelDeployment]:
    """One master, two replicas, three sentinels; the failover test kills the master."""
    with EmbeddedSentinelDeployment() as sentinels:
        yield sentinels


async def test_a_plain_url_at_a_sentinel_or_an_unknown_master_fails_fast(
    deployment: EmbeddedSentinelDeployment,
) -> None:
    at_sentinel = f"redis://:{deployment.password}@127.0.0.1:{deployment.sentinels[0].port}/0"
    with pytest.raises(PolicyStartupError, match="is a sentinel: use a redis\\+sentinel://"):
        await PolicyServer.start(service_config(at_sentinel))
    unknown = deployment.url.replace(f"/{deployment.config.master_name}/", "/nosuchmaster/")
    no_master = "unreachable.*No master found for 'nosuchmaster'"
    with pytest.raises(PolicyStartupError, match=no_master) as caught:
        await PolicyServer.start(service_config(unknown))
    assert deployment.password not in str(caught.value)


async def until(condition: Callable[[], bool], deadline: float, what: str) -> None:
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        await asyncio.sleep(0.02)


async def read_fence(client: PolicyClient, request_id: str, deadline: float) -> Fence:
    """The request's fence through the policy service, retried while it is UNAVAILABLE (its
    connections are still finding the promoted master)."""
    while True:
        try:
            return await client.get_fence(request_id)
        except PolicyUnavailable:
            assert time.monotonic() < deadline, f"{request_id}: the service stayed UNAVAILABLE"
            await asyncio.sleep(0.05)


def whole(fence: Fence, sha: str) -> bool:
    """Every field of the state is from one publish (`policy_service.failover.publication`)."""
    state = fence.state_generation
    return (fence.cache_generation, fence.receipt_digest, fence.manifest_sha256, fence.phase) == (
        state, receipt(fence.request_id, state), sha, Phase.PREFILLED)


@pytest.mark.slow
async def test_every_acknowledged_state_reads_back_after_the_sentinels_promote_a_replica(
    deployment: EmbeddedSentinelDeployment, manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    server = await PolicyServer.start(service_config(deployment.url))
    deadline = time.monotonic() + 45
    try:
        # The default where the master has replicas: acknowledged once one of them has it.
        assert server.recovery.store.scripts.durability.replicas == 1
        assert isinstance(server.redis, Redis)  # redis-py's sentinel pool, the single client's limits
        pool = server.redis.connection_pool
        assert isinstance(pool, BlockingSentinelConnectionPool) and pool.service_name == "kvrelay"
        assert (pool.max_connections, pool.timeout) == (server.config.redis_max_connections,
                                                        server.config.redis_timeout_s)
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=2.0)) as client:
            sha = (await client.register_manifest(manifests["snapkv"].canonical_json())).ref.sha256
            fences = [await client.begin_request(f"sentinel-{i}") for i in range(REQUESTS)]
            runs = [Publisher(client, f.request_id, f.request_generation, sha) for f in fences]
            done = asyncio.Event()
            tasks = [asyncio.create_task(run.run(done, deadline)) for run in runs]
            try:
                await until(lambda: min(r.acknowledged for r in runs) >= BEFORE_KILL, deadline,
                            "first acknowledgements")
                killed = await asyncio.to_thread(deployment.kill_master)  # mid-publish
                killed_at, before_kill = time.monotonic(), sum(r.acknowledged for r in runs)
                await asyncio.to_thread(deployment.wait_promoted, killed.port, 20.0)
                failover_s = time.monotonic() - killed_at
                # Read back at once, publishers still running: each request holds at least
                # what was acknowledged before its read, whole.
                acknowledged = [r.acknowledged for r in runs]
                held = [await read_fence(client, r.request_id, deadline) for r in runs]
                assert all(whole(fence, sha) for fence in held), held
                lost = [(f.request_id, f.state_generation, a)
                        for f, a in zip(held, acknowledged, strict=True) if f.state_generation < a]
                assert not lost, f"acknowledged states missing after the failover: {lost}"
                await until(lambda: all(r.acknowledged >= a + AFTER_PROMOTION
                                        for r, a in zip(runs, acknowledged, strict=True)),
                            deadline, "acknowledgements through the promoted master")
            finally:
                done.set()
                await asyncio.gather(*tasks)  # a StaleGeneration (a state lost) fails the test
            final = [await read_fence(client, r.request_id, deadline) for r in runs]
    finally:
        await server.stop(0)
    # Publishers stopped: each request holds its last acknowledged state, or the one
    # publish after it that landed without being acknowledged; whole either way.
    for fence, run in zip(final, runs, strict=True):
        assert run.acknowledged <= fence.state_generation <= run.acknowledged + 1, fence
        assert whole(fence, sha), fence
    read_back = sum(run.acknowledged for run in runs)
    print(f"sentinel failover: {read_back} acknowledged states read back through the policy "
          f"service ({before_kill} before the kill, {sum(acknowledged)} at promotion), failover "
          f"{failover_s:.2f} s, {sum(r.retries for r in runs)} UNAVAILABLE retries")
    assert before_kill >= BEFORE_KILL * REQUESTS
    assert read_back >= sum(acknowledged) + AFTER_PROMOTION * REQUESTS
