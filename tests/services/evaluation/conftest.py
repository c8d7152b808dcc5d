"""Fixtures: a tiny random needle-language checkpoint loaded once, default manifests for it with
small windows (so 100-300 token prompts are really compressed), and a checkpoint with a head
built to copy the needle's code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eval_helpers import copy_head_weights, write_needle_checkpoint

from services.kvpolicy.manifest import KVVisibilityPolicyManifest, default_manifests
from services.model import LoadedModel, load

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def needle_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_needle_checkpoint(tmp_path_factory.mktemp("needle-llama"), seed=3)


@pytest.fixture(scope="session")
def needle_model(needle_checkpoint: Path) -> LoadedModel:
    return load(needle_checkpoint, "cpu", "float32")


@pytest.fixture(scope="session")
def small_manifests(needle_model: LoadedModel) -> dict[str, KVVisibilityPolicyManifest]:
    return default_manifests(
        needle_model.tensor_contract, budget_fraction=0.25, observation_window=8,
        recent_window=24, sinks=2,
    )


@pytest.fixture(scope="session")
def copy_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("copy-llama")
    return write_needle_checkpoint(directory, weights=copy_head_weights(5))
