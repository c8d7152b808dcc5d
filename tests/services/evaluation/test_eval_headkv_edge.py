"""The HeadKV profile at the prefill worker's gRPC edge: a real prefill server loads the checkpoint
and the `headkv_profile.safetensors` beside it; a manifest naming another profile is refused
with FAILED_PRECONDITION naming `selection.allocation.headkv_profile_sha256`, while the
manifest naming the served profile gets past allocation (and fails only at the handoff to a
decode worker that does not exist, UNAVAILABLE)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from eval_helpers import needle_prompt_ids

from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import PrefillServer
from services.evaluation.calibrate import CalibrationConfig, calibrate
from services.kvpolicy.head_profile import HeadProfile, save_profile
from services.kvpolicy.manifest import (
    AllocationMethod,
    AllocationSpec,
    BudgetScope,
    KVVisibilityPolicyManifest,
    default_manifests,
)
from services.model import LoadedModel, load
from services.policy import PolicyClient
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.rpc.server import ServerConfig
from services.transfer import PairGroupConfig

pytestmark = pytest.mark.timeout(120)
UNREACHABLE_DECODE = "127.0.0.1:9"  # discard port: nothing listens


@pytest.fixture(scope="module")
def served(
    copy_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, HeadProfile]:
    """A copy of the copy-head checkpoint with its calibrated profile beside it."""
    directory = Path(shutil.copytree(copy_checkpoint, tmp_path_factory.mktemp("served") / "ckpt"))
    config = CalibrationConfig(context_lengths=(200,), prompts=2)
    profile = calibrate(load(directory), config, "0" * 64)
    save_profile(directory, profile)
    return directory, profile


def headkv(model: LoadedModel, digest: str, name: str) -> KVVisibilityPolicyManifest:
    snapkv = default_manifests(model.tensor_contract, observation_window=8)["snapkv"]
    assert snapkv.selection.budget is not None
    selection = dataclasses.replace(
        snapkv.selection,
        allocation=AllocationSpec(AllocationMethod.HEADKV, beta=1.2, headkv_profile_sha256=digest),
        budget=dataclasses.replace(snapkv.selection.budget, scope=BudgetScope.GLOBAL),
    )
    return dataclasses.replace(
        snapkv, name=name, policy_manifest_id=f"{name}@1", selection=selection
    )


@pytest.fixture(scope="module")
def manifests(served: tuple[Path, HeadProfile]) -> dict[str, KVVisibilityPolicyManifest]:
    directory, profile = served
    model = load(directory)
    return {"served": headkv(model, profile.sha256, "headkv-served"),
            "other": headkv(model, "ab" * 32, "headkv-other")}


@pytest.fixture
async def stub(
    served: tuple[Path, HeadProfile], policy: PolicyClient, policy_server: object
) -> AsyncIterator[prefill_pb2_grpc.PrefillWorkerStub]:
    config = PrefillWorkerConfig(
        checkpoint=served[0], worker_id="prefill-headkv",
        server=ServerConfig(port=0, shutdown_grace_s=0.5),
        policy_address=policy_server.address,  # type: ignore[attr-defined]
        accept_timeout_s=2.0, transfer_timeout_s=5.0, pair_groups=PairGroupConfig(max_groups=2),
    )
    server = await PrefillServer.start(config)  # loads the checkpoint and the profile beside it
    loaded_profile = server.pipeline.profile
    assert loaded_profile is not None and loaded_profile.sha256 == served[1].sha256
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield prefill_pb2_grpc.PrefillWorkerStub(channel)
    await server.stop(0)


async def call(
    stub: prefill_pb2_grpc.PrefillWorkerStub,
    policy: PolicyClient,
    manifest: KVVisibilityPolicyManifest,
    served: tuple[Path, HeadProfile],
    request_id: str,
) -> grpc.aio.AioRpcError:
    fence = await policy.begin_request(request_id)
    request = prefill_pb2.PrefillRequest(
        request_id=request_id, request_generation=fence.request_generation,
        prompt_token_ids=needle_prompt_ids(load(served[0]), 160, seed=9),
        sampling=common_pb2.SamplingParams(max_tokens=2), manifest_sha256=manifest.sha256,
        decode_worker_address=UNREACHABLE_DECODE, decode_worker_id="decode-none",
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Prefill(request, timeout=60)
    return caught.value


async def test_other_profile_is_failed_precondition_and_served_profile_passes_allocation(
    stub: prefill_pb2_grpc.PrefillWorkerStub, policy: PolicyClient,
    manifests: dict[str, KVVisibilityPolicyManifest], served: tuple[Path, HeadProfile],
) -> None:
    refused = await call(stub, policy, manifests["other"], served, "req-other-profile")
    assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
    detail = error_detail(refused)
    assert detail is not None and detail.field == "selection.allocation.headkv_profile_sha256"
    assert served[1].sha256 in detail.message

    allocated = await call(stub, policy, manifests["served"], served, "req-served-profile")
    assert allocated.code() is grpc.StatusCode.UNAVAILABLE  # the missing decode worker, later
    detail = error_detail(allocated)
    assert detail is not None and detail.reason == common_pb2.ERROR_REASON_TRANSFER_FAILED
