"""Decode-time retention end to end through the gateway of the shared `kvrelay up` stack
(separate processes, real gRPC, Redis and gloo) on the tiny e2e checkpoint: StreamingLLM
(sinks + recent) under both position contracts and H2O on a SnapKV prompt view; and a
decode worker SIGKILLed mid-generation, whose last published state is what the fence keeps.

The reference is the same policy run in this process on the kvpolicy core's view of the
prompt (compress) and a paged cache: the stack's tokens equal it, no (layer, owner) of the
reference ever holds more than the budget, and the state the decode worker last published
through the fence (every 8 steps and at the end) is, digest for digest, the reference's
final successor — so the stack's decode held exactly those rows when it ended."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import grpc
import pytest
from e2e_helpers import UpStack, fence_of, get_fence, needle_ids

from decode_worker.retention import RetentionSession
from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
from services.gateway.client import GatewayClient, generate_request
from services.gateway.server import GatewayServer
from services.kvpolicy.compress import StateIdentity, compress
from services.kvpolicy.manifest import (
    Fidelity,
    KVVisibilityPolicyManifest,
    Phase,
    UpdateCadence,
    default_manifests,
)
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.retention_contract import (
    PositionContract,
    RetentionContract,
    RetentionMethod,
)
from services.launcher.stack import ServiceProcess, WorkerPorts
from services.model import (
    DecodeCache,
    LoadedModel,
    PrefillOptions,
    SamplingParams,
    decode_step,
    finish_reason,
    prefill,
)
from services.policy import PolicyClient, PolicyClientConfig
from services.policy.types import Phase as FencePhase
from services.redis_embedded import free_loopback_port
from services.rpc.kvrelay.v1 import gateway_pb2_grpc
from services.rpc.server import ServerConfig

pytestmark = pytest.mark.timeout(180)
PROMPT, MAX_TOKENS, EVERY = 96, 20, 8


def retaining(loaded: LoadedModel, name: str, base: str, contract: RetentionContract) -> KVVisibilityPolicyManifest:
    manifest = default_manifests(loaded.tensor_contract, recent_window=contract.recent_window,
                                 sinks=max(contract.sinks, 1), observation_window=8)[base]
    selection = dataclasses.replace(manifest.selection, phase=Phase.BOTH, update_cadence=UpdateCadence.EVERY_STEP,
                                    retention=contract)
    representation = dataclasses.replace(manifest.representation, fidelity=Fidelity.LOSSY_SUBSET)
    return dataclasses.replace(manifest, name=name, policy_manifest_id=f"{name}@1", selection=selection,
                               representation=representation)


CASES = {
    "sink-recent-e2e": ("sink-recent", RetentionContract(RetentionMethod.SINK_RECENT, budget_rows=20,
                                                         recent_window=16, sinks=4, publish_every_steps=EVERY)),
    "sink-recent-local-e2e": ("sink-recent", RetentionContract(
        RetentionMethod.SINK_RECENT, budget_rows=20, recent_window=16, sinks=4, publish_every_steps=EVERY,
        positions=PositionContract.CACHE_LOCAL)),
    "snapkv-h2o-e2e": ("snapkv", RetentionContract(RetentionMethod.H2O, budget_rows=20, recent_window=4,
                                                   publish_every_steps=EVERY)),
}


async def register(policy_address: str, manifests: list[KVVisibilityPolicyManifest]) -> None:
    async with PolicyClient(PolicyClientConfig(policy_address, timeout_s=10.0)) as client:
        for manifest in manifests:
            await client.register_manifest(manifest.canonical_json())


def in_process(loaded: LoadedModel, manifest: KVVisibilityPolicyManifest, ids: list[int], request_id: str,
               request_generation: int, max_tokens: int = MAX_TOKENS,
               steps: int | None = None) -> tuple[list[int], RetentionSession]:
    """The same request decoded here: the core's view of the prompt, then the retention loop
    on a paged cache, greedy, until it finishes (then its last state is published) or after
    `steps` decode steps; every step checks the budget on every (layer, owner)."""
    contract = manifest.selection.retention
    assert contract is not None
    window = manifest.selection.snapkv.observation_window if manifest.selection.snapkv else 0
    forward = prefill(loaded.model, ids, PrefillOptions(obs_window=window))
    compressed = compress(manifest, forward, StateIdentity(request_id, request_generation))
    session = RetentionSession(manifest, contract, compressed.state)
    cache = DecodeCache(loaded.config, loaded.dtype, loaded.device, owner_to_kv_head=manifest.expanded_owner_map)
    cache.admit_view(request_id, compressed.view, len(ids), contract=session.row_contract)
    session.admitted(cache)
    eos, greedy = loaded.generation_config.eos_token_ids, SamplingParams()
    tokens = [int(forward.logits.argmax())]
    while finish_reason(tokens[-1], len(tokens), max_tokens, greedy, eos) is None:
        if steps is not None and len(tokens) > steps:
            return tokens, session
        logits = decode_step(loaded.model, cache, [tokens[-1]])
        session.commit(cache, session.decide(cache))
        assert int(cache.lengths(request_id).max()) <= contract.budget_rows
        tokens.append(int(logits[0].argmax()))
    session.finish(cache)
    return tokens, session


@pytest.mark.parametrize("name", list(CASES))
def test_retention_through_the_stack_equals_the_in_process_policy(stack: UpStack, loaded: LoadedModel,
                                                                   name: str) -> None:
    base, contract = CASES[name]
    manifest = retaining(loaded, name, base, contract)
    asyncio.run(register(stack.policy_address, [manifest]))
    ids = needle_ids(loaded, PROMPT, 41)
    request_id = f"e2e-{name}"
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        result = client.generate(generate_request(ids, policy=name, max_tokens=MAX_TOKENS, detokenize=False,
                                                  request_id=request_id))
    summary = result.summary
    assert summary.manifest_sha256 == manifest.sha256
    fence = fence_of(stack.policy_address, request_id)
    expected, session = in_process(loaded, manifest, ids, request_id, fence.request_generation)
    assert list(result.token_ids) == expected
    # Published every 8 steps and at the end (the last cadence point may be the end).
    steps = len(expected) - 1
    assert steps >= 1 and session.publications == -(-steps // EVERY)
    assert session.resident_max <= contract.budget_rows and session.evicted_rows > 0
    assert fence.state_generation == 1 + session.publications == summary.generations.state_generation
    assert fence.receipt_digest == Receipt.for_state(session.published).digest
    assert fence.phase in (FencePhase.DECODING, FencePhase.ENDED)
    assert summary.generations.cache_generation == session.cache_generation
    # The client's summary says both policies and what the decode held.
    retention = summary.retention
    assert retention.decode_method == contract.method.value
    assert retention.prompt_method == manifest.selection.method.value
    assert (retention.budget_rows, retention.resident_max) == (
        contract.budget_rows, session.resident_max
    )
    assert (retention.evicted_rows, retention.publications) == (
        session.evicted_rows, session.publications
    )


@pytest.fixture
def spare(stack: UpStack) -> Iterator[ServiceProcess]:
    worker = stack.launch_decode("decode-retention-spare", WorkerPorts(free_loopback_port(), free_loopback_port()))
    yield worker
    worker.kill()


@pytest.mark.slow
async def test_a_decode_worker_killed_mid_generation_leaves_its_last_published_state(
    stack: UpStack, loaded: LoadedModel, spare: ServiceProcess
) -> None:
    """The spare decode worker (the gateway's only one) publishes every 4 steps; it is
    SIGKILLed once 12 tokens have streamed. The stream ends UNAVAILABLE, and the fence holds
    the successor of the last cadence point the worker reached, exactly: replaying that many
    steps here gives the same receipt digest. The local successors since are gone."""
    name, every = "window-kill-e2e", 4
    contract = RetentionContract(RetentionMethod.WINDOW, budget_rows=16, recent_window=16, publish_every_steps=every)
    manifest = retaining(loaded, name, "window", contract)
    await register(stack.policy_address, [manifest])
    gateway = await GatewayServer.start(GatewayConfig(
        checkpoint=stack.config.checkpoint,
        prefill_workers=WorkerSource(addresses=(stack.prefill_addresses[0],)),
        decode_workers=WorkerSource(addresses=(spare.address,)),
        policy_address=stack.policy_address,
        server=ServerConfig(port=0, shutdown_grace_s=0),
        discovery=DiscoveryConfig(health_interval_s=0.5),
    ))
    ids, request_id = needle_ids(loaded, PROMPT, 43), "e2e-retention-kill"
    request = generate_request(ids, policy=name, max_tokens=2000, detokenize=False, request_id=request_id)
    streamed: list[int] = []
    try:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for event in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=90):
                    streamed.append(event.token.token_id)
                    if len(streamed) == 12:
                        await asyncio.to_thread(spare.kill)
    finally:
        await gateway.stop(0)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE and not spare.running
    fence = await get_fence(stack.policy_address, request_id)
    published = fence.state_generation - 1
    # Token i comes from decode step i - 1, committed (and published on its cadence) before it
    # was sent: 11 steps had run, so the cadence points 4 and 8 were published at least.
    assert published >= 2
    expected, session = in_process(loaded, manifest, ids, request_id, fence.request_generation, max_tokens=2000,
                                   steps=every * published)
    assert session.publications == published
    assert fence.receipt_digest == Receipt.for_state(session.published).digest
    assert streamed[:len(expected)] == expected[:len(streamed)]
