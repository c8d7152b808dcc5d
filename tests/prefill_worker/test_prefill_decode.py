"""Prefill → decode between real processes: `kvrelay serve policy|prefill|decode`, each in its
own process, on a real redis; the rows travel over a real gloo pair group.

A transfer lands and the decode worker decodes from it only after verifying it: the digest it
recomputes from the positions it received (reported in its summary) equals the receipt the
prefill worker published, which an in-process run of the same stages reproduces. Bytes
moved equal the ledger on both sides. With policy `full` the tokens equal the model's own
greedy generation in one process."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from prefill_helpers import prompt_ids

from prefill_worker.pipeline import PrefillJob, forward
from prefill_worker.wire import DecodeTarget, PrefillCall
from services.kvpolicy.compress import Compressed, compress
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, RecoverabilityMode
from services.launcher.stack import ServiceProcess, service_command
from services.model import LoadedModel, SamplingParams, generate
from services.model.runtime import PromptForward
from services.offload.plan import OffloadPlan, offload_plan
from services.offload.recall import RecallKnobs, with_recall
from services.policy import PolicyClient, PolicyClientConfig
from services.policy.types import Phase
from services.redis_embedded import EmbeddedRedis, free_loopback_port
from services.rpc.kvrelay.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
START_S = 180.0
CALL_S = 120.0
PROMPT_LEN, MAX_TOKENS = 40, 6


@dataclass(frozen=True)
class Workers:
    policy: ServiceProcess
    prefill: ServiceProcess
    decode: ServiceProcess
    decode_id: str = "decode-p2d"


@pytest.fixture(scope="module")
def workers(checkpoint: Path, redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    logs = tmp_path_factory.mktemp("p2d-logs")
    ports = set()
    while len(ports) < 4:
        ports.add(free_loopback_port())
    policy_port, prefill_port, decode_port, rendezvous_port = sorted(ports)
    policy_address = f"127.0.0.1:{policy_port}"

    def process(role: str, port: int, *args: str) -> ServiceProcess:
        return ServiceProcess(role, role, f"127.0.0.1:{port}", service_command(role, *args, "--plaintext"), logs / f"{role}.log")

    model = ("--checkpoint", str(checkpoint), "--host", "127.0.0.1")
    services = [
        process("policy", policy_port, "--port", str(policy_port), "--redis-url", redis_server.url,
                "--key-prefix", f"p2d{uuid.uuid4().hex[:8]}:"),
        process("prefill", prefill_port, *model, "--port", str(prefill_port), "--policy-address", policy_address,
                "--worker-id", "prefill-p2d"),
        process("decode", decode_port, *model, "--port", str(decode_port), "--transfer-port", str(rendezvous_port),
                "--policy-address", policy_address, "--worker-id", "decode-p2d"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    try:
        for service in services:
            service.spawn(env)
        deadline = time.monotonic() + START_S
        for service in services:
            service.wait_healthy(deadline)
        yield Workers(*services)
    finally:
        for service in reversed(services):
            service.terminate()
            service.wait_stopped(10.0)


@pytest.fixture
async def policy_client(
    workers: Workers, manifests: dict[str, KVVisibilityPolicyManifest]
) -> AsyncIterator[PolicyClient]:
    async with PolicyClient(PolicyClientConfig(workers.policy.address, timeout_s=10.0)) as client:
        for manifest in manifests.values():
            await client.register_manifest(manifest.canonical_json())
        yield client


@dataclass(frozen=True)
class Run:
    reply: prefill_pb2.PrefillResponse
    tokens: list[int]
    summary: decode_pb2.DecodeSummary


async def prefill_then_decode(
    workers: Workers, policy: PolicyClient, request_id: str, manifest: KVVisibilityPolicyManifest, prompt: list[int]
) -> Run:
    """What the gateway does for one request, minus the gateway."""
    fence = await policy.begin_request(request_id)
    message = prefill_pb2.PrefillRequest(
        request_id=request_id,
        request_generation=fence.request_generation,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        manifest_sha256=manifest.sha256,
        decode_worker_address=workers.decode.address,
        decode_worker_id=workers.decode_id,
    )
    async with grpc.aio.insecure_channel(workers.prefill.address) as channel:
        reply = await prefill_pb2_grpc.PrefillWorkerStub(channel).Prefill(message, timeout=CALL_S)
    stream = decode_pb2.StreamTokensRequest(
        request_id=request_id, request_generation=fence.request_generation, transfer_id=reply.transfer.transfer_id
    )
    tokens: list[int] = []
    async with grpc.aio.insecure_channel(workers.decode.address) as channel:
        async for event in decode_pb2_grpc.DecodeWorkerStub(channel).StreamTokens(stream, timeout=CALL_S):
            if event.HasField("summary"):
                return Run(reply, tokens, event.summary)
            tokens.append(event.token.token_id)
    raise AssertionError(f"the stream of {request_id} ended without a summary")


def in_process(
    model: LoadedModel, manifest: KVVisibilityPolicyManifest, request_id: str, generation: int, prompt: list[int]
) -> tuple[PromptForward, Compressed]:
    """The prefill worker's forward and compression of `prompt`, in this process."""
    call = PrefillCall(request_id, generation, tuple(prompt), SamplingParams(), MAX_TOKENS, manifest.sha256,
                       DecodeTarget("127.0.0.1:1", "unused"))
    job = PrefillJob(call, manifest)
    fwd = forward(model, job, chunk_size=512)
    return fwd, compress(manifest, fwd.result, job.identity)


