"""Fixtures shared across the test tree: a real redis-server per module, a real policy service
per test (own key prefix), and a policy client with the directory's `manifests` registered.

Directories that need a differently configured policy service override `policy_server` in
their own conftest; `policy` needs a `manifests` fixture from the directory that uses it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import EmbeddedRedis
from services.rpc.server import ServerConfig


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
async def policy_server(redis_server: EmbeddedRedis) -> AsyncIterator[PolicyServer]:
    config = PolicyServiceConfig(
        server=ServerConfig(port=0, shutdown_grace_s=0.5),
        redis_url=redis_server.url,
        key_prefix=f"t{uuid.uuid4().hex[:12]}:",
    )
    server = await PolicyServer.start(config)
    yield server
    await server.stop(0)


@pytest.fixture
async def policy(
    policy_server: PolicyServer, manifests: dict[str, KVVisibilityPolicyManifest]
) -> AsyncIterator[PolicyClient]:
    async with PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0)) as client:
        for manifest in manifests.values():
            await client.register_manifest(manifest.canonical_json())
        yield client
