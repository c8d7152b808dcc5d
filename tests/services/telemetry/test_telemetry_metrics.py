"""Prometheus metrics: every served call is counted and timed by method and final status
(unary, aborted, streaming, unknown errors) on a real grpc.aio server; each role exposes its
own families over HTTP; a taken metrics port never stops a service."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from telemetry_helpers import sample, scrape

from services.redis_embedded import free_loopback_port
from services.rpc.errors import InvalidArgument, maps_errors
from services.rpc.server import ServerConfig, ServiceBinding, start_server
from services.telemetry.metrics import ROLE_FAMILIES, registry_for, serve_metrics

pytestmark = pytest.mark.timeout(60)
SERVICE = "kvrelay.test.Echo"


class Echo:
    """A tiny service over raw bytes: Say echoes (or fails on b"bad"/b"boom"), Count streams."""

    @maps_errors
    async def say(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"bad":
            raise InvalidArgument("not welcome", field="text")
        if request == b"boom":
            raise RuntimeError("unexpected")
        return request

    @maps_errors
    async def count(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()


def _register(server: grpc.aio.Server) -> None:
    echo = Echo()
    handlers = {
        "Say": grpc.unary_unary_rpc_method_handler(echo.say),
        "Count": grpc.unary_stream_rpc_method_handler(echo.count),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _count(method: str, code: str) -> float:
    value = registry_for("policy").get_sample_value("kvrelay_rpc_requests_total", {"method": f"/{SERVICE}/{method}", "code": code})
    return value or 0.0


async def test_calls_are_counted_by_method_and_final_status() -> None:
    server = await start_server(ServerConfig(port=0, shutdown_grace_s=0), [ServiceBinding(SERVICE, _register)])
    before = {key: _count(*key) for key in [("Say", "OK"), ("Say", "INVALID_ARGUMENT"), ("Say", "UNKNOWN"),
                                            ("Count", "OK")]}
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            say = channel.unary_unary(f"/{SERVICE}/Say")
            count = channel.unary_stream(f"/{SERVICE}/Count")
            assert await say(b"hi", timeout=5) == b"hi"
            for bad, code in ((b"bad", grpc.StatusCode.INVALID_ARGUMENT), (b"boom", grpc.StatusCode.UNKNOWN)):
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await say(bad, timeout=5)
                assert failed.value.code() == code
            assert [m async for m in count(b"3", timeout=5)] == [b"0", b"1", b"2"]
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        await server.stop(0)
    assert {key: _count(*key) - value for key, value in before.items()} == {
        ("Say", "OK"): 1, ("Say", "INVALID_ARGUMENT"): 1, ("Say", "UNKNOWN"): 1, ("Count", "OK"): 1,
    }
    registry = registry_for("policy")
    assert registry.get_sample_value("kvrelay_rpc_requests_total", {"method": "/grpc.health.v1.Health/Check",
                                                                    "code": "OK"}) is None
    latency = registry.get_sample_value("kvrelay_rpc_duration_seconds_count", {"method": f"/{SERVICE}/Count",
                                                                               "code": "OK"})
    assert latency is not None and latency >= 1


def test_each_role_exposes_its_own_families_over_http() -> None:
    port = free_loopback_port()
    endpoint = serve_metrics("decode", "127.0.0.1", port)
    assert endpoint is not None
    try:
        samples = scrape(endpoint.port)
    finally:
        endpoint.stop()
    names = {name for name, _ in samples}
    assert {"kvrelay_decode_kv_reserved_bytes", "kvrelay_decode_kv_allocated_bytes", "kvrelay_decode_requests_active",
            "process_cpu_seconds_total"} <= names
    assert not any(name.startswith(("kvrelay_gateway_", "kvrelay_prefill_")) for name in names)
    assert sample(samples, "kvrelay_decode_requests_waiting") == 0
    assert set(ROLE_FAMILIES) == {"gateway", "policy", "prefill", "decode"}
    with pytest.raises(ValueError, match="role"):
        registry_for("router")


def test_port_zero_is_off_and_a_taken_port_only_costs_the_metrics(caplog: pytest.LogCaptureFixture) -> None:
    assert serve_metrics("policy", "127.0.0.1", 0) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert serve_metrics("policy", "127.0.0.1", taken.getsockname()[1]) is None
    assert "runs without metrics" in caplog.text
