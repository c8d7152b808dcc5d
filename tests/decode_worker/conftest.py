"""Fixtures: the tiny model's default manifests (registered by the shared `policy` fixture of
tests/conftest.py, next to `redis_server` and `policy_server`), and a decode worker serving
the tiny model on loopback (random gRPC and rendezvous ports)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import torch
from decode_helpers import KV_BUDGET_BYTES, LEASE_TIMEOUT_S, OBS_WINDOW, save_tiny_llama

from decode_worker.config import DecodeWorkerConfig, SchedulerConfig
from decode_worker.server import DecodeWorker
from policy_service.server import PolicyServer
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, default_manifests
from services.model import LoadedModel, load
from services.rpc.kvrelay.v1 import decode_pb2_grpc
from services.rpc.server import ServerConfig
from services.transfer import PairGroupConfig


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
