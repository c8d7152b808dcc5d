"""The grpc.aio server bootstrap every kvrelay service uses.

One call, `start_server(config, bindings, readiness)`, gives a started server with the
services registered, gRPC health checking, server reflection, message size limits, and
SO_REUSEPORT off so two servers can never share a port by accident. Every bound service and
"" report SERVING while the `readiness` checks pass (`services.rpc.readiness`; re-evaluated
every `readiness_interval_s`) and NOT_SERVING until they do. Every call is counted and timed
(`services.telemetry.metrics`) and, when tracing is configured, continues the caller's trace
(`services.telemetry.tracing`). `RpcServer.stop()` flips health to NOT_SERVING before draining.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.rpc.readiness import Readiness, ReadinessCheck
from services.telemetry.metrics import RpcMetricsInterceptor
from services.telemetry.tracing import server_interceptors

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a service listens. `port=0` picks a free port."""

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace_s: float = 5.0
    readiness_interval_s: float = 2.0
    readiness_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not in [0, 65535]")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes: {self.max_message_bytes} must be positive")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s: {self.shutdown_grace_s} must be >= 0")
        if not 0 < self.readiness_timeout_s <= self.readiness_interval_s:
            raise ValueError(
                f"readiness_timeout_s: {self.readiness_timeout_s} must be positive and <= readiness_interval_s"
            )

    @property
    def bind_address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class ServiceBinding:
    """A service to host: its full proto name (e.g. "kvrelay.v1.PolicyService") and the
    generated `add_*Servicer_to_server` call bound to a servicer instance."""

    name: str
    register: Callable[[grpc.aio.Server], None]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for servers and channels: symmetric size limits, no implicit port sharing."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


class RpcServer:
    """A started server. `address` is host:port with the port actually bound."""

    def __init__(self, server: grpc.aio.Server, config: ServerConfig, port: int,
                 health_servicer: health.aio.HealthServicer, readiness: Readiness) -> None:
        self.server = server
        self.config = config
        self.port = port
        self.health = health_servicer
        self.readiness = readiness

    @property
    def address(self) -> str:
        return ServerConfig(self.config.host, self.port).bind_address

    async def stop(self, grace_s: float | None = None) -> None:
        """Report NOT_SERVING, then drain in-flight calls for up to `grace_s` seconds."""
        await self.readiness.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.shutdown_grace_s if grace_s is None else grace_s)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    config: ServerConfig, bindings: Sequence[ServiceBinding], readiness: Sequence[ReadinessCheck] = ()
) -> RpcServer:
    """Create, bind and start a grpc.aio server hosting `bindings` plus health and reflection;
    health reports SERVING once every `readiness` check passes (at once without checks)."""
    options = [*channel_options(config.max_message_bytes), ("grpc.so_reuseport", 0)]
    interceptors = [RpcMetricsInterceptor(), *server_interceptors()]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    for binding in bindings:
        binding.register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [binding.name for binding in bindings]
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = server.add_insecure_port(config.bind_address)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {config.bind_address}")
    ready = Readiness(health_servicer, names, readiness, interval_s=config.readiness_interval_s,
                      timeout_s=config.readiness_timeout_s)
    await ready.hold()
    await server.start()
    await ready.evaluate()
    ready.start()
    return RpcServer(server, config, port, health_servicer, ready)
