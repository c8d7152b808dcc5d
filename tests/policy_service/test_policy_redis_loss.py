"""Redis losing the policy service's data, or being away for a while (issue 15, items 5, 16):
health turns NOT_SERVING while Redis is unreachable, manifests come back without a restart of
anything (from memory, or from the journal of a restarted service), fences of requests lost
with Redis are answered NotFound and never matched by a later request, and ends Redis missed
land once it is back; the read-repair and replica-restore tests run on a Redis Cluster too.
(A SIGKILLed owner leaves no redis-server behind:
tests/services/test_redis_embedded.py, and under `kvrelay up` tests/e2e/test_e2e_redis_loss.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis
from policy_helpers import BACKENDS, digest, service_config

from policy_service.archive import ManifestArchive
from policy_service.config import PolicyServiceConfig, is_cluster_url, plain_redis_url
from policy_service.pending_ends import PendingEnds
from policy_service.server import PolicyServer
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import (
    NotFound,
    Phase,
    PolicyClient,
    PolicyClientConfig,
    PolicyUnavailable,
    StaleGeneration,
    StatePublication,
    StoredManifest,
)
from services.policy.types import ManifestRef
from services.redis_embedded import EmbeddedRedis, EmbeddedRedisConfig
from services.rpc.server import ServerConfig

RECOVERY_TARGET_S = 10.0  # issue 15: manifests restored and requests succeed again within 10 s
FAST = {"recovery_interval_s": 0.25, "server": ServerConfig(port=0, shutdown_grace_s=0.5)}


async def poll(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Seconds until `check()` is true; AssertionError after `timeout_s`."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not {what} after {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def first_state(fence_request: str, generation: int, sha: str) -> StatePublication:
    return StatePublication(
        request_id=fence_request, request_generation=generation, parent_state_generation=0, state_generation=1,
        cache_generation=1, receipt_digest=digest(fence_request, generation), manifest_sha256=sha,
        phase=Phase.PREFILLED, prefill_worker="prefill-0",
    )


async def register_all(client: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]) -> set[str]:
    return {(await client.register_manifest(m.canonical_json())).ref.sha256 for m in manifests.values()}


async def listed(client: PolicyClient) -> set[str]:
    return {ref.sha256 for ref in await client.list_manifests()}


async def test_a_restarted_empty_redis_gets_its_manifests_back_and_old_fences_stay_dead(
    manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    backend = EmbeddedRedis()  # no AOF: a restart loses everything
    await asyncio.to_thread(backend.start)
    server = await PolicyServer.start(service_config(backend.url, **FAST))
    client = PolicyClient(PolicyClientConfig(server.address, timeout_s=1.0, max_attempts=2))
    try:
        shas = await register_all(client, manifests)
        sha = sorted(shas)[0]
        old = await client.begin_request("in-flight")

        await asyncio.to_thread(backend.kill)
        down_s = await poll(lambda: _not_serving(client), 5.0, "NOT_SERVING while redis is down")
        await asyncio.to_thread(backend.start)  # same port and password, no data
        restored_s = await poll(lambda: _serving_with(client, shas), RECOVERY_TARGET_S, "restored")
        print(f"NOT_SERVING {down_s:.2f} s after the kill; manifests back {restored_s:.2f} s after the restart")

        with pytest.raises(NotFound) as lost:  # the in-flight request's fence went with Redis
            await client.publish_state(first_state("in-flight", old.request_generation, sha))
        assert lost.value.field == "request_id" and "lost" in lost.value.message
        new = await client.begin_request("in-flight")
        assert new.request_generation > old.request_generation  # the counter restarted above
        with pytest.raises(StaleGeneration):
            await client.publish_state(first_state("in-flight", old.request_generation, sha))
        assert (await client.publish_state(first_state("in-flight", new.request_generation, sha))).fence.state_generation == 1
        await poll(lambda: _restored_once(server), 5.0, "the loss noticed")
    finally:
        await client.close()
        await server.stop(0)
        await asyncio.to_thread(backend.close)


async def _not_serving(client: PolicyClient) -> bool:
    return await client.check_serving(timeout_s=0.5) is not None


async def _serving_with(client: PolicyClient, shas: set[str]) -> bool:
    if await client.check_serving(timeout_s=0.5) is not None:
        return False
    try:
        return await listed(client) == shas
    except PolicyUnavailable:
        return False


@pytest.mark.parametrize("redis_url", BACKENDS, indirect=True)
async def test_a_read_that_misses_an_archived_manifest_writes_it_back_at_once(
    redis_url: str, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    # A recovery loop too slow to help: the reads themselves must repair.
    config = service_config(redis_url, recovery_interval_s=60.0)
    server = await PolicyServer.start(config)
    try:
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=5.0)) as client:
            shas = await register_all(client, manifests)
            sha = sorted(shas)[0]
            fence = await client.begin_request("repair")
            wipe(redis_url, config.key_prefix, keep="req:")  # manifests gone, the request kept
            assert (await client.get_manifest(sha)).ref.sha256 == sha
            wipe(redis_url, config.key_prefix, keep="req:")
            published = await client.publish_state(first_state("repair", fence.request_generation, sha))
            assert published.fence.manifest_sha256 == sha
            wipe(redis_url, config.key_prefix, keep="req:")
            assert await listed(client) == shas
    finally:
        await server.stop(0)


async def test_a_read_racing_another_write_back_sees_what_that_one_restored(
    redis_url: str, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    # The recovery loop (or another replica) writes the manifests back between this read's
    # miss and its own write-back, which then finds nothing to create: the read must still
    # answer what Redis now holds (a CI run listed 4 of 19 names this way).
    config = service_config(redis_url, recovery_interval_s=60.0)
    server = await PolicyServer.start(config)
    store = server.recovery.store
    real_republish = store.republish

    async def republished_by_someone_else(sha256: str | None = None) -> int:
        await real_republish(sha256)
        return 0

    store.republish = republished_by_someone_else  # type: ignore[method-assign]
    try:
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=5.0)) as client:
            shas = await register_all(client, manifests)
            sha = sorted(shas)[0]
            wipe(redis_url, config.key_prefix, keep="req:")
            assert (await client.get_manifest(sha)).ref.sha256 == sha
            wipe(redis_url, config.key_prefix, keep="req:")
            assert await listed(client) == shas
    finally:
        await server.stop(0)


def wipe(url: str, prefix: str, keep: str) -> None:
    """Delete this test's keys (the shared Redis serves other prefixes too), but `prefix+keep*`,
    on every master of a cluster. (Registry keys carry the prefix inside their hash tag:
    `{prefix registry}:...`.)"""
    direct = redis.RedisCluster.from_url(plain_redis_url(url)) if is_cluster_url(url) else redis.Redis.from_url(url)
    try:
        doomed = [k for k in direct.scan_iter(f"*{prefix}*") if not k.decode().startswith(prefix + keep)]
        assert doomed
        for key in doomed:  # one at a time: the keys may live in different slots
            direct.delete(key)
    finally:
        direct.close()


@pytest.mark.parametrize("redis_url", BACKENDS, indirect=True)
async def test_a_replica_restores_what_another_replica_registered(
    redis_url: str, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    config = service_config(redis_url, **FAST)
    survivor = await PolicyServer.start(config)
    try:
        other = await PolicyServer.start(config)  # same Redis, same keys: a second replica
        try:
            async with PolicyClient(PolicyClientConfig(other.address, timeout_s=5.0)) as client:
                shas = await register_all(client, manifests)
        finally:
            await other.stop(0)
        async with PolicyClient(PolicyClientConfig(survivor.address, timeout_s=5.0)) as client:
            await poll(lambda: _archived(survivor, shas), 5.0, "mirrored from Redis")
            wipe(redis_url, config.key_prefix, keep="nothing")  # the epoch goes too
            await poll(lambda: _serving_with(client, shas), RECOVERY_TARGET_S, "restored")
            await poll(lambda: _restored_once(survivor), 5.0, "the loss noticed")  # listing repairs first
    finally:
        await survivor.stop(0)


async def _restored_once(server: PolicyServer) -> bool:
    return server.recovery.restores == 1 and server.recovery.epoch is not None


async def _archived(server: PolicyServer, shas: set[str]) -> bool:
    archive = server.recovery.store.archive
    return archive is not None and all(archive.get(sha) for sha in shas)


async def test_a_dead_embedded_redis_is_restarted_and_refilled(
    manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    server = await PolicyServer.start(PolicyServiceConfig(**FAST))  # type: ignore[arg-type]
    try:
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=1.0, max_attempts=2)) as client:
            shas = await register_all(client, manifests)
            assert server.embedded is not None and server.embedded.pid is not None
            os.kill(server.embedded.pid, signal.SIGKILL)
            recovered_s = await poll(lambda: _serving_with(client, shas), RECOVERY_TARGET_S, "restored")
            print(f"embedded redis SIGKILLed: serving with every manifest after {recovered_s:.2f} s")
            await poll(lambda: _restored_once(server), 5.0, "the loss noticed")  # reads repair first
            assert server.embedded.running
    finally:
        await server.stop(0)


async def test_a_restarted_service_reads_its_manifests_back_from_the_journal(
    tmp_path: Path, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    config = PolicyServiceConfig(manifest_journal=tmp_path / "manifests.jsonl", **FAST)  # type: ignore[arg-type]
    first = await PolicyServer.start(config)
    try:
        async with PolicyClient(PolicyClientConfig(first.address)) as client:
            shas = await register_all(client, manifests)
    finally:
        await first.stop(0)
    with open(tmp_path / "manifests.jsonl", "ab") as journal:
        journal.write(b'{"torn": ')  # a crash in the middle of an append
    second = await PolicyServer.start(config)  # a new embedded Redis: empty
    try:
        async with PolicyClient(PolicyClientConfig(second.address)) as client:
            assert await client.check_serving() is None
            assert await listed(client) == shas
    finally:
        await second.stop(0)


async def test_ends_redis_missed_land_soon_after_it_returns(tmp_path: Path) -> None:
    # Keeps its keys: "always", as "everysec" may postpone AOF writes on a slow disk.
    backend = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "aof", appendfsync="always"))
    await asyncio.to_thread(backend.start)
    server = await PolicyServer.start(service_config(backend.url, **FAST))
    client = PolicyClient(PolicyClientConfig(server.address, timeout_s=1.0, max_attempts=2))
    try:
        fences = [await client.begin_request(f"outage-{i}") for i in range(5)]
        await asyncio.to_thread(backend.kill)
        for fence in fences:
            with pytest.raises(PolicyUnavailable):
                await client.end_request(fence.request_id, fence.request_generation)
        await asyncio.to_thread(backend.start)

        async def all_ended() -> bool:
            try:
                current = [await client.get_fence(f.request_id) for f in fences]
            except PolicyUnavailable:
                return False
            return all(c.phase is Phase.ENDED for c in current)

        ended_s = await poll(all_ended, 5.0, "every request ended")
        print(f"5 ends missed during the outage: all ended {ended_s:.2f} s after redis returned")
        assert len(server.recovery.store.pending_ends or ()) == 0
        for fence in fences:
            assert (await client.get_fence(fence.request_id)).lease_remaining_ms <= server.config.end_retention_ms
    finally:
        await client.close()
        await server.stop(0)
        await asyncio.to_thread(backend.close)


def test_the_archive_keeps_each_manifest_once_and_skips_what_is_not_canonical(
    tmp_path: Path, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    journal = tmp_path / "journal.jsonl"
    archive = ManifestArchive(journal)
    snapkv = manifests["snapkv"]
    stored = StoredManifest(ManifestRef(snapkv.sha256, snapkv.name, snapkv.policy_generation), snapkv.canonical_json())
    assert archive.remember(stored) and not archive.remember(stored)
    with open(journal, "ab") as lines:
        lines.write(b'{"b": 1, "a": 2}\n' + snapkv.canonical_json().replace(b":", b": ", 1) + b"\n")
    reread = ManifestArchive(journal)
    assert reread.load() == 1 and reread.get(snapkv.sha256) == stored
    assert reread.count("snapkv") == 1 and reread.count("full") == 0


def test_pending_ends_keep_the_newest_generation_and_give_up_at_their_deadline() -> None:
    now = [0.0]
    pending = PendingEnds(deadline_s=10.0, capacity=2, clock=lambda: now[0])
    pending.add("a", 2, 100)
    pending.add("a", 1, 100)  # older: ignored
    assert [(e.request_id, e.request_generation) for e in pending.due()] == [("a", 2)]
    pending.add("b", 1, 100)
    pending.add("c", 1, 100)  # over capacity: the oldest ("a") is dropped
    assert [e.request_id for e in pending.due()] == ["b", "c"] and pending.dropped == 1
    now[0] = 10.0
    assert pending.due() == [] and pending.dropped == 3
