"""Fixtures: a real redis-server per module, a real policy service per test (own key prefix)
with the tiny model's default manifests registered, and a decode worker serving the tiny
model on loopback (random gRPC and rendezvous ports)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from decode_helpers import KV_BUDGET_BYTES, LEASE_TIMEOUT_S, OBS_WINDOW, save_tiny_llama

from decode_worker.config import DecodeWorkerConfig, SchedulerConfig
from decode_worker.server import DecodeWorker
from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, default_manifests
from services.model import LoadedModel, load
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import EmbeddedRedis
from services.rpc.kvrelay.v1 import decode_pb2_grpc
from services.rpc.server import ServerConfig
from services.transfer import PairGroupConfig


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(directory, seed=5)
    return directory


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load(checkpoint)


@pytest.fixture(scope="module")
def manifests(loaded: LoadedModel) -> dict[str, KVVisibilityPolicyManifest]:
    return default_manifests(loaded.tensor_contract, observation_window=OBS_WINDOW)


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


def worker_config(checkpoint: Path, policy_address: str, **overrides: object) -> DecodeWorkerConfig:
    values: dict[str, object] = {
        "checkpoint": checkpoint,
        "policy_address": policy_address,
        "worker_id": f"decode-{uuid.uuid4().hex[:6]}",
        "server": ServerConfig(port=0, shutdown_grace_s=0.5),
        "transfer": PairGroupConfig(store_port=0),
        "scheduler": SchedulerConfig(max_batch=4, kv_budget_bytes=KV_BUDGET_BYTES),
        "max_new_tokens": 100_000,
        "transfer_timeout_s": 10.0,
        "lease_timeout_s": LEASE_TIMEOUT_S,
        "policy_timeout_s": 5.0,
        "receive_threads": 4,
    }
    values.update(overrides)
    return DecodeWorkerConfig(**values)  # type: ignore[arg-type]


@pytest.fixture
async def worker(checkpoint: Path, loaded: LoadedModel, policy_server: PolicyServer) -> AsyncIterator[DecodeWorker]:
    started = await DecodeWorker.start(worker_config(checkpoint, policy_server.address), loaded)
    yield started
    await started.stop(0)


@pytest.fixture
async def stub(worker: DecodeWorker) -> AsyncIterator[decode_pb2_grpc.DecodeWorkerStub]:
    async with grpc.aio.insecure_channel(worker.address) as channel:
        yield decode_pb2_grpc.DecodeWorkerStub(channel)
