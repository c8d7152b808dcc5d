"""`kvrelay calibrate` and the HeadKV profile path: scores per head (shape, range, determinism),
a model with one head built to copy the needle's code ranks it first, the profile file round
trip, and the prefill stages use the profile a HeadKV manifest names by digest, or refuse with
FAILED_PRECONDITION naming `selection.allocation.headkv_profile_sha256`."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from eval_helpers import COPY_HEAD, COPY_LAYER, needle_prompt_ids
from typer.testing import CliRunner

from kvrelay.cli import app
from services.demo import needle
from services.evaluation.calibrate import CalibrationConfig, calibrate
from services.evaluation.generation import compressed_generate
from services.kvpolicy.allocation import profile_sha256
from services.kvpolicy.compress import allocate
from services.kvpolicy.head_profile import (
    PROFILE_FILE,
    HeadProfile,
    HeadProfileUnavailable,
    checkpoint_sha256,
    load_profile,
    profile_tensor,
    save_profile,
)
from services.kvpolicy.manifest import (
    AllocationMethod,
    AllocationSpec,
    BudgetScope,
    KVVisibilityPolicyManifest,
    default_manifests,
)
from services.model import LoadedModel, load
from services.rpc.errors import status_for

SMALL = CalibrationConfig(context_lengths=(96, 160), prompts=3, placements=(needle.Placement.END,))
NO_DIGEST = "0" * 64
FIELD = "selection.allocation.headkv_profile_sha256"


def headkv_manifest(model: LoadedModel, digest: str) -> KVVisibilityPolicyManifest:
    """The default SnapKV manifest (25%, window 8) with HeadKV budgets from profile `digest`."""
    snapkv = default_manifests(model.tensor_contract, budget_fraction=0.25,
                               observation_window=8)["snapkv"]
    allocation = AllocationSpec(AllocationMethod.HEADKV, beta=1.2, headkv_profile_sha256=digest)
    assert snapkv.selection.budget is not None
    budget = dataclasses.replace(snapkv.selection.budget, scope=BudgetScope.GLOBAL)
    selection = dataclasses.replace(snapkv.selection, allocation=allocation, budget=budget)
    return dataclasses.replace(snapkv, name="snapkv-headkv", policy_manifest_id="snapkv-headkv@1",
                               selection=selection)


@pytest.fixture(scope="module")
def copy_model(copy_checkpoint: Path) -> LoadedModel:
    return load(copy_checkpoint, "cpu", "float32")


@pytest.fixture(scope="module")
def copy_profile(copy_model: LoadedModel) -> HeadProfile:
    config = dataclasses.replace(SMALL, distractors=0)  # the code is the only number in the prompt
    return calibrate(copy_model, config, NO_DIGEST)


def test_scores_have_the_profile_shape_and_range_and_repeat_for_a_seed(
    needle_model: LoadedModel,
) -> None:
    profile = calibrate(needle_model, SMALL, NO_DIGEST)
    layers, q_heads, kv_heads = (needle_model.config.num_layers, needle_model.config.num_q_heads,
                                 needle_model.config.num_kv_heads)
    assert profile.query_head.shape == (layers, q_heads)
    assert profile.kv_head.shape == (layers, kv_heads)
    for tensor in (profile.kv_head, profile.query_head):
        assert tensor.dtype == torch.float32 and bool(torch.isfinite(tensor).all())
        assert bool((tensor >= 0).all()) and bool((tensor <= 1).all())
    # A K/V head's score is the mean of its query group (q_to_kv_head_map = 0, 0, 1, 1).
    group_mean = profile.query_head.view(layers, kv_heads, q_heads // kv_heads).mean(-1)
    torch.testing.assert_close(profile.kv_head, group_mean)
    again = calibrate(needle_model, SMALL, NO_DIGEST)
    assert profile.sha256 == again.sha256 and torch.equal(profile.query_head, again.query_head)
    assert profile.provenance.prompts == SMALL.total_prompts == 6


def test_the_head_built_to_copy_gets_the_top_score(copy_profile: HeadProfile) -> None:
    scores = copy_profile.query_head.clone()  # [L, H_q]
    assert float(scores[COPY_LAYER, COPY_HEAD]) == 1.0
    scores[COPY_LAYER, COPY_HEAD] = 0.0
    assert float(scores.max()) < 0.5  # every other head: its top attention rarely hits the code
    assert int(copy_profile.kv_head.argmax()) == COPY_LAYER * 2 + COPY_HEAD // 2


def test_profile_file_round_trip_and_checkpoint_digest(
    copy_checkpoint: Path, copy_profile: HeadProfile, tmp_path: Path
) -> None:
    directory = Path(shutil.copytree(copy_checkpoint, tmp_path / "ckpt"))
    assert checkpoint_sha256(directory) == checkpoint_sha256(copy_checkpoint)
    assert load_profile(directory) is None
    save_profile(directory, copy_profile)
    stored = load_profile(directory)
    assert stored is not None and stored.provenance == copy_profile.provenance
    assert stored.sha256 == copy_profile.sha256 == profile_sha256(copy_profile.kv_head)
    assert torch.equal(stored.tensor_for(copy_profile.query_head_sha256), copy_profile.query_head)
    assert stored.tensor_for("f" * 64) is None
    (directory / "config.json").write_text((directory / "config.json").read_text() + " ")
    assert checkpoint_sha256(directory) != checkpoint_sha256(copy_checkpoint)


def test_calibrate_command_writes_the_profile_and_prints_its_digest(
    copy_checkpoint: Path, tmp_path: Path
) -> None:
    directory = Path(shutil.copytree(copy_checkpoint, tmp_path / "ckpt"))
    command = ["calibrate", str(directory), "--lengths", "200", "--prompts", "2"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    profile = load_profile(directory)
    assert profile is not None and (directory / PROFILE_FILE).is_file()
    assert profile_sha256(profile.kv_head) in result.output.replace("\n", "")
    assert profile.provenance.checkpoint_sha256 == checkpoint_sha256(directory)


def test_headkv_manifest_allocates_by_the_profile_in_compressed_generate(
    copy_model: LoadedModel, copy_profile: HeadProfile
) -> None:
    manifest = headkv_manifest(copy_model, copy_profile.sha256)
    ids = needle_prompt_ids(copy_model, 160, seed=4)
    result = compressed_generate(copy_model, manifest, ids, 3, head_profile=copy_profile)
    budgets = result.prompt.selection.budgets
    assert budgets is not None and len(result.tokens) == 3
    layer, owner = divmod(int(copy_profile.kv_head.argmax()), 2)
    flat = [b for row in budgets for b in row]
    assert budgets[layer][owner] == max(flat) > min(flat)  # the copying owner gets the most rows


def test_wrong_or_missing_profile_is_refused_naming_the_field(
    copy_model: LoadedModel, copy_profile: HeadProfile
) -> None:
    scores = torch.rand(2, 2, 152)  # [L, H_kv, T - W_obs] for a 160-token prompt
    right = headkv_manifest(copy_model, copy_profile.sha256)
    assert allocate(right, 160, scores, profile_tensor(right, copy_profile)) is not None
    wrong = headkv_manifest(copy_model, "ab" * 32)
    for manifest, profile in ((wrong, copy_profile), (right, None)):
        with pytest.raises(HeadProfileUnavailable) as error:
            allocate(manifest, 160, scores, profile_tensor(manifest, profile))
        assert error.value.field == FIELD
        status = status_for(error.value)
        assert status is not None and status.code is grpc.StatusCode.FAILED_PRECONDITION
        assert status.detail.field == FIELD
    snapkv = default_manifests(copy_model.tensor_contract, observation_window=8)["snapkv"]
    assert allocate(snapkv, 160, scores, profile_tensor(snapkv, None)) is not None  # other methods need no profile
