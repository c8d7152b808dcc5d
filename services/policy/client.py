"""Typed async client of the policy service, used by the gateway and the workers.

Every call has a deadline (`timeout_s`, covering all attempts). UNAVAILABLE is retried
with full-jitter exponential backoff up to `max_attempts` while the deadline allows;
then, like DEADLINE_EXCEEDED, it surfaces as `PolicyUnavailable`. Every other status comes
back as its typed error: `ManifestInvalid`, `ManifestDoesNotFit`, `RequestInvalid`, `NotFound`,
`ManifestConflict`, `StaleGeneration` / `RequestEnded` (with the current `Fence`).

Several policy-service replicas (stateless; one Redis behind them all) are one `target`:
comma-separated IP:port (gRPC's own `ipv4:`/`ipv6:` resolver) or one DNS name whose A
records name the replicas (`dns:///policy:50061`, e.g. a headless Kubernetes Service), with
gRPC's `round_robin` load balancing: calls spread over the replicas that are up, and a retry
after UNAVAILABLE goes to the next one. Retrying is safe for every call, also where the
first attempt took effect before its answer was lost:
- GetFence, GetManifest, ListManifests only read;
- PublishState of the same publication finds it current (`already_published`, same fence);
- EndRequest of an ended request answers it ended again;
- RegisterManifest of identical bytes finds them registered (`created` False);
- BeginRequest by the same identity begins the request once more with a higher generation:
  the first generation was never handed out, so no worker holds it, and the one returned is
  above it (fenced like any newer generation).

Those four per-request calls go over `PolicyService.Session` streams (`session_streams` per
client, `services.policy.session`): a message on an open stream costs a fraction of a unary
call. Each still has its own deadline and typed error; a client of a service without Session
makes unary calls. With `session_target` (the replicas' framed Session listeners,
`kvrelay serve policy --session-port`) those streams are connections without gRPC
(`services.policy.framed`): the same messages, deadlines, errors and retries, with the same
TLS and credentials, at a fraction of a gRPC message's cost.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.policy import wire
from services.policy.errors import (
    ManifestConflict,
    ManifestDoesNotFit,
    ManifestInvalid,
    NotFound,
    PolicyCallFailed,
    PolicyError,
    PolicyPermissionDenied,
    PolicyUnauthenticated,
    PolicyUnavailable,
    RequestEnded,
    RequestInvalid,
    StaleGeneration,
)
from services.policy.framed import FramedConnector, split_target
from services.policy.session import SessionFailure, Sessions
from services.policy.types import (
    Fence,
    ManifestRef,
    PublishResult,
    Registration,
    StatePublication,
    StoredManifest,
)
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2, policy_pb2_grpc
from services.rpc.readiness import ReadinessCheck
from services.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, client_channel_options
from services.security.roles import Role
from services.security.transport import TransportSecurity

Response = TypeVar("Response")
POLICY_SERVICE = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def grpc_target(target: str) -> str:
    """The gRPC target for `target`: one address (host:port, or a gRPC URI such as
    dns:///name:port) as it is, several comma-separated IP:port as gRPC's ipv4:/ipv6: list.
    ValueError naming `target` for a list that is not all IPv4 or all IPv6 literals."""
    addresses = [address.strip() for address in target.split(",")]
    if len(addresses) == 1:
        return addresses[0]
    versions = {_ip_version(address) for address in addresses}
    if versions == {4}:
        return "ipv4:" + ",".join(addresses)
    if versions == {6}:
        return "ipv6:" + ",".join(addresses)
    raise ValueError(f"target: {target[:200]!r}: several policy-service addresses must all be IPv4 or "
                     "all IPv6 ip:port; for names give one DNS name with a record per replica (dns:///name:port)")


def _ip_version(address: str) -> int | None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        return ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        return None


@dataclass(frozen=True)
class PolicyClientConfig:
    """`target` is host:port of a policy service, or of several replicas (see the module doc)."""

    target: str
    timeout_s: float = 2.0
    # Enough attempts to outlast gRPC's reconnect backoff (at most 1 s, `client_channel_options`)
    # after a replica restarts: their jittered delays add up to about 1 s (at most 2.2 s).
    max_attempts: int = 8
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 0.5
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    security: TransportSecurity = field(default_factory=TransportSecurity.local_plaintext)
    # Session streams the per-request calls (begin, publish, fence, end) share
    # (`services.policy.session`); 0: one unary call each, as before Session existed.
    session_streams: int = 2
    # Each stream is replaced after this long, so that streams spread over replicas added or
    # restarted since they opened (`services.policy.session`).
    session_max_age_s: float = 30.0
    # host:port of the framed Session listener of each replica (comma-separated, like
    # `target`); empty: the Session streams are gRPC calls on `target`'s channel.
    session_target: str = ""

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("target: must not be empty")
        grpc_target(self.target)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: {self.timeout_s} must be positive")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts: {self.max_attempts} must be >= 1")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("backoff_initial_s: must be positive and <= backoff_max_s")
        if not 0 <= self.session_streams <= 64:
            raise ValueError(f"session_streams: {self.session_streams} must be in [0, 64]")
        if self.session_max_age_s <= 0:
            raise ValueError(f"session_max_age_s: {self.session_max_age_s} must be positive")
        if self.session_target:
            split_target(self.session_target)


def backoff_delay(attempt: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Full-jitter exponential backoff before retry number `attempt` (0-based)."""
    return rng.uniform(0.0, min(max_s, initial_s * (2**attempt)))


def error_from_rpc(error: grpc.aio.AioRpcError) -> PolicyError:
    """The typed error for a failed call (ErrorDetail from the trailing metadata)."""
    detail = error_detail(error) or common_pb2.ErrorDetail(message=error.details() or "")
    if not detail.message:
        detail.message = error.details() or ""
    return error_from_status(error.code(), detail)


def error_from_status(code: grpc.StatusCode, detail: common_pb2.ErrorDetail) -> PolicyError:
    """The typed error for a call that ended with `code` and `detail` (unary or in a Session)."""
    message, field = detail.message, detail.field
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        if detail.reason == common_pb2.ERROR_REASON_MANIFEST_INVALID:
            return ManifestInvalid(message, field=field)
        return RequestInvalid(message, field=field)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(message, field=field)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return ManifestConflict(message, field=field)
    refused = detail.reason == common_pb2.ERROR_REASON_MANIFEST_INVALID
    if code == grpc.StatusCode.FAILED_PRECONDITION and refused:
        return ManifestDoesNotFit(message, field=field)
    if code == grpc.StatusCode.FAILED_PRECONDITION and detail.HasField("current"):
        stale = RequestEnded if detail.reason == common_pb2.ERROR_REASON_REQUEST_ENDED else StaleGeneration
        return stale(message, field=field, current=wire.fence_from_proto(detail.current))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return PolicyUnauthenticated(message, field=field)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PolicyPermissionDenied(message, field=field)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return PolicyUnavailable(f"{code.name}: {message}", field=field)
    return PolicyCallFailed(f"{code.name}: {message}", status=code, field=field)


class PolicyClient:
    """Async client; use `async with PolicyClient(config) as client:` or call `close()`."""

    def __init__(self, config: PolicyClientConfig, *, rng: random.Random | None = None) -> None:
        self.config = config
        self._channel = policy_channel(config)
        self._stub = policy_pb2_grpc.PolicyServiceStub(self._channel)
        self._rng = rng or random.Random()
        self._sessions = self._new_sessions(config) if config.session_streams else None

    def _new_sessions(self, config: PolicyClientConfig) -> Sessions:
        if config.session_target:
            connect = FramedConnector(config.session_target, config.security, connect_timeout_s=config.timeout_s,
                                      max_frame_bytes=config.max_message_bytes)
            # Each connection goes to the next replica itself: none waits for a channel.
            return Sessions(connect, config.session_streams, max_age_s=config.session_max_age_s, rng=self._rng,
                            channel_ready=lambda: True)
        return Sessions(self._stub.Session, config.session_streams, max_age_s=config.session_max_age_s,
                        rng=self._rng,
                        channel_ready=lambda: self._channel.get_state() == grpc.ChannelConnectivity.READY)

    async def __aenter__(self) -> PolicyClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._sessions is not None:
            await self._sessions.close()
        await self._channel.close()

    async def check_serving(self, *, timeout_s: float | None = None) -> str | None:
        """None if the policy service reports SERVING (its Redis is reachable), else why not:
        a readiness probe for the services that depend on it. UNAVAILABLE is retried within
        the deadline like any call: with several replicas the retry goes to one that is up, so
        one replica lost does not make every dependent service NOT_SERVING."""
        request = health_pb2.HealthCheckRequest(service=POLICY_SERVICE)
        try:
            reply = await self._call(health_pb2_grpc.HealthStub(self._channel).Check, request, timeout_s)
        except PolicyError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # Slow is not no: a readiness probe tolerates a few of these in a row.
                raise TimeoutError(f"policy service at {self.config.target}: no answer in time") from exc
            return f"policy service at {self.config.target}: {exc}"
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            return f"policy service at {self.config.target} reports {status}"
        return None

    def readiness_check(self, within_s: float) -> ReadinessCheck:
        """The "policy" readiness check of a service that needs this policy service, for probes
        bounded by `within_s`: the call gives up a little earlier, so a policy service that
        refuses is reported as refusing (not ready at once), one that is only slow as a
        timeout (`services.rpc.readiness` tolerates a few)."""
        return ReadinessCheck("policy", functools.partial(self.check_serving, timeout_s=0.8 * within_s))

    async def register_manifest(self, manifest_json: str | bytes, *, timeout_s: float | None = None) -> Registration:
        data = manifest_json.encode("utf-8") if isinstance(manifest_json, str) else manifest_json
        request = policy_pb2.RegisterManifestRequest(manifest_json=data)
        response = await self._call(self._stub.RegisterManifest, request, timeout_s)
        return Registration(ref=wire.ref_from_proto(response.ref), created=response.created)

    async def get_manifest(self, sha256: str, *, timeout_s: float | None = None) -> StoredManifest:
        response = await self._call(self._stub.GetManifest, policy_pb2.GetManifestRequest(sha256=sha256), timeout_s)
        return wire.manifest_from_proto(response.manifest)

    async def list_manifests(self, name: str = "", *, timeout_s: float | None = None) -> list[ManifestRef]:
        response = await self._call(self._stub.ListManifests, policy_pb2.ListManifestsRequest(name=name), timeout_s)
        return [wire.ref_from_proto(ref) for ref in response.manifests]

    async def begin_request(self, request_id: str, *, lease_ms: int = 0, timeout_s: float | None = None) -> Fence:
        request = policy_pb2.BeginRequestRequest(request_id=request_id, lease_ms=lease_ms)
        response = await self._call(self._stub.BeginRequest, request, timeout_s, "begin_request")
        return wire.fence_from_proto(response.fence)

    async def publish_state(
        self, publication: StatePublication, *, lease_ms: int = 0, timeout_s: float | None = None
    ) -> PublishResult:
        """Compare-and-publish; raises StaleGeneration carrying the current fence."""
        request = wire.publication_to_proto(publication, lease_ms)
        response = await self._call(self._stub.PublishState, request, timeout_s, "publish_state")
        return PublishResult(fence=wire.fence_from_proto(response.fence), already_published=response.already_published)

    async def get_fence(self, request_id: str, *, timeout_s: float | None = None) -> Fence:
        response = await self._call(self._stub.GetFence, policy_pb2.GetFenceRequest(request_id=request_id), timeout_s,
                                     "get_fence")
        return wire.fence_from_proto(response.fence)

    async def end_request(self, request_id: str, request_generation: int, *, timeout_s: float | None = None) -> Fence:
        request = policy_pb2.EndRequestRequest(request_id=request_id, request_generation=request_generation)
        response = await self._call(self._stub.EndRequest, request, timeout_s, "end_request")
        return wire.fence_from_proto(response.fence)

    async def _call(
        self, method: Callable[..., Awaitable[Response]], request: Any, timeout_s: float | None,
        session_call: str | None = None,
    ) -> Response:
        """`method(request)`, or the same call in a Session (`session_call`: its SessionCall
        field) while the service has them, retried on UNAVAILABLE within the deadline."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.config.timeout_s)
        attempt = 0
        while True:
            remaining = max(deadline - loop.time(), 0.001)
            sessions = self._sessions if session_call is not None else None
            try:
                if sessions is not None:
                    reply: Response = await sessions.call(session_call, request, remaining)  # type: ignore[arg-type]
                    return reply
                return await method(request, timeout=remaining)
            except grpc.aio.AioRpcError as exc:
                code, error = exc.code(), error_from_rpc(exc)
                cause: Exception = exc
            except SessionFailure as exc:
                if exc.stream_failed and exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    self._sessions = None  # a service from before Session: unary calls from now on
                    continue
                code, error, cause = exc.code, error_from_status(exc.code, exc.detail), exc
            delay = backoff_delay(attempt, self.config.backoff_initial_s, self.config.backoff_max_s, self._rng)
            attempt += 1
            retryable = code == grpc.StatusCode.UNAVAILABLE and attempt < self.config.max_attempts
            if not retryable or loop.time() + delay >= deadline:
                raise error from cause
            await asyncio.sleep(delay)


def policy_channel(config: PolicyClientConfig) -> grpc.aio.Channel:
    """A channel to the replicas `config.target` names, round robin over those up. Each
    address passes the transport's checks (plaintext only to loopback, unless allowed)."""
    options = [*client_channel_options(config.max_message_bytes),
               ("grpc.enable_retries", 0),  # retries are ours, bounded by the call deadline
               ("grpc.service_config", ROUND_ROBIN)]
    credentials, arguments = None, options
    for address in config.target.split(","):
        credentials, arguments = config.security.channel_arguments(address.strip(), Role.POLICY, options)
    target = grpc_target(config.target)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=arguments)
    return grpc.aio.secure_channel(target, credentials, options=arguments)
