"""Worker discovery: where the prefill and decode workers are, which are healthy, which to pick.

A `WorkerSource` is a static list (`host:port,host:port`) or a DNS name
(`dns:///name:port`, e.g. a headless Kubernetes service that resolves to one address per pod).
A `WorkerPool` re-resolves it every `resolve_interval_s`, asks every endpoint's gRPC health
service every `health_interval_s`, and lends endpoints out: `pick` (pure) chooses the healthy
worker with the fewest outstanding requests; ties go to the one picked least recently, then to
listing order. A worker whose call failed is skipped until its next passing health check;
one that refuses or answers NOT_SERVING is unhealthy at once, one that only answers too late
after `unhealthy_after_timeouts` such checks in a row (busy is not gone).
A pool may cap each worker's outstanding requests (`max_outstanding`): while every healthy
worker is at the cap, a lease waits its turn (`services.gateway.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.admission import WaitQueue
from services.rpc.errors import Unavailable
from services.rpc.server import DEFAULT_MAX_MESSAGE_BYTES, client_channel_options
from services.security.roles import Role
from services.security.transport import TransportSecurity
from services.telemetry import metrics

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\],]+):(?P<port>\d{1,5})")
_DNS_PREFIXES = ("dns:///", "dns:")


class NoHealthyWorker(Unavailable):
    """No worker of a role is healthy right now."""


@dataclass(frozen=True)
class DiscoveryConfig:
    """How often worker addresses are re-resolved and health-checked, and how long one
    check may take."""

    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    resolve_interval_s: float = 30.0
    # Consecutive checks without an answer in time before a healthy worker counts as
    # unhealthy. A worker that answers no (NOT_SERVING) or cannot be reached (connection
    # refused, reset) is unhealthy at once; one that is only slow (a busy CPU decoding,
    # seen to miss a 1 s check under a full batch on 2 cores) keeps serving for that long.
    unhealthy_after_timeouts: int = 3

    def __post_init__(self) -> None:
        for name in ("health_interval_s", "health_timeout_s", "resolve_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: {getattr(self, name)} must be positive")
        if self.unhealthy_after_timeouts < 1:
            raise ValueError(
                f"unhealthy_after_timeouts: {self.unhealthy_after_timeouts} must be >= 1")


def split_host_port(address: str, field: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host without brackets, port); ValueError names `field`."""
    match = _HOST_PORT.fullmatch(address)
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{field}: {address!r} is not host:port")
    return match["host"].strip("[]"), int(match["port"])


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every distinct TCP address `host` resolves to, in resolver order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        address = join_host_port(str(sockaddr[0]), port)
        if address not in addresses:
            addresses.append(address)
    return addresses


@dataclass(frozen=True)
class WorkerSource:
    """Either a static list of addresses or one DNS name and port (never both)."""

    addresses: tuple[str, ...] = ()
    dns_host: str = ""
    dns_port: int = 0

    def __post_init__(self) -> None:
        if bool(self.addresses) == bool(self.dns_host):
            raise ValueError("workers: give either a list of host:port or one dns:///name:port")
        for address in self.addresses:
            split_host_port(address, "workers")
        if self.dns_host and not 0 < self.dns_port < 65536:
            raise ValueError(f"workers: port {self.dns_port} is not in (0, 65536)")

    @classmethod
    def parse(cls, spec: str, field: str = "workers") -> WorkerSource:
        """`host:port[,host:port...]` or `dns:///name:port` (also `dns:name:port`)."""
        spec = spec.strip()
        for prefix in _DNS_PREFIXES:
            if spec.startswith(prefix):
                host, port = split_host_port(spec[len(prefix):], field)
                return cls(dns_host=host, dns_port=port)
        addresses = tuple(part.strip() for part in spec.split(",") if part.strip())
        if not addresses:
            raise ValueError(f"{field}: no worker address given")
        for address in addresses:
            split_host_port(address, field)
        return cls(addresses=addresses)

    def __str__(self) -> str:
        if self.dns_host:
            return f"dns:///{join_host_port(self.dns_host, self.dns_port)}"
        return ",".join(self.addresses)

    async def resolve(self, resolver: Resolver = resolve_dns) -> tuple[str, ...]:
        if not self.dns_host:
            return self.addresses
        return tuple(await resolver(self.dns_host, self.dns_port))


