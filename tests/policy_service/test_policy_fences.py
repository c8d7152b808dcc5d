"""Generation fences through the real gRPC server and a real redis-server, and again on a real
three-master Redis Cluster (`redis_url` parametrized)."""

from __future__ import annotations

import asyncio
import time

import pytest
from policy_helpers import BACKENDS, digest

from policy_service.server import PolicyServer
from services.policy import (
    NotFound,
    Phase,
    PolicyClient,
    PolicyClientConfig,
    RequestEnded,
    StaleGeneration,
    StatePublication,
)

pytestmark = pytest.mark.parametrize("redis_url", BACKENDS, indirect=True)
PUBLISHERS = 64
ROUNDS = 16


def successor(request_id: str, request_generation: int, parent: int, manifest_sha: str,
              tag: object = "", cache_generation: int | None = None) -> StatePublication:
    return StatePublication(
        request_id=request_id,
        request_generation=request_generation,
        parent_state_generation=parent,
        state_generation=parent + 1,
        cache_generation=parent * 10 if cache_generation is None else cache_generation,
        receipt_digest=digest(request_id, request_generation, parent + 1, tag),
        manifest_sha256=manifest_sha,
        phase=Phase.PREFILLED if parent == 0 else Phase.RECALLED,
        prefill_worker=f"prefill-{tag}",
    )


async def test_race_of_64_publishers_has_one_winner_per_round(policy_server: PolicyServer, snapkv_sha: str) -> None:
    clients = [PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=20.0)) for _ in range(PUBLISHERS)]
    try:
        fence = await clients[0].begin_request("race")
        for parent in range(ROUNDS):
            attempts = [
                c.publish_state(successor("race", fence.request_generation, parent, snapkv_sha, tag=i))
                for i, c in enumerate(clients)
            ]
            outcomes = await asyncio.gather(*attempts, return_exceptions=True)
            winners = [o for o in outcomes if not isinstance(o, BaseException)]
            stale = [o for o in outcomes if isinstance(o, StaleGeneration)]
            assert len(winners) == 1 and len(stale) == PUBLISHERS - 1, outcomes
            won = winners[0].fence
            # The winner may see already_published=True: when its first reply is lost
            # (UNAVAILABLE under load) the client retries and the identical successor is
            # answered idempotently. Exactly one digest still wins.
            assert won.state_generation == parent + 1
            assert all(s.current.receipt_digest == won.receipt_digest for s in stale)
            assert all(s.current.state_generation == parent + 1 for s in stale)
            assert all(s.field == "parent_state_generation" for s in stale)
            current = await clients[1].get_fence("race")
            assert (current.state_generation, current.receipt_digest) == (parent + 1, won.receipt_digest)
            assert current.prefill_worker == won.prefill_worker
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_begin_request_fences_out_the_older_generation(client: PolicyClient, snapkv_sha: str) -> None:
    first = await client.begin_request("fenced")
    published = await client.publish_state(successor("fenced", first.request_generation, 0, snapkv_sha))
    second = await client.begin_request("fenced")
    assert second.request_generation > first.request_generation
    assert second.state_generation == 0 and second.phase is Phase.BEGUN
    with pytest.raises(StaleGeneration) as stale:
        await client.publish_state(successor("fenced", first.request_generation, 1, snapkv_sha))
    assert stale.value.field == "request_generation"
    assert stale.value.current.request_generation == second.request_generation
    assert (await client.get_fence("fenced")).request_generation == second.request_generation
    assert published.fence.request_generation == first.request_generation


async def test_republishing_the_same_successor_is_idempotent(client: PolicyClient, snapkv_sha: str) -> None:
    fence = await client.begin_request("idem")
    publication = successor("idem", fence.request_generation, 0, snapkv_sha, tag="a")
    first = await client.publish_state(publication)
    again = await client.publish_state(publication)
    assert not first.already_published and again.already_published
    assert again.fence.state_generation == 1 and again.fence.receipt_digest == publication.receipt_digest
    rival = successor("idem", fence.request_generation, 0, snapkv_sha, tag="b")
    with pytest.raises(StaleGeneration) as stale:
        await client.publish_state(rival)
    assert stale.value.current.receipt_digest == publication.receipt_digest


