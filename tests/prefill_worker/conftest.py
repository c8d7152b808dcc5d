"""Fixtures: a tiny random checkpoint loaded once, manifests for its tensor contract, a real
redis-server per module, a real policy service per test (own key prefix) with the manifests
registered, and a recording decode worker on real gRPC + gloo."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from prefill_helpers import (
    RecordingDecodeWorker,
    start_recording_decode_worker,
    write_tiny_checkpoint,
)

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, default_manifests
from services.model import LoadedModel, load
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import EmbeddedRedis
from services.rpc.server import RpcServer, ServerConfig

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def model(checkpoint: Path) -> LoadedModel:
    return load(checkpoint, "cpu", "float32")


@pytest.fixture(scope="session")
def manifests(model: LoadedModel) -> dict[str, KVVisibilityPolicyManifest]:
    """Small windows so a 64-token prompt really gets compressed."""
    return default_manifests(
        model.tensor_contract, budget_fraction=0.25, observation_window=8, recent_window=24, sinks=2
    )


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


@pytest.fixture
async def decode_worker() -> AsyncIterator[tuple[RecordingDecodeWorker, RpcServer]]:
    servicer, server = await start_recording_decode_worker()
    yield servicer, server
    await server.stop(0)
    servicer.receiver.close()
