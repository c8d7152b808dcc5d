"""The shared server bootstrap and the one error-to-status mapping, over real loopback gRPC."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import redis.exceptions
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.kvpolicy.errors import ManifestInvalid, StateInvalid
from services.policy.errors import StaleGeneration
from services.policy.types import Fence, Phase
from services.rpc import errors
from services.rpc.kvrelay.v1 import (
    common_pb2,
    decode_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
)
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server

FENCE = Fence("r", 3, 2, 7, "d" * 64, "m" * 64, Phase.DECODING, "p", "d", 1, 1000)

RAISES: dict[str, BaseException] = {
    "kvpolicy": ManifestInvalid("selection.unit", "unknown value"),
    "state": StateInvalid("selected_positions[0][1]", "not sorted"),
    "notfound": errors.NotFound("no such thing", field="sha256"),
    "exists": errors.AlreadyExists("taken", field="policy_generation"),
    "stale": StaleGeneration("parent 1 is not current", field="parent_state_generation", current=FENCE),
    "redis": redis.exceptions.ConnectionError("Connection refused"),
    "auth": redis.exceptions.AuthenticationError("invalid username-password pair"),
    "bug": RuntimeError("unexpected"),
    "long": errors.InvalidArgument(f"{'v' * 10_000} is not valid", field="f" * 10_000),
}


class RaisingPolicy(policy_pb2_grpc.PolicyServiceServicer):
    @errors.maps_errors
    async def GetFence(self, request: policy_pb2.GetFenceRequest, context: grpc.aio.ServicerContext) -> policy_pb2.GetFenceResponse:
        if request.request_id in RAISES:
            raise RAISES[request.request_id]
        return policy_pb2.GetFenceResponse(fence=common_pb2.Fence(request_id=request.request_id))


class OneTokenGateway(gateway_pb2_grpc.GatewayServicer):
    @errors.maps_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        yield gateway_pb2.GenerateEvent(token=common_pb2.TokenEvent(token_id=7))
        raise errors.NotFound("no manifest", field="manifest.sha256")


BINDINGS = [
    ServiceBinding("kvrelay.v1.PolicyService", lambda s: policy_pb2_grpc.add_PolicyServiceServicer_to_server(RaisingPolicy(), s)),
    ServiceBinding("kvrelay.v1.Gateway", lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(OneTokenGateway(), s)),
]


@pytest.fixture
async def server() -> AsyncIterator[RpcServer]:
    running = await start_server(ServerConfig(port=0, max_message_bytes=4096), BINDINGS)
    yield running
    await running.stop(0)


@pytest.fixture
async def channel(server: RpcServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.address) as ch:
        yield ch


@pytest.mark.parametrize(
    ("request_id", "code", "reason", "field"),
    [
        ("kvpolicy", grpc.StatusCode.INVALID_ARGUMENT, common_pb2.ERROR_REASON_MANIFEST_INVALID, "selection.unit"),
        ("state", grpc.StatusCode.INVALID_ARGUMENT, common_pb2.ERROR_REASON_REQUEST_INVALID, "selected_positions[0][1]"),
        ("notfound", grpc.StatusCode.NOT_FOUND, common_pb2.ERROR_REASON_NOT_FOUND, "sha256"),
        ("exists", grpc.StatusCode.ALREADY_EXISTS, common_pb2.ERROR_REASON_MANIFEST_CONFLICT, "policy_generation"),
        ("stale", grpc.StatusCode.FAILED_PRECONDITION, common_pb2.ERROR_REASON_STALE_GENERATION, "parent_state_generation"),
        ("redis", grpc.StatusCode.UNAVAILABLE, common_pb2.ERROR_REASON_BACKEND_UNAVAILABLE, ""),
        ("auth", grpc.StatusCode.UNAVAILABLE, common_pb2.ERROR_REASON_BACKEND_UNAVAILABLE, ""),
    ],
)
async def test_typed_errors_map_to_status_codes_with_detail(
    channel: grpc.aio.Channel, request_id: str, code: grpc.StatusCode, reason: int, field: str
) -> None:
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.GetFence(policy_pb2.GetFenceRequest(request_id=request_id), timeout=5.0)
    assert failure.value.code() == code
    detail = errors.error_detail(failure.value)
    assert detail is not None and (detail.reason, detail.field) == (reason, field)
    assert detail.message and detail.message in failure.value.details()


async def test_a_long_message_is_bounded_so_the_client_sees_the_real_status(channel: grpc.aio.Channel) -> None:
    """Issue 15: a 10 KB echo made trailers the client refuses, so it saw RESOURCE_EXHAUSTED."""
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.GetFence(policy_pb2.GetFenceRequest(request_id="long"), timeout=5.0)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = errors.error_detail(failure.value)
    assert detail is not None and detail.field.startswith("fff") and detail.message.startswith("vvv")
    assert len(detail.field.encode()) <= errors.MAX_FIELD_BYTES
    assert len(detail.message.encode()) <= errors.MAX_MESSAGE_BYTES
    assert len(failure.value.details()) <= errors.MAX_FIELD_BYTES + errors.MAX_MESSAGE_BYTES + 2


def test_bounded_cuts_on_a_character_boundary() -> None:
    status = errors.RpcStatus(grpc.StatusCode.INVALID_ARGUMENT,
                              common_pb2.ErrorDetail(field="é" * 1000, message="€" * 1000))
    cut = errors.bounded(status).detail
    assert cut.field.endswith("…") and set(cut.field[:-1]) == {"é"}
    assert len(cut.message.encode()) <= errors.MAX_MESSAGE_BYTES and set(cut.message[:-1]) == {"€"}


def chat_with_bad_utf8() -> bytes:
    message = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="QQQQ")]))
    return message.SerializeToString().replace(b"QQQQ", b"\xff\xfe\xff\xfe")


@pytest.mark.parametrize(
    ("method", "payload", "field"),
    [
        ("/kvrelay.v1.PolicyService/GetFence", b"\x0a\x02\xff\xfe", "request_id"),
        ("/kvrelay.v1.PolicyService/GetFence", b"\x0a\xff\xff", "request"),
        ("/kvrelay.v1.Gateway/Generate", chat_with_bad_utf8(), "chat.messages.content"),
        ("/kvrelay.v1.Gateway/Generate", b"\x0a\x05ab", "request"),
    ],
    ids=["string not UTF-8", "corrupt wire format", "nested string not UTF-8 (stream)", "truncated (stream)"],
)
async def test_a_request_that_does_not_parse_is_invalid_argument_naming_what_failed(
    channel: grpc.aio.Channel, method: str, payload: bytes, field: str
) -> None:
    """Issue 15: grpc reported these as UNKNOWN "DecodeError" without a detail."""
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        if method.endswith("Generate"):
            async for _ in channel.unary_stream(method)(payload, timeout=5.0):
                pass
        else:
            await channel.unary_unary(method)(payload, timeout=5.0)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failure.value.details()
    detail = errors.error_detail(failure.value)
    assert detail is not None and detail.field == field
    assert detail.reason == common_pb2.ERROR_REASON_REQUEST_INVALID
    assert ("UTF-8" if field != "request" else "could not be parsed") in detail.message


async def test_stale_generation_carries_the_current_fence(channel: grpc.aio.Channel) -> None:
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.GetFence(policy_pb2.GetFenceRequest(request_id="stale"), timeout=5.0)
    detail = errors.error_detail(failure.value)
    assert detail is not None
    assert (detail.current.request_generation, detail.current.state_generation) == (3, 2)
    assert detail.current.phase == common_pb2.PHASE_DECODING


async def test_unknown_errors_stay_unknown_without_detail(channel: grpc.aio.Channel) -> None:
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.GetFence(policy_pb2.GetFenceRequest(request_id="bug"), timeout=5.0)
    assert failure.value.code() == grpc.StatusCode.UNKNOWN
    assert errors.error_detail(failure.value) is None


async def test_streaming_errors_end_the_stream_with_a_status(channel: grpc.aio.Channel) -> None:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for event in stub.Generate(gateway_pb2.GenerateRequest(text="hi"), timeout=5.0):
            received.append(event.token.token_id)
    assert received == [7]
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    detail = errors.error_detail(failure.value)
    assert detail is not None and detail.field == "manifest.sha256"


async def test_health_reports_serving_for_every_service(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvrelay.v1.PolicyService", "kvrelay.v1.Gateway"):
        response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await health.Check(health_pb2.HealthCheckRequest(service="kvrelay.v1.Nope"), timeout=5.0)
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_the_services(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    response = await responses.read()
    names = {s.name for s in response.list_services_response.service}
    assert {"kvrelay.v1.PolicyService", "kvrelay.v1.Gateway", "grpc.health.v1.Health"} <= names
    responses.cancel()


async def test_messages_over_the_size_limit_are_refused(channel: grpc.aio.Channel) -> None:
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.GetFence(policy_pb2.GetFenceRequest(request_id="x" * 8192), timeout=5.0)
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_bound_port_is_never_shared(server: RpcServer) -> None:
    with pytest.raises((RuntimeError, OSError)):
        await start_server(ServerConfig(port=server.port), BINDINGS)


def test_server_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="max_message_bytes"):
        ServerConfig(max_message_bytes=0)
    assert ServerConfig(host="::1", port=5).bind_address == "[::1]:5"


def test_unknown_and_mistyped_fields_are_named() -> None:
    valid = policy_pb2.PublishStateRequest(request_id="a", request_generation=3)
    errors.reject_unknown_fields(valid)
    mistyped = policy_pb2.PublishStateRequest.FromString(valid.SerializeToString() + b"\x12\x031.5")
    with pytest.raises(errors.InvalidArgument) as failure:
        errors.reject_unknown_fields(mistyped)
    assert failure.value.field == "request_generation" and "wire type" in failure.value.message


def test_unknown_fields_are_found_in_nested_repeated_messages() -> None:
    spec = common_pb2.TensorSpec(name="v").SerializeToString() + b"\x48\x05"  # field 9, varint 5
    descriptor = decode_pb2.TransferDescriptor(tensors=[common_pb2.TensorSpec(name="k")], trace_context={"a": "b"})
    raw = descriptor.SerializeToString() + b"\x2a" + bytes([len(spec)]) + spec  # field 5: tensors
    message = decode_pb2.AcceptTransferRequest.FromString(b"\x0a" + bytes([len(raw)]) + raw)
    with pytest.raises(errors.InvalidArgument) as failure:
        errors.reject_unknown_fields(message)
    assert failure.value.field == "descriptor.tensors[1].#9"
    errors.reject_unknown_fields(decode_pb2.AcceptTransferRequest(descriptor=descriptor))