@dataclass(frozen=True)
class Candidate:
    """What `pick` knows about one worker."""

    address: str
    healthy: bool
    outstanding: int
    last_pick: int


def pick(
    candidates: Sequence[Candidate], avoid: frozenset[str] = frozenset(), max_outstanding: int | None = None
) -> str | None:
    """The healthy worker with the fewest outstanding requests (fewer than `max_outstanding`,
    if given), preferring workers not in `avoid` (a retry avoids the worker that just failed,
    but falls back to it when it is the only one). Ties: least recently picked, then listing
    order. None if no healthy worker has room."""
    cap = max_outstanding
    healthy = [c for c in candidates if c.healthy and (cap is None or c.outstanding < cap)]
    preferred = [c for c in healthy if c.address not in avoid] or healthy
    if not preferred:
        return None
    return min(preferred, key=lambda c: (c.outstanding, c.last_pick)).address


class Endpoint:
    """One worker address: its channel and, owned by its pool, health and load."""

    def __init__(self, address: str, max_message_bytes: int, security: TransportSecurity,
                 peer: Role) -> None:
        self.address = address
        self.channel = security.aio_channel(
            address, peer, [*client_channel_options(max_message_bytes), ("grpc.enable_retries", 0)])
        self.healthy = False
        self.status = "not checked yet"  # what its last health check (or call) said
        self.timeouts = 0  # consecutive health checks without an answer in time
        self.outstanding = 0
        self.last_pick = 0
        self.retired = False

    def candidate(self) -> Candidate:
        return Candidate(self.address, self.healthy, self.outstanding, self.last_pick)


