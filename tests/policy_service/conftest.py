"""Fixtures: a real policy service per test (own key prefix) on the shared `redis_server` or,
where a module parametrizes `redis_url` with "cluster" (indirect), on one local Redis Cluster
(three masters, three replicas) started once per session; typed clients, and small valid
manifests from the kvpolicy core. The service also listens for framed sessions
(`session_address`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from policy_helpers import service_config

from policy_service.server import PolicyServer
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_cluster import EmbeddedRedisCluster


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedRedisCluster]:
    with EmbeddedRedisCluster() as cluster:
        yield cluster


@pytest.fixture
def redis_url(request: pytest.FixtureRequest) -> str:
    """The policy service's Redis: "single" (default) or "cluster" (`indirect` parameter)."""
    backend = getattr(request, "param", "single")
    if backend == "cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    assert backend == "single", backend
    return str(request.getfixturevalue("redis_server").url)


@pytest.fixture
async def policy_server(redis_url: str) -> AsyncIterator[PolicyServer]:
    server = await PolicyServer.start(service_config(redis_url, end_retention_ms=300, session_port=0))
    yield server
    await server.stop(0)


@pytest.fixture
async def client(policy_server: PolicyServer) -> AsyncIterator[PolicyClient]:
    async with PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0)) as policy_client:
        yield policy_client


@pytest.fixture(scope="session")
def manifests() -> dict[str, KVVisibilityPolicyManifest]:
    return default_manifests(TensorContract(2, 4, 2, 8, DType.BFLOAT16, DType.BFLOAT16))


@pytest.fixture
async def snapkv_sha(client: PolicyClient, manifests: dict[str, KVVisibilityPolicyManifest]) -> str:
    registration = await client.register_manifest(manifests["snapkv"].canonical_json())
    return registration.ref.sha256
