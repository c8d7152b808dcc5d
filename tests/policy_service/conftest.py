"""Fixtures: a real policy service per test (own key prefix) on the shared `redis_server`,
typed clients, and small valid manifests from the kvpolicy core."""

from __future__ import annotations

from collections.abc import AsyncIterator

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
from services.redis_embedded import EmbeddedRedis


@pytest.fixture
async def policy_server(redis_server: EmbeddedRedis) -> AsyncIterator[PolicyServer]:
    server = await PolicyServer.start(service_config(redis_server.url, end_retention_ms=300))
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
