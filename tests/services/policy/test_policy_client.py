"""The typed policy client: validation, deadlines, bounded retries and error translation,
against a real loopback gRPC server whose servicer fails on purpose."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from services.policy import (
    ManifestConflict,
    ManifestInvalid,
    NotFound,
    Phase,
    PolicyCallFailed,
    PolicyClient,
    PolicyClientConfig,
    PolicyUnavailable,
    RequestEnded,
    RequestInvalid,
    StaleGeneration,
    StatePublication,
)
from services.policy.client import backoff_delay, error_from_rpc
from services.policy.types import Fence
from services.rpc import errors
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server

SHA = "a" * 64
FENCE = Fence("r", 2, 1, 5, "b" * 64, SHA, Phase.PREFILLED, "p", "", 10, 900)


class ScriptedPolicy(policy_pb2_grpc.PolicyServiceServicer):
    """GetFence fails `failures` times with `error`, then answers; counts every call."""

    def __init__(self) -> None:
        self.calls = 0
        self.failures = 0
        self.error: BaseException = errors.Unavailable("redis down")

    @errors.maps_errors
    async def GetFence(self, request: policy_pb2.GetFenceRequest, context: grpc.aio.ServicerContext) -> policy_pb2.GetFenceResponse:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return policy_pb2.GetFenceResponse(fence=common_pb2.Fence(request_id=request.request_id, phase=common_pb2.PHASE_BEGUN))


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedPolicy, RpcServer]]:
    servicer = ScriptedPolicy()
    binding = ServiceBinding("kvrelay.v1.PolicyService",
                             lambda s: policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, s))
    server = await start_server(ServerConfig(port=0), [binding])
    yield servicer, server
    await server.stop(0)


def client_for(server: RpcServer, **overrides: float) -> PolicyClient:
    values = {"timeout_s": 5.0, "max_attempts": 4, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
    values.update(overrides)
    return PolicyClient(PolicyClientConfig(server.address, **values), rng=random.Random(0))  # type: ignore[arg-type]


async def test_unavailable_is_retried_until_it_succeeds(scripted: tuple[ScriptedPolicy, RpcServer]) -> None:
    servicer, server = scripted
    servicer.failures = 3
    async with client_for(server) as client:
        fence = await client.get_fence("r1")
    assert fence.request_id == "r1" and fence.phase is Phase.BEGUN
    assert servicer.calls == 4


async def test_retries_are_bounded_by_max_attempts(scripted: tuple[ScriptedPolicy, RpcServer]) -> None:
    servicer, server = scripted
    servicer.failures = 100
    async with client_for(server, max_attempts=3) as client:
        with pytest.raises(PolicyUnavailable, match="redis down"):
            await client.get_fence("r1")
    assert servicer.calls == 3


async def test_retries_stop_at_the_deadline(scripted: tuple[ScriptedPolicy, RpcServer]) -> None:
    servicer, server = scripted
    servicer.failures = 100
    async with client_for(server, timeout_s=0.3, max_attempts=50, backoff_initial_s=0.05, backoff_max_s=0.1) as client:
        started = time.monotonic()
        with pytest.raises(PolicyUnavailable):
            await client.get_fence("r1")
        assert time.monotonic() - started < 0.3 + 0.15
    assert 1 <= servicer.calls < 50


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (errors.NotFound("gone", field="request_id"), NotFound),
        (StaleGeneration("old", field="request_generation", current=FENCE), StaleGeneration),
        (errors.InvalidArgument("bad", field="request_id"), RequestInvalid),
        (RuntimeError("bug"), PolicyCallFailed),
    ],
)
async def test_other_errors_are_typed_and_not_retried(
    scripted: tuple[ScriptedPolicy, RpcServer], error: BaseException, expected: type[Exception]
) -> None:
    servicer, server = scripted
    servicer.failures, servicer.error = 100, error
    async with client_for(server) as client:
        with pytest.raises(expected) as failure:
            await client.get_fence("r1")
    assert servicer.calls == 1
    if isinstance(failure.value, StaleGeneration):
        assert failure.value.current == FENCE


async def test_a_service_that_is_not_there_is_unavailable_within_the_deadline() -> None:
    server = await start_server(ServerConfig(port=0), [])
    address = server.address
    await server.stop(0)
    async with PolicyClient(PolicyClientConfig(address, timeout_s=0.5)) as client:
        started = time.monotonic()
        with pytest.raises(PolicyUnavailable):
            await client.get_fence("r1")
        assert time.monotonic() - started < 0.5 + 0.15


async def test_the_client_reconnects_when_the_service_comes_back(scripted: tuple[ScriptedPolicy, RpcServer]) -> None:
    servicer, server = scripted
    port = server.port
    await server.stop(0)
    binding = ServiceBinding("kvrelay.v1.PolicyService",
                             lambda s: policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, s))

    async def restart_later() -> RpcServer:
        await asyncio.sleep(0.3)
        return await start_server(ServerConfig(port=port), [binding])

    async with client_for(server, timeout_s=5.0, max_attempts=100, backoff_max_s=0.1) as client:
        restarted = asyncio.create_task(restart_later())
        try:
            assert (await client.get_fence("back")).request_id == "back"
        finally:
            await (await restarted).stop(0)


def rpc_error(code: grpc.StatusCode, detail: common_pb2.ErrorDetail | None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if detail is not None:
        trailing.add(errors.ERROR_DETAIL_KEY, detail.SerializeToString())
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details=detail.message if detail else "raw")


def test_error_translation_uses_the_detail_reason() -> None:
    invalid = common_pb2.ErrorDetail(reason=common_pb2.ERROR_REASON_MANIFEST_INVALID, field="selection.unit", message="m")
    manifest_error = error_from_rpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, invalid))
    assert isinstance(manifest_error, ManifestInvalid) and manifest_error.field == "selection.unit"
    assert isinstance(error_from_rpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, None)), RequestInvalid)
    assert isinstance(error_from_rpc(rpc_error(grpc.StatusCode.ALREADY_EXISTS, None)), ManifestConflict)
    assert isinstance(error_from_rpc(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, None)), PolicyUnavailable)
    ended_detail = common_pb2.ErrorDetail(reason=common_pb2.ERROR_REASON_REQUEST_ENDED, message="ended")
    ended_detail.current.CopyFrom(common_pb2.Fence(request_id="r", phase=common_pb2.PHASE_ENDED))
    ended = error_from_rpc(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, ended_detail))
    assert isinstance(ended, RequestEnded) and ended.current.ended


def test_backoff_is_full_jitter_and_capped() -> None:
    rng = random.Random(1)
    for attempt in range(8):
        ceiling = min(0.5, 0.05 * 2**attempt)
        delays = [backoff_delay(attempt, 0.05, 0.5, rng) for _ in range(200)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert max(delays) > 0.8 * ceiling


def publication(**changes: object) -> StatePublication:
    fields: dict[str, object] = {
        "request_id": "r-1", "request_generation": 1, "parent_state_generation": 0, "state_generation": 1,
        "cache_generation": 0, "receipt_digest": "c" * 64, "manifest_sha256": SHA, "phase": Phase.PREFILLED,
    }
    fields.update(changes)
    return StatePublication(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * 129}, "request_id"),
        ({"request_id": "-leading-dash"}, "request_id"),
        ({"request_generation": 0}, "request_generation"),
        ({"request_generation": 1.0}, "request_generation"),
        ({"request_generation": True}, "request_generation"),
        ({"parent_state_generation": -1, "state_generation": 0}, "parent_state_generation"),
        ({"state_generation": 2}, "state_generation"),
        ({"cache_generation": -1}, "cache_generation"),
        ({"cache_generation": 2**53}, "cache_generation"),
        ({"receipt_digest": "C" * 64}, "receipt_digest"),
        ({"manifest_sha256": "a" * 63}, "manifest_sha256"),
        ({"phase": Phase.BEGUN}, "phase"),
        ({"phase": Phase.ENDED}, "phase"),
        ({"decode_worker": "d\t1"}, "decode_worker"),
    ],
)
def test_publications_are_validated_on_construction(changes: dict[str, object], field: str) -> None:
    with pytest.raises(RequestInvalid) as failure:
        publication(**changes)
    assert failure.value.field == field


def test_client_config_is_validated() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        PolicyClientConfig("127.0.0.1:1", timeout_s=0)
    with pytest.raises(ValueError, match="max_attempts"):
        PolicyClientConfig("127.0.0.1:1", max_attempts=0)
    assert publication().state_generation == 1


def test_phase_mirrors_the_proto_enum() -> None:
    proto = {name.removeprefix("PHASE_"): number for name, number in common_pb2.Phase.items()}
    assert proto.pop("UNSPECIFIED") == 0
    assert proto == {phase.name: phase.value for phase in Phase}


def test_fence_round_trips_through_protobuf() -> None:
    from services.policy import wire

    assert wire.fence_from_proto(wire.fence_to_proto(FENCE)) == FENCE
    published = publication(prefill_worker="p-1", decode_worker="d-1")
    assert wire.publication_from_proto(wire.publication_to_proto(published, lease_ms=5)) == published
