"""The grpc.aio server bootstrap every kvrelay service uses.

One call, `start_server(config, bindings, readiness)`, gives a started server with the
services registered, gRPC health checking, server reflection, message size limits, and
SO_REUSEPORT off so two servers can never share a port by accident. Every bound service and
"" report SERVING while the `readiness` checks pass (`services.rpc.readiness`; re-evaluated
every `readiness_interval_s`) and NOT_SERVING until they do. Every call is counted and timed
(`services.telemetry.metrics`) and, when tracing is configured, continues the caller's trace
(`services.telemetry.tracing`). Requests are parsed inside the call (`RequestParsing`), so a
message that does not parse is INVALID_ARGUMENT naming what failed, not grpc's bare UNKNOWN.
`RpcServer.stop()` flips health to NOT_SERVING before draining.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.rpc.errors import abort_with, undecodable_request
from services.rpc.handlers import HandlerInterceptor, rewrap
from services.rpc.readiness import Readiness, ReadinessCheck
from services.security.access import Authorization
from services.security.transport import TransportSecurity
from services.telemetry.metrics import RpcMetricsInterceptor
from services.telemetry.tracing import server_interceptors

DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Where and how a service listens. `port=0` picks a free port."""

    host: str = "127.0.0.1"
    port: int = 0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace_s: float = 5.0
    readiness_interval_s: float = 2.0
    readiness_timeout_s: float = 1.0
    # TLS, client certificates and tokens; also what this process's clients present. The
    # default, plaintext on loopback, is for in-process tests; `kvrelay serve` asks for TLS.
    security: TransportSecurity = field(default_factory=TransportSecurity.local_plaintext)

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


def client_channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """`channel_options` plus fast reconnects, for channels to other kvrelay services: gRPC's
    default backoff starts at 1 s and grows 1.6x per failed attempt, so a peer that restarted
    stayed unreachable for seconds after it was back; here retries come within a second.
    gRPC's `min_reconnect_backoff_ms` is the minimum connect timeout, not a backoff: at 100 ms
    a connect plus TLS handshake on a loaded host was abandoned (119 of 256 concurrent mTLS
    connects failed), so it stays at seconds."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 5000),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class RequestParsing(HandlerInterceptor):
    """Hands each unary-request handler the raw bytes and parses them itself: grpc reports a
    request its deserializer rejects as UNKNOWN without a detail; here it is INVALID_ARGUMENT
    with the ErrorDetail of `services.rpc.errors.undecodable_request`."""

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        # Streams that yield (every kvrelay stream); health's Watch writes instead and is left as is.
        parsed = rewrap(handler, unary=functools.partial(_parsed_unary, parse),
                        stream=functools.partial(_parsed_stream, parse), keep_deserializer=False)
        return parsed if parsed is not None else handler


async def _parse(parse: Callable[[bytes], Any], data: bytes, context: grpc.aio.ServicerContext) -> Any:
    try:
        return parse(data)
    except DecodeError as exc:
        descriptor = getattr(getattr(parse, "__self__", None), "DESCRIPTOR", None)
        await abort_with(context, undecodable_request(descriptor, data, exc))


def _parsed_unary(
    parse: Callable[[bytes], Any], behavior: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Any]]:
    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await _parse(parse, data, context), context)

    return unary


def _parsed_stream(
    parse: Callable[[bytes], Any], behavior: Callable[..., AsyncGenerator[Any, None]]
) -> Callable[..., AsyncIterator[Any]]:
    async def stream(data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request = await _parse(parse, data, context)
        # Closed here when the caller closes this generator, in the call's own task and Context
        # (see services.telemetry.metrics: a generator left to the collector unwinds elsewhere).
        async with contextlib.aclosing(behavior(request, context)) as items:
            async for item in items:
                yield item

    return stream


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
    # Parsing is innermost, so that a request that does not parse is counted and traced too;
    # authorization comes before it: a caller without the right gets no parser's opinion.
    security = config.security
    authorization = [Authorization(security.tokens)] if security.authenticates else []
    if not security.authenticates:
        log.warning("%s: plaintext without tokens: every caller may call every method "
                    "(loopback development only)", config.bind_address)
    interceptors = [RpcMetricsInterceptor(), *server_interceptors(), *authorization, RequestParsing()]
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
    port = security.bind(server, config.bind_address, config.host)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {config.bind_address}")
    ready = Readiness(health_servicer, names, readiness, interval_s=config.readiness_interval_s,
                      timeout_s=config.readiness_timeout_s)
    await ready.hold()
    await server.start()
    await ready.evaluate()
    ready.start()
    return RpcServer(server, config, port, health_servicer, ready)