class WorkerPool:
    """The live set of one role's workers (e.g. role "decode", service
    "kvrelay.v1.DecodeWorker"). `start()` resolves and checks once before returning.
    `max_outstanding` caps each worker's leases (None: no cap); at most `max_waiting` leases
    wait for room."""

    def __init__(
        self,
        role: str,
        service: str,
        source: WorkerSource,
        config: DiscoveryConfig,
        *,
        resolver: Resolver = resolve_dns,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_outstanding: int | None = None,
        max_waiting: int = 1024,
        security: TransportSecurity | None = None,
    ) -> None:
        if max_outstanding is not None and max_outstanding < 1:
            raise ValueError(f"max_outstanding: {max_outstanding} must be >= 1 (or None)")
        self.role = role
        self.service = service
        self.source = source
        self.config = config
        self.max_outstanding = max_outstanding
        self._resolver = resolver
        self._max_message_bytes = max_message_bytes
        self._security = security or TransportSecurity.local_plaintext()
        self._peer = Role(role)
        self._endpoints: dict[str, Endpoint] = {}
        waiting = metrics.GATEWAY_WAITING.labels(role)
        self._queue: WaitQueue[Endpoint] = WaitQueue(max_waiting, on_waiting=waiting.set)
        self._picks = 0
        self._resolved_at = float("-inf")
        self._task: asyncio.Task[None] | None = None

    def candidates(self) -> list[Candidate]:
        return [endpoint.candidate() for endpoint in self._endpoints.values()]

    @property
    def waiting(self) -> int:
        """Leases waiting for a worker with room."""
        return self._queue.waiting

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._run(), name=f"{self.role}-discovery")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for endpoint in self._endpoints.values():
            await endpoint.channel.close()
        self._endpoints.clear()

    async def refresh(self) -> None:
        """Re-resolve when due, then health-check every endpoint concurrently."""
        if time.monotonic() - self._resolved_at >= self.config.resolve_interval_s:
            await self._resolve()
        endpoints = list(self._endpoints.values())
        results = await asyncio.gather(*(self._check(endpoint) for endpoint in endpoints))
        for endpoint, (answer, status) in zip(endpoints, results, strict=True):
            endpoint.timeouts = endpoint.timeouts + 1 if answer is None else 0
            endpoint.status = f"{status} ({endpoint.timeouts} in a row)" if answer is None else status
            if answer is None:  # slow, not gone: healthy until it misses too many in a row
                healthy = endpoint.healthy and endpoint.timeouts < self.config.unhealthy_after_timeouts
            else:
                healthy = answer
            if healthy != endpoint.healthy:
                log.info("%s worker %s is %s", self.role, endpoint.address, "healthy" if healthy else "unhealthy")
                self._queue.notify()  # a waiter may now find room, or learn that none is healthy
            endpoint.healthy = healthy

    async def check_any_healthy(self) -> str | None:
        """Readiness probe: None while at least one worker is healthy, else why not."""
        if any(c.healthy for c in self.candidates()):
            return None
        return f"no healthy {self.role} worker among {self.source} ({len(self._endpoints)} resolved)"

    def unhealthy_why(self) -> str:
        """What each worker's last check said, e.g. "127.0.0.1:41012 NOT_SERVING; ...": the
        detail of NoHealthyWorker, so an operator (or a failed test) sees why without logs."""
        return "; ".join(f"{e.address} {e.status}" for e in self._endpoints.values()) or "none resolved"

    def mark_failed(self, address: str) -> None:
        """Skip `address` until its next passing health check."""
        endpoint = self._endpoints.get(address)
        if endpoint is not None and endpoint.healthy:
            log.warning("%s worker %s failed a call; skipping it until it passes a health check", self.role, address)
            endpoint.healthy = False
            endpoint.status = "failed a call"
            self._queue.notify()

    @contextlib.asynccontextmanager
    async def lease(self, avoid: frozenset[str] = frozenset(), wait_s: float = 0.0) -> AsyncIterator[Endpoint]:
        """Lend the best worker with room for one request (outstanding until the block exits).
        With none healthy, one immediate health round runs before NoHealthyWorker; while every
        healthy one is at `max_outstanding`, the lease waits its turn up to `wait_s` (then
        WorkersBusy)."""
        if not any(c.healthy for c in self.candidates()):
            await self.refresh()
        endpoint = await self._queue.take(lambda: self._take(avoid), wait_s, self._busy)
        try:
            yield endpoint
        finally:
            endpoint.outstanding -= 1
            self._queue.notify()
            if endpoint.retired and endpoint.outstanding == 0:
                await endpoint.channel.close()

    def _take(self, avoid: frozenset[str]) -> Endpoint | None:
        candidates = self.candidates()
        if not any(c.healthy for c in candidates):
            raise NoHealthyWorker(f"no healthy {self.role} worker among {self.source} ({self.unhealthy_why()})")
        address = pick(candidates, avoid, self.max_outstanding)
        if address is None:
            return None
        endpoint = self._endpoints[address]
        self._picks += 1
        endpoint.outstanding += 1
        endpoint.last_pick = self._picks
        return endpoint

    def _busy(self) -> str:
        healthy = sum(c.healthy for c in self.candidates())
        cap = self.max_outstanding
        return f"all {healthy} healthy {self.role} workers had {cap} requests outstanding"

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.refresh()
            except Exception:  # a discovery round must never end the loop
                log.exception("%s discovery round failed", self.role)

    async def _resolve(self) -> None:
        try:
            addresses = await self.source.resolve(self._resolver)
        except OSError as exc:
            log.warning("resolving %s workers %s failed (keeping %d known): %s",
                        self.role, self.source, len(self._endpoints), exc)
            return
        self._resolved_at = time.monotonic()
        for address in addresses:
            if address not in self._endpoints:
                self._endpoints[address] = Endpoint(address, self._max_message_bytes, self._security, self._peer)
        for address in [a for a in self._endpoints if a not in addresses]:
            await self._retire(self._endpoints.pop(address))

    async def _retire(self, endpoint: Endpoint) -> None:
        log.info("%s worker %s no longer resolves; retiring it", self.role, endpoint.address)
        endpoint.retired = True
        if endpoint.outstanding == 0:
            await endpoint.channel.close()

    async def _check(self, endpoint: Endpoint) -> tuple[bool | None, str]:
        """(SERVING or not, None when no answer came within `health_timeout_s`; what it said)."""
        stub = health_pb2_grpc.HealthStub(endpoint.channel)
        request = health_pb2.HealthCheckRequest(service=self.service)
        timeout_s = self.config.health_timeout_s
        try:
            response = await stub.Check(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return None, f"no answer within {timeout_s:g} s"
            return False, f"{exc.code().name}: {(exc.details() or '')[:120]}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return response.status == health_pb2.HealthCheckResponse.SERVING, status
