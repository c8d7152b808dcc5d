"""Fixtures: a tiny random checkpoint loaded once, manifests for its tensor contract (registered
by the shared `policy` fixture of tests/conftest.py, next to `redis_server` and
`policy_server`), and a recording decode worker on real gRPC + gloo."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from prefill_helpers import (
    RecordingDecodeWorker,
    start_recording_decode_worker,
    write_tiny_checkpoint,
)

from services.kvpolicy.manifest import KVVisibilityPolicyManifest, default_manifests
from services.model import LoadedModel, load
from services.rpc.server import RpcServer

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


@pytest.fixture
async def decode_worker() -> AsyncIterator[tuple[RecordingDecodeWorker, RpcServer]]:
    servicer, server = await start_recording_decode_worker()
    yield servicer, server
    await server.stop(0)
    servicer.receiver.close()