async def test_chain_of_successors_and_cache_generation_fence(client: PolicyClient, snapkv_sha: str) -> None:
    fence = await client.begin_request("chain")
    g = fence.request_generation
    for parent in range(3):
        result = await client.publish_state(successor("chain", g, parent, snapkv_sha, cache_generation=100 + parent))
        assert result.fence.state_generation == parent + 1
    with pytest.raises(StaleGeneration) as stale:
        await client.publish_state(successor("chain", g, 3, snapkv_sha, cache_generation=50))
    assert stale.value.field == "cache_generation" and stale.value.current.cache_generation == 102
    current = await client.get_fence("chain")
    assert (current.state_generation, current.cache_generation, current.phase) == (3, 102, Phase.RECALLED)


async def test_publish_needs_a_live_request_and_a_registered_manifest(client: PolicyClient, snapkv_sha: str) -> None:
    with pytest.raises(NotFound) as missing:
        await client.publish_state(successor("never-begun", 1, 0, snapkv_sha))
    assert missing.value.field == "request_id"
    fence = await client.begin_request("no-manifest")
    with pytest.raises(NotFound) as missing:
        await client.publish_state(successor("no-manifest", fence.request_generation, 0, digest("unregistered")))
    assert missing.value.field == "manifest_sha256"
    assert (await client.get_fence("no-manifest")).state_generation == 0


async def wait_until_gone(client: PolicyClient, request_id: str, timeout_s: float) -> float:
    """Seconds until GetFence says NOT_FOUND; fails after `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            await client.get_fence(request_id)
        except NotFound:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} still present after {timeout_s}s")


async def test_lease_expiry_removes_an_abandoned_request(client: PolicyClient, snapkv_sha: str) -> None:
    fence = await client.begin_request("abandoned", lease_ms=200)
    assert 0 < fence.lease_remaining_ms <= 200
    await wait_until_gone(client, "abandoned", timeout_s=3.0)
    with pytest.raises(NotFound):
        await client.publish_state(successor("abandoned", fence.request_generation, 0, snapkv_sha))
    reborn = await client.begin_request("abandoned")
    assert reborn.request_generation > fence.request_generation


async def test_publish_renews_the_lease(client: PolicyClient, snapkv_sha: str) -> None:
    fence = await client.begin_request("renewed", lease_ms=300)
    result = await client.publish_state(successor("renewed", fence.request_generation, 0, snapkv_sha), lease_ms=60_000)
    assert result.fence.lease_remaining_ms > 30_000
    await asyncio.sleep(0.4)
    assert (await client.get_fence("renewed")).state_generation == 1


async def test_end_request_marks_done_fences_and_releases(client: PolicyClient, snapkv_sha: str) -> None:
    fence = await client.begin_request("ending")
    g = fence.request_generation
    await client.publish_state(successor("ending", g, 0, snapkv_sha))
    with pytest.raises(StaleGeneration) as stale:
        await client.end_request("ending", g + 1)
    assert stale.value.field == "request_generation"
    ended = await client.end_request("ending", g)
    assert ended.ended and ended.state_generation == 1
    assert 0 < ended.lease_remaining_ms <= 300  # the fixture's end retention
    assert (await client.end_request("ending", g)).ended  # idempotent
    with pytest.raises(RequestEnded) as late:
        await client.publish_state(successor("ending", g, 1, snapkv_sha))
    assert late.value.current.ended and late.value.current.state_generation == 1
    await wait_until_gone(client, "ending", timeout_s=3.0)


async def test_fence_admits_only_the_current_receipt(client: PolicyClient, snapkv_sha: str) -> None:
    fence = await client.begin_request("admit")
    publication = successor("admit", fence.request_generation, 0, snapkv_sha)
    current = (await client.publish_state(publication)).fence
    assert current.admits(fence.request_generation, 1, publication.receipt_digest)
    assert not current.admits(fence.request_generation, 1, digest("other"))
    assert not current.admits(fence.request_generation + 1, 1, publication.receipt_digest)
    assert not current.admits(fence.request_generation, 0, publication.receipt_digest)
