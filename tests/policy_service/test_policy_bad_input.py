"""Every class of bad input, sent through the real gRPC server, gets the expected status code,
an ErrorDetail naming the field, and leaves Redis exactly as it was."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import redis
from google.protobuf.message import Message
from policy_helpers import digest, service_config

from policy_service.server import PolicyServer
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.redis_embedded import EmbeddedRedis
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.rpc.server import ServerConfig

MAX_MANIFEST_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 256 * 1024
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@dataclass(frozen=True)
class Context:
    """What each case may build on: a begun request and the registered snapkv manifest."""

    request_id: str
    request_generation: int
    manifest_sha: str
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    build: Callable[[Context], Message | bytes]  # bytes: sent as-is (hand-made wire format)
    code: grpc.StatusCode
    field: str


def manifest_json(ctx: Context, **changes: Any) -> bytes:
    data = json.loads(json.dumps(ctx.manifest))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return json.dumps(data).encode()


def register(payload: Callable[[Context], bytes]) -> Callable[[Context], Message]:
    return lambda ctx: policy_pb2.RegisterManifestRequest(manifest_json=payload(ctx))


def publish(**changes: Any) -> Callable[[Context], Message]:
    def build(ctx: Context) -> Message:
        fields: dict[str, Any] = {
            "request_id": ctx.request_id,
            "request_generation": ctx.request_generation,
            "parent_state_generation": 1,
            "state_generation": 2,
            "cache_generation": 40,
            "receipt_digest": digest("bad-input"),
            "manifest_sha256": ctx.manifest_sha,
            "phase": common_pb2.PHASE_RECALLED,
        }
        fields.update(changes)
        return policy_pb2.PublishStateRequest(**fields)

    return build


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def with_digits(digits: int) -> Callable[[Context], bytes]:
    """The registered manifest with a `digits`-digit policy_generation (JSON allows any)."""
    def build(ctx: Context) -> bytes:
        text = manifest_json(ctx, policy_generation=7).decode()
        return text.replace('"policy_generation": 7', f'"policy_generation": {"9" * digits}').encode()

    return build


def with_raw_field(number: int, payload: bytes) -> Callable[[Context], bytes]:
    """A valid publish plus one length-delimited field `number` carrying `payload`."""
    def build(ctx: Context) -> bytes:
        valid = publish()(ctx).SerializeToString()
        return valid + varint(number << 3 | 2) + varint(len(payload)) + payload

    return build


CASES = [
    Case("malformed manifest JSON", "RegisterManifest", register(lambda c: b'{"name": '), INVALID, "manifest"),
    Case("unknown manifest field", "RegisterManifest", register(lambda c: manifest_json(c, surprise=1)), INVALID, "surprise"),
    Case("unknown nested manifest field", "RegisterManifest",
         register(lambda c: manifest_json(c, selection__snapkv__extra=True)), INVALID, "selection.snapkv.extra"),
    Case("failing validation", "RegisterManifest",
         register(lambda c: manifest_json(c, representation__fidelity="full_cache_exact")), INVALID, "representation.fidelity"),
    Case("unknown enum value", "RegisterManifest",
         register(lambda c: manifest_json(c, selection__unit="sentence")), INVALID, "selection.unit"),
    Case("non-integer policy generation", "RegisterManifest",
         register(lambda c: manifest_json(c, policy_generation=1.5)), INVALID, "policy_generation"),
    Case("string policy generation", "RegisterManifest",
         register(lambda c: manifest_json(c, policy_generation="2")), INVALID, "policy_generation"),
    Case("negative policy generation", "RegisterManifest",
         register(lambda c: manifest_json(c, policy_generation=-1)), INVALID, "policy_generation"),
    Case("policy generation 2**63 (past int64 and Lua's exact integers)", "RegisterManifest",
         register(lambda c: manifest_json(c, policy_generation=2**63)), INVALID, "policy_generation"),
    Case("policy generation 2**53", "RegisterManifest",
         register(lambda c: manifest_json(c, policy_generation=2**53)), INVALID, "policy_generation"),
    Case("5000-digit policy generation", "RegisterManifest", register(with_digits(5000)), INVALID,
         "policy_generation"),
    Case("checkpoint generation 2**63", "RegisterManifest",
         register(lambda c: manifest_json(c, checkpoint_generation=2**63)), INVALID, "checkpoint_generation"),
    Case("10**7 K/V heads with a custom map", "RegisterManifest",
         register(lambda c: manifest_json(c, tensor__num_kv_heads=10**7, tensor__gqa_grouping="custom")),
         INVALID, "tensor.num_kv_heads"),
    Case("a head map longer than any model has heads", "RegisterManifest",
         register(lambda c: manifest_json(c, tensor__q_to_kv_head_map=[0] * 10_000)), INVALID,
         "tensor.q_to_kv_head_map"),
    Case("observation window past 16M positions", "RegisterManifest",
         register(lambda c: manifest_json(c, selection__snapkv__observation_window=2**40)), INVALID,
         "selection.snapkv.observation_window"),
    Case("10 KB policy name", "RegisterManifest", register(lambda c: manifest_json(c, name="x" * 10_000)),
         INVALID, "name"),
    Case("empty manifest", "RegisterManifest", register(lambda c: b""), INVALID, "manifest_json"),
    Case("manifest not UTF-8", "RegisterManifest", register(lambda c: b'{"name": "\xff"}'), INVALID, "manifest_json"),
    Case("oversized manifest", "RegisterManifest",
         register(lambda c: manifest_json(c, policy_manifest_id="x" * MAX_MANIFEST_BYTES)), INVALID, "manifest_json"),
    Case("different manifest under an existing name and generation", "RegisterManifest",
         register(lambda c: manifest_json(c, selection__snapkv__pooling_kernel=7)),
         grpc.StatusCode.ALREADY_EXISTS, "policy_generation"),
    Case("unknown manifest sha", "GetManifest",
         lambda c: policy_pb2.GetManifestRequest(sha256=digest("nope")), NOT_FOUND, "sha256"),
    Case("malformed manifest sha", "GetManifest",
         lambda c: policy_pb2.GetManifestRequest(sha256="XYZ"), INVALID, "sha256"),
    Case("empty request id", "BeginRequest", lambda c: policy_pb2.BeginRequestRequest(request_id=""), INVALID, "request_id"),
    Case("oversized request id", "BeginRequest",
         lambda c: policy_pb2.BeginRequestRequest(request_id="r" * 129), INVALID, "request_id"),
    Case("request id with whitespace", "BeginRequest",
         lambda c: policy_pb2.BeginRequestRequest(request_id="a b\n"), INVALID, "request_id"),
    Case("negative lease", "BeginRequest",
         lambda c: policy_pb2.BeginRequestRequest(request_id="fine", lease_ms=-1), INVALID, "lease_ms"),
    Case("negative request generation", "PublishState", publish(request_generation=-1), INVALID, "request_generation"),
    Case("zero request generation", "PublishState", publish(request_generation=0), INVALID, "request_generation"),
    Case("generation beyond 2**53", "PublishState", publish(request_generation=2**53), INVALID, "request_generation"),
    Case("non-integer request generation (string on the wire)", "PublishState",
         with_raw_field(2, b"1.5"), INVALID, "request_generation"),
    Case("unknown protobuf field", "PublishState", with_raw_field(99, b"x"), INVALID, "#99"),
    Case("string field not UTF-8", "BeginRequest", lambda c: b"\x0a\x02\xff\xfe", INVALID, "request_id"),
    Case("corrupt wire format", "PublishState", lambda c: b"\x0a\xff\xff", INVALID, "request"),
    Case("negative parent generation", "PublishState",
         publish(parent_state_generation=-1, state_generation=0), INVALID, "parent_state_generation"),
    Case("successor is not parent + 1", "PublishState", publish(state_generation=3), INVALID, "state_generation"),
    Case("negative cache generation", "PublishState", publish(cache_generation=-5), INVALID, "cache_generation"),
    Case("malformed receipt digest", "PublishState", publish(receipt_digest="not-hex"), INVALID, "receipt_digest"),
    Case("empty manifest sha", "PublishState", publish(manifest_sha256=""), INVALID, "manifest_sha256"),
    Case("unspecified phase", "PublishState", publish(phase=common_pb2.PHASE_UNSPECIFIED), INVALID, "phase"),
    Case("phase only BeginRequest may set", "PublishState", publish(phase=common_pb2.PHASE_BEGUN), INVALID, "phase"),
    Case("unknown phase number", "PublishState", publish(phase=42), INVALID, "phase"),
    Case("worker id with whitespace", "PublishState", publish(prefill_worker="p 1"), INVALID, "prefill_worker"),
    Case("unregistered manifest sha", "PublishState", publish(manifest_sha256=digest("unregistered")),
         NOT_FOUND, "manifest_sha256"),
    Case("unknown request", "PublishState", publish(request_id="ghost", request_generation=1), NOT_FOUND, "request_id"),
    Case("stale parent", "PublishState", publish(parent_state_generation=0, state_generation=1, receipt_digest=digest("rival")),
         grpc.StatusCode.FAILED_PRECONDITION, "parent_state_generation"),
    Case("stale request generation", "PublishState", publish(request_generation=10**9),
         grpc.StatusCode.FAILED_PRECONDITION, "request_generation"),
    Case("fence of an empty request id", "GetFence", lambda c: policy_pb2.GetFenceRequest(), INVALID, "request_id"),
    Case("fence of an unknown request", "GetFence",
         lambda c: policy_pb2.GetFenceRequest(request_id="ghost"), NOT_FOUND, "request_id"),
    Case("end with generation 0", "EndRequest",
         lambda c: policy_pb2.EndRequestRequest(request_id=c.request_id), INVALID, "request_generation"),
    Case("end of an unknown request", "EndRequest",
         lambda c: policy_pb2.EndRequestRequest(request_id="ghost", request_generation=1), NOT_FOUND, "request_id"),
]


@pytest.fixture
async def small_server(redis_server: EmbeddedRedis) -> AsyncIterator[PolicyServer]:
    config = service_config(
        redis_server.url,
        server=ServerConfig(port=0, max_message_bytes=MAX_MESSAGE_BYTES, shutdown_grace_s=0.5),
        max_manifest_bytes=MAX_MANIFEST_BYTES,
    )
    server = await PolicyServer.start(config)
    yield server
    await server.stop(0)


@pytest.fixture
async def channel(small_server: PolicyServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(small_server.address) as ch:
        yield ch


@pytest.fixture
async def context(channel: grpc.aio.Channel, manifests: dict[str, KVVisibilityPolicyManifest]) -> Context:
    """A begun request whose state 1 is published under the registered snapkv manifest."""
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    manifest = manifests["snapkv"]
    await stub.RegisterManifest(policy_pb2.RegisterManifestRequest(manifest_json=manifest.canonical_json()))
    begun = await stub.BeginRequest(policy_pb2.BeginRequestRequest(request_id="bad-input"))
    ctx = Context("bad-input", begun.fence.request_generation, manifest.sha256, manifest.to_dict())
    await stub.PublishState(publish(parent_state_generation=0, state_generation=1, cache_generation=30)(ctx))
    return ctx


def keyspace(url: str, prefix: str) -> dict[str, Any]:
    """Every key under `prefix` (the registry's carry it inside their hash tag) with its full
    content (not its TTL)."""
    with redis.Redis.from_url(url, decode_responses=True) as r:
        snapshot: dict[str, Any] = {}
        for key in r.scan_iter(match=f"*{prefix}*"):
            kind = r.type(key)
            snapshot[key] = r.hgetall(key) if kind == "hash" else r.get(key)
        return snapshot


async def call_raw(channel: grpc.aio.Channel, method: str, payload: bytes) -> None:
    call = channel.unary_unary(f"/kvrelay.v1.PolicyService/{method}")
    await call(payload, timeout=5.0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_bad_input_is_rejected_with_status_and_field(
    case: Case, context: Context, channel: grpc.aio.Channel, small_server: PolicyServer, redis_server: EmbeddedRedis
) -> None:
    prefix = small_server.config.key_prefix
    before = keyspace(redis_server.url, prefix)
    request = case.build(context)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        if isinstance(request, bytes):
            await call_raw(channel, case.method, request)
        else:
            await getattr(policy_pb2_grpc.PolicyServiceStub(channel), case.method)(request, timeout=5.0)
    assert failure.value.code() == case.code, failure.value.details()
    detail = error_detail(failure.value)
    assert detail is not None and detail.field == case.field, (detail, failure.value.details())
    assert case.field in failure.value.details()
    assert len(failure.value.details()) < 400, "a bad value is echoed in ~100 characters at most"
    assert keyspace(redis_server.url, prefix) == before


async def test_message_over_the_transport_limit_is_refused(channel: grpc.aio.Channel, small_server: PolicyServer,
                                                           redis_server: EmbeddedRedis) -> None:
    before = keyspace(redis_server.url, small_server.config.key_prefix)
    stub = policy_pb2_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.RegisterManifest(policy_pb2.RegisterManifestRequest(manifest_json=b" " * MAX_MESSAGE_BYTES), timeout=5.0)
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert keyspace(redis_server.url, small_server.config.key_prefix) == before
