"""Registration cannot break a policy for everyone: out-of-range integers are refused before
anything is stored, listing survives an undecodable entry already in Redis, validation is cheap
whatever the manifest says, and a manifest the deployment cannot run is refused (issue 15)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import pytest
import redis
from policy_helpers import service_config

from policy_service.server import PolicyServer
from policy_service.store import KeySchema
from services.kvpolicy.fit import Deployment
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    cache_abi_sha256,
)
from services.policy import (
    ManifestDoesNotFit,
    ManifestInvalid,
    NotFound,
    PolicyClient,
    PolicyClientConfig,
)
from services.policy.manifests import ManifestCache
from services.redis_embedded import EmbeddedRedis
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import policy_pb2, policy_pb2_grpc
from services.telemetry.metrics import POLICY_UNDECODABLE_ENTRIES

SERVED = TensorContract(2, 4, 2, 8, DType.BFLOAT16, DType.BFLOAT16)  # the `manifests` fixture's
OTHER = TensorContract(4, 8, 2, 16, DType.BFLOAT16, DType.BFLOAT16)


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def keyspace(url: str, prefix: str) -> dict[str, object]:
    with redis.Redis.from_url(url, decode_responses=True) as r:
        return {key: r.hgetall(key) if r.type(key) == "hash" else r.get(key) for key in r.scan_iter(f"{prefix}*")}


@pytest.fixture
async def fitted_server(redis_server: EmbeddedRedis) -> AsyncIterator[PolicyServer]:
    """A policy service that knows what its workers run: two deployments."""
    config = service_config(redis_server.url, deployments=(Deployment(SERVED), Deployment(OTHER)))
    server = await PolicyServer.start(config)
    yield server
    await server.stop(0)


async def test_generation_past_2_53_is_refused_and_nothing_is_stored(
    client: PolicyClient, policy_server: PolicyServer, redis_server: EmbeddedRedis,
    manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    await client.register_manifest(manifests["snapkv"].canonical_json())
    before = keyspace(redis_server.url, policy_server.config.key_prefix)
    data = {**manifests["snapkv"].to_dict(), "policy_generation": 2**63, "policy_manifest_id": "snapkv@huge"}
    with pytest.raises(ManifestInvalid) as caught:
        await client.register_manifest(json.dumps(data))
    assert caught.value.field == "policy_generation"
    assert keyspace(redis_server.url, policy_server.config.key_prefix) == before
    assert [r.policy_generation for r in await client.list_manifests("snapkv")] == [1]


async def test_listing_skips_undecodable_entries_logs_each_once_and_counts_them(
    client: PolicyClient, policy_server: PolicyServer, redis_server: EmbeddedRedis,
    manifests: dict[str, KVVisibilityPolicyManifest], caplog: pytest.LogCaptureFixture,
) -> None:
    good = manifests["snapkv"]
    await client.register_manifest(good.canonical_json())
    keys = KeySchema(policy_server.config.key_prefix)
    # What an older build, a hand edit or another tool could have left in Redis.
    with redis.Redis.from_url(redis_server.url, decode_responses=True) as r:
        r.hset(keys.manifest_index(), mapping={"a" * 64: f"{2**63}:snapkv", "b" * 64: "x:snapkv",
                                               "c" * 64: "no-colon", "NOT-A-SHA": "3:snapkv",
                                               "d" * 64: "4:Bad Name"})
        r.hset(keys.policy("snapkv"), mapping={str(2**63): "a" * 64, "two": "b" * 64})
    counted = POLICY_UNDECODABLE_ENTRIES._value.get()
    with caplog.at_level(logging.ERROR, logger="policy_service.store"):
        for _ in range(2):
            assert [r.sha256 for r in await client.list_manifests()] == [good.sha256]
            assert [r.sha256 for r in await client.list_manifests("snapkv")] == [good.sha256]
    skipped = [rec for rec in caplog.records if "undecodable manifest entry" in rec.getMessage()]
    assert len(skipped) == 7, [rec.getMessage() for rec in skipped]  # 5 + 2 entries, once each
    assert all(len(rec.getMessage()) < 600 for rec in skipped)
    assert POLICY_UNDECODABLE_ENTRIES._value.get() - counted == 14  # every skip, both listings
    # A gateway naming an unknown policy lists every name for its message: still typed.
    with pytest.raises(NotFound, match="registered: snapkv"):
        await ManifestCache(client).ref("no-such-policy")


async def test_a_huge_manifest_is_refused_in_milliseconds_without_memory_or_stalls(
    client: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    """Issue 15: num_kv_heads 10^7 with a custom map took 4.1 s, +1.1 GB and an 89 MB message."""
    data = manifests["snapkv"].to_dict()
    # Each query head reads its own K/V head, and the other 10^7 - 4 are read by none.
    data["tensor"] |= {"num_kv_heads": 10**7, "gqa_grouping": "custom", "q_to_kv_head_map": [0, 1, 2, 3]}
    payload = json.dumps(data)
    await client.list_manifests()  # warm the channel
    baseline = rss_mb()
    listing_s: list[float] = []

    async def list_meanwhile() -> None:
        for _ in range(20):
            started = time.perf_counter()
            await client.list_manifests()
            listing_s.append(time.perf_counter() - started)

    lister = asyncio.create_task(list_meanwhile())
    for _ in range(5):
        started = time.perf_counter()
        with pytest.raises(ManifestInvalid) as caught:
            await client.register_manifest(payload)
        assert time.perf_counter() - started < 1.0
        assert caught.value.field == "tensor.num_kv_heads" and len(str(caught.value)) < 300
    await asyncio.wait_for(lister, 10)
    assert rss_mb() - baseline < 50
    assert max(listing_s) < 2.0, listing_s


async def test_a_manifest_no_deployment_can_run_is_refused_naming_the_field(
    fitted_server: PolicyServer, redis_server: EmbeddedRedis, manifests: dict[str, KVVisibilityPolicyManifest],
) -> None:
    snapkv = manifests["snapkv"]
    unfit = replace(snapkv, policy_generation=2, policy_manifest_id="snapkv@2",
                    tensor=replace(snapkv.tensor, head_dim=16))
    async with PolicyClient(PolicyClientConfig(fitted_server.address, timeout_s=5.0)) as client:
        await client.register_manifest(snapkv.canonical_json())
        before = keyspace(redis_server.url, fitted_server.config.key_prefix)
        with pytest.raises(ManifestDoesNotFit) as caught:
            await client.register_manifest(unfit.canonical_json())
        assert caught.value.field == "tensor.head_dim"
        assert "is 16 in the manifest, 8 in the served model" in caught.value.message
        assert keyspace(redis_server.url, fitted_server.config.key_prefix) == before
        # A generation that fits one of the deployments is registered.
        other_tensor = {**snapkv.to_dict()["tensor"], "num_layers": 4, "num_q_heads": 8, "head_dim": 16,
                        "q_to_kv_head_map": [0, 0, 0, 0, 1, 1, 1, 1]}
        other = KVVisibilityPolicyManifest.from_dict(
            {**snapkv.to_dict(), "policy_generation": 3, "policy_manifest_id": "snapkv@3", "tensor": other_tensor,
             "logical_cache_abi_sha256": cache_abi_sha256(TensorContract(**other_tensor))})
        assert (await client.register_manifest(other.canonical_json())).created
        assert [r.policy_generation for r in await client.list_manifests("snapkv")] == [1, 3]
    async with grpc.aio.insecure_channel(fitted_server.address) as channel:
        request = policy_pb2.RegisterManifestRequest(manifest_json=unfit.canonical_json())
        with pytest.raises(grpc.aio.AioRpcError) as raw:
            await policy_pb2_grpc.PolicyServiceStub(channel).RegisterManifest(request, timeout=5)
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(raw.value)
    assert detail is not None and detail.field == "tensor.head_dim"