def in_process_digest(
    model: LoadedModel, manifest: KVVisibilityPolicyManifest, request_id: str, generation: int, prompt: list[int]
) -> str:
    return in_process(model, manifest, request_id, generation, prompt)[1].receipt.digest


def assert_bytes_match_the_ledger(run: Run) -> None:
    ledger = run.reply.ledger
    traffic = ledger.visible_payload_bytes + ledger.position_map_bytes + ledger.row_offsets_bytes
    assert run.summary.ledger.bytes_moved == ledger.bytes_moved == traffic > 0


async def test_full_policy_decodes_what_one_process_generates(
    workers: Workers, policy_client: PolicyClient, model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    prompt = prompt_ids(PROMPT_LEN, seed=11)
    run = await prefill_then_decode(workers, policy_client, "p2d-full", manifests["full"], prompt)
    assert run.tokens == generate(model, prompt, MAX_TOKENS)
    assert run.tokens[0] == run.reply.transfer.first_token_id
    assert run.reply.receipt.omitted_rows == 0
    assert run.summary.verified_receipt_digest == run.reply.receipt.digest
    assert_bytes_match_the_ledger(run)


async def test_snapkv_view_is_verified_against_the_published_receipt(
    workers: Workers, policy_client: PolicyClient, model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    manifest = manifests["snapkv-pyramid"]
    prompt = prompt_ids(PROMPT_LEN, seed=12)
    run = await prefill_then_decode(workers, policy_client, "p2d-snapkv", manifest, prompt)
    receipt = run.reply.receipt
    # The digest the decode worker recomputed from the position map it received is the
    # published one, and the same stages in this process select the same positions.
    assert run.summary.verified_receipt_digest == receipt.digest
    assert run.summary.retained_rows == receipt.retained_rows
    assert receipt.digest == in_process_digest(model, manifest, "p2d-snapkv", receipt.generations.request_generation, prompt)
    assert 1 <= len(run.tokens) <= MAX_TOKENS and run.tokens[0] == run.reply.transfer.first_token_id
    assert run.summary.generations.state_generation == receipt.generations.state_generation == 1
    assert run.summary.output_tokens == len(run.tokens)
    assert receipt.omitted_rows > 0
    assert_bytes_match_the_ledger(run)
    fence = await policy_client.get_fence("p2d-snapkv")
    assert fence.receipt_digest == receipt.digest
    assert fence.phase in (Phase.PREFILLED, Phase.ENDED)  # the decode worker ends it after the summary


async def test_row_codes_travel_with_a_recallable_local_view_and_are_verified(
    workers: Workers, policy_client: PolicyClient, model: LoadedModel, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    """A manifest with `key_code_bits`: the prefill worker codes every omitted row, the codes
    travel in the sidecar (counted with the page summaries), the decode worker verifies them
    against the host rows and, with the full-recall gate, decodes like the full cache."""
    knobs = RecallKnobs(threshold=0.0, page_size=4, max_pages_per_step=64, cadence_steps=1, timeout_ms=5000,
                        full_recall_gate=1e-6)
    base = with_recall(manifests["snapkv"], knobs, mode=RecoverabilityMode.RECALLABLE_LOCAL)
    manifest = replace(base, name="snapkv-local-coded", policy_manifest_id="snapkv-local-coded@1",
                       recoverability=replace(base.recoverability, key_code_bits=2))
    await policy_client.register_manifest(manifest.canonical_json())
    prompt = prompt_ids(PROMPT_LEN, seed=13)
    run = await prefill_then_decode(workers, policy_client, "p2d-coded", manifest, prompt)

    assert run.tokens == generate(model, prompt, MAX_TOKENS)
    receipt, ledger = run.reply.receipt, run.reply.ledger
    assert run.summary.verified_receipt_digest == receipt.digest
    assert run.summary.recalled_rows == receipt.omitted_rows > 0
    # The same stages in this process: the summaries the prefill worker sent, codes included.
    plan = in_process_plan(model, manifest, "p2d-coded", receipt.generations.request_generation, prompt)
    codes = plan.summaries.row_codes
    assert codes is not None and codes.shape == (receipt.omitted_rows, manifest.tensor.head_dim * 2 // 8)
    assert ledger.page_summary_bytes == plan.summaries.nbytes > codes.numel()
    metadata = ledger.position_map_bytes + ledger.row_offsets_bytes + ledger.page_summary_bytes
    traffic = ledger.visible_payload_bytes + metadata + ledger.host_tier_bytes
    assert run.summary.ledger.bytes_moved == ledger.bytes_moved == traffic


def in_process_plan(
    model: LoadedModel, manifest: KVVisibilityPolicyManifest, request_id: str, generation: int, prompt: list[int]
) -> OffloadPlan:
    fwd, compressed = in_process(model, manifest, request_id, generation, prompt)
    state = compressed.state
    plan = offload_plan(manifest, fwd.result.source_k, fwd.result.source_v, state.selected_positions)
    assert plan is not None
    return plan
