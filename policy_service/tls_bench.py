"""`kvrelay bench policy --tls`: what mutual TLS costs the policy service, against plaintext.

In one run, against one Redis, the policy service runs as two processes side by side: one with
`--plaintext` and one with mutual TLS (a development CA and the default certificates, written
into a temporary directory by `default_bundle`). They are measured in turn, in ABBA order, so
that a drifting load on the machine does not favour either. The callers hold the identities
the design gives them: an operator registers the manifest, the gateway begins the requests,
and prefill workers publish PREFILLED states (the role checks a TLS service makes). For each
client count, closed-loop clients, each on its own channel, publish successive states of their
own request, `rounds` times per transport (ABBA), pooled: ops/s and p50/p99 per transport, and
mTLS/plaintext. The handshake: `handshake_channels` fresh channels (each with its own
subchannel pool, so none reuses a connection) time their first GetFence (connect + handshake +
call) and their second (the call alone); medians.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from policy_service.bench import (
    LEASE_MS,
    Measurement,
    ServicePublisher,
    bench_manifest,
    closed_loop,
    measurement,
)
from policy_service.processes import policy_service_process
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import EmbeddedRedis
from services.rpc.kvrelay.v1 import policy_pb2, policy_pb2_grpc
from services.security.certs import CA_CERT, default_bundle
from services.security.roles import Role
from services.security.transport import TransportSecurity

TRANSPORTS = ("plaintext", "mtls")
# A channel of its own subchannel pool opens its own connection (and so its own handshake)
# even while another channel to the same target with the same arguments is open.
FRESH_CONNECTION = ("grpc.use_local_subchannel_pool", 1)
CALL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TlsBenchConfig:
    """Which transports, client counts, rounds and measured seconds of each, handshake channels.
    `redis_url=None` starts an embedded redis-server (shared by both transports)."""

    transports: tuple[str, ...] = TRANSPORTS
    concurrency: tuple[int, ...] = (1, 16, 64)
    seconds: float = 2.0
    warmup_s: float = 0.3
    rounds: int = 3
    handshake_channels: int = 20
    redis_url: str | None = None
    key_prefix: str = "kvr-tls-bench:"

    def __post_init__(self) -> None:
        unknown = [t for t in self.transports if t not in TRANSPORTS]
        if not self.transports or unknown or len(set(self.transports)) != len(self.transports):
            raise ValueError(
                f"transports: {self.transports} must be distinct names of {TRANSPORTS}"
            )
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency: {self.concurrency} must be positive client counts")
        if self.seconds <= 0 or self.warmup_s < 0:
            raise ValueError("seconds/warmup_s: seconds must be positive, warmup non-negative")
        if not 1 <= self.rounds <= 100:
            raise ValueError(f"rounds: {self.rounds} must be in 1..100")
        if self.handshake_channels < 1:
            raise ValueError(f"handshake_channels: {self.handshake_channels} must be positive")


@dataclass(frozen=True)
class Identities:
    """The service's transport flags and how each kind of caller reaches it."""

    server_args: tuple[str, ...]
    operator: TransportSecurity = field(repr=False)
    gateway: TransportSecurity = field(repr=False)
    prefill: TransportSecurity = field(repr=False)

    @classmethod
    def for_transport(cls, transport: str, certs: Path) -> Identities:
        """Plaintext: `--plaintext` and anonymous callers. mTLS: the policy certificate and
        the operator's, gateway's and prefill worker's of the `default_bundle` in `certs`."""
        if transport == "plaintext":
            anonymous = TransportSecurity.local_plaintext()
            return cls(("--plaintext",), anonymous, anonymous, anonymous)
        ca = certs / CA_CERT

        def holder(name: str) -> TransportSecurity:
            return TransportSecurity.from_files(
                cert=certs / f"{name}.pem", key=certs / f"{name}.key", ca=ca
            )

        server = (
            "--tls-cert",
            str(certs / "policy.pem"),
            "--tls-key",
            str(certs / "policy.key"),
            "--tls-ca",
            str(ca),
        )
        return cls(server, holder("operator"), holder("gateway"), holder("prefill"))


@dataclass(frozen=True)
class Service:
    """One running policy service process of the run, and its callers' identities."""

    transport: str
    target: str
    identities: Identities
    manifest_sha: str
    request_id: str  # one the gateway began, that `first_call` reads


@dataclass(frozen=True)
class Handshake:
    """Medians over `channels` fresh channels: the first call (connect, handshake, call) and
    the second call on the same channel (the call alone)."""

    transport: str
    channels: int
    first_call_ms: float
    next_call_ms: float

    @property
    def connect_ms(self) -> float:
        """What a new channel costs beyond a call on an open one."""
        return self.first_call_ms - self.next_call_ms


LoopResult = tuple[int, float, list[float]]  # what `closed_loop` returns: calls, seconds, latencies


@dataclass(frozen=True)
class TlsBenchResult:
    throughput: tuple[Measurement, ...]  # PublishState; `path` is the transport
    handshakes: tuple[Handshake, ...]


def client(target: str, security: TransportSecurity) -> PolicyClient:
    return PolicyClient(PolicyClientConfig(target, timeout_s=CALL_TIMEOUT_S, security=security))


async def start_service(
    stack: contextlib.AsyncExitStack,
    config: TlsBenchConfig,
    redis_url: str,
    transport: str,
    certs: Path,
) -> Service:
    """The `transport` service process (stopped with `stack`), its manifest registered and one
    request begun for `first_call`."""
    identities = Identities.for_transport(transport, certs)
    target = await stack.enter_async_context(
        policy_service_process(
            redis_url, config.key_prefix, identities.server_args, identities.operator
        )
    )
    async with client(target, identities.operator) as operator:
        sha = (await operator.register_manifest(bench_manifest())).ref.sha256
    async with client(target, identities.gateway) as gateway:
        fence = await gateway.begin_request(
            f"tls-handshake-{transport}-{time.monotonic_ns()}", lease_ms=LEASE_MS
        )
    return Service(transport, target, identities, sha, fence.request_id)


async def publish_throughput(config: TlsBenchConfig, service: Service, clients: int) -> LoopResult:
    """`clients` prefill-identity clients publish states of requests the gateway began."""
    publishers = [client(service.target, service.identities.prefill) for _ in range(clients)]
    try:
        async with client(service.target, service.identities.gateway) as gateway:
            ids = [
                f"tls-{service.transport}-{clients}-{i}-{time.monotonic_ns()}"
                for i in range(clients)
            ]
            fences = [await gateway.begin_request(rid, lease_ms=LEASE_MS) for rid in ids]
        # Connected (and handshaken) before the clock starts: `first_call` measures that part.
        # One at a time: dozens of simultaneous TLS connects on a loaded host outlast the
        # connect timeout that `client_channel_options`' 100 ms minimum backoff implies.
        for publisher, rid in zip(publishers, ids, strict=True):
            await publisher.get_fence(rid)
        loops = [
            ServicePublisher(p, f.request_id, f.request_generation, service.manifest_sha)
            for p, f in zip(publishers, fences, strict=True)
        ]
        return await closed_loop(loops, config.seconds, config.warmup_s)
    finally:
        await asyncio.gather(*(p.close() for p in publishers))


def pooled(rounds: Sequence[LoopResult]) -> LoopResult:
    """The rounds of one transport and client count as one run: calls and seconds add up."""
    latencies = sorted(latency for _, _, round_latencies in rounds for latency in round_latencies)
    return sum(r[0] for r in rounds), sum(r[1] for r in rounds), latencies


async def first_call(
    target: str, security: TransportSecurity, request_id: str
) -> tuple[float, float]:
    """Seconds of the first and of the second GetFence on a new channel (a bare stub: the
    PolicyClient's retries would hide a failed connect in the first call's time)."""
    request = policy_pb2.GetFenceRequest(request_id=request_id)
    began = time.perf_counter()
    async with security.aio_channel(target, Role.POLICY, [FRESH_CONNECTION]) as channel:
        stub = policy_pb2_grpc.PolicyServiceStub(channel)
        await stub.GetFence(request, timeout=CALL_TIMEOUT_S)
        answered = time.perf_counter()
        await stub.GetFence(request, timeout=CALL_TIMEOUT_S)
        return answered - began, time.perf_counter() - answered


def alternating(services: Sequence[Service], index: int) -> Sequence[Service]:
    """ABBA order: neither transport always goes first while the machine's load drifts."""
    return services if index % 2 == 0 else services[::-1]


async def run_tls_bench(config: TlsBenchConfig) -> TlsBenchResult:
    """Every transport of `config` as its own service process, all up at once against the same
    Redis; measured in turn (ABBA) for each client count and each handshake channel."""
    throughput: list[Measurement] = []
    calls: dict[str, list[tuple[float, float]]] = {t: [] for t in config.transports}
    async with contextlib.AsyncExitStack() as stack:
        certs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvrelay-tls-bench-")))
        default_bundle(certs)
        redis_url = config.redis_url or await _embedded_redis(stack)
        services = [
            await start_service(stack, config, redis_url, t, certs) for t in config.transports
        ]
        for clients in config.concurrency:
            rounds: dict[str, list[LoopResult]] = {t: [] for t in config.transports}
            for index in range(config.rounds):
                for s in alternating(services, index):
                    rounds[s.transport].append(await publish_throughput(config, s, clients))
            throughput += [
                measurement("PublishState", t, clients, 1, pooled(r)) for t, r in rounds.items()
            ]
        for index in range(config.handshake_channels):
            for s in alternating(services, index):
                calls[s.transport].append(
                    await first_call(s.target, s.identities.gateway, s.request_id)
                )
    order = {t: i for i, t in enumerate(config.transports)}
    throughput.sort(key=lambda m: (order[m.path], m.clients))  # the table's order, not the run's
    handshakes = tuple(
        Handshake(
            t,
            len(timed),
            1000 * statistics.median(first for first, _ in timed),
            1000 * statistics.median(second for _, second in timed),
        )
        for t, timed in calls.items()
    )
    return TlsBenchResult(tuple(throughput), handshakes)


async def _embedded_redis(stack: contextlib.AsyncExitStack) -> str:
    embedded = EmbeddedRedis()
    await asyncio.to_thread(embedded.start)
    stack.push_async_callback(asyncio.to_thread, embedded.close)
    return embedded.url


def report_rows(result: TlsBenchResult) -> list[dict[str, object]]:
    """One row per client count: each transport's ops/s, p50, p99, and mtls/plaintext."""
    by_key = {(m.path, m.clients): m for m in result.throughput}
    rows: list[dict[str, object]] = []
    for clients in dict.fromkeys(m.clients for m in result.throughput):
        row: dict[str, object] = {"clients": clients}
        for transport in dict.fromkeys(m.path for m in result.throughput):
            m = by_key[(transport, clients)]
            row |= {
                f"{transport}_ops_per_s": round(m.ops_per_s),
                f"{transport}_p50_ms": round(m.p50_ms, 3),
                f"{transport}_p99_ms": round(m.p99_ms, 3),
            }
        plain, mtls = by_key.get(("plaintext", clients)), by_key.get(("mtls", clients))
        if plain is not None and mtls is not None:
            row |= {
                "mtls_over_plaintext_ops": round(mtls.ops_per_s / plain.ops_per_s, 3),
                "mtls_over_plaintext_p50": round(mtls.p50_ms / plain.p50_ms, 3),
            }
        rows.append(row)
    return rows


def render_markdown(config: TlsBenchConfig, result: TlsBenchResult, command: str, host: str) -> str:
    """The report: the throughput table, then the handshake table."""
    rows = report_rows(result)
    lines = [
        "# Policy service: mutual TLS vs plaintext",
        "",
        f"`{command}` ({host}); PublishState of PREFILLED states by prefill-identity clients, "
        "closed loop, one channel per client, connected before the clock starts; requests begun "
        f"by the gateway identity. Both services up side by side; per client count {config.rounds} "
        f"round(s) of {config.seconds:g} s per transport in ABBA order, pooled.",
        "",
        _table(rows),
        "",
        "## New channel: connect + handshake",
        "",
        "Median over fresh channels (own subchannel pool each) of the first GetFence "
        "(connect, TLS handshake, call) and the second on the same channel.",
        "",
        _table([_handshake_row(h) for h in result.handshakes]),
    ]
    by_transport = {h.transport: h for h in result.handshakes}
    if "plaintext" in by_transport and "mtls" in by_transport:
        plain, mtls = by_transport["plaintext"], by_transport["mtls"]
        lines += [
            "",
            f"mTLS/plaintext: first call {mtls.first_call_ms / plain.first_call_ms:.2f}x, "
            f"next call {mtls.next_call_ms / plain.next_call_ms:.2f}x; a new mTLS channel costs "
            f"{mtls.connect_ms - plain.connect_ms:.2f} ms more than a plaintext one.",
        ]
    return "\n".join(lines) + "\n"


def _handshake_row(h: Handshake) -> dict[str, object]:
    return {
        "transport": h.transport,
        "channels": h.channels,
        "first_call_ms": round(h.first_call_ms, 3),
        "next_call_ms": round(h.next_call_ms, 3),
        "connect_ms": round(h.connect_ms, 3),
    }


def _table(rows: Sequence[dict[str, object]]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    header = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join("---:" for _ in columns) + "|"
    body = ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join([header, rule, *body])


def write_plot(result: TlsBenchResult, path: Path) -> Path:
    """PublishState ops/s and p50 against client count, one line per transport (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ops, p50) = plt.subplots(1, 2, figsize=(10, 4))
    for transport in dict.fromkeys(m.path for m in result.throughput):
        points = sorted(
            (m for m in result.throughput if m.path == transport), key=lambda m: m.clients
        )
        clients = [m.clients for m in points]
        ops.plot(clients, [m.ops_per_s for m in points], marker="o", label=transport)
        p50.plot(clients, [m.p50_ms for m in points], marker="o", label=transport)
    for axes, label in ((ops, "PublishState ops/s"), (p50, "p50 latency (ms)")):
        axes.set(xscale="log", xlabel="concurrent clients", ylabel=label)
        axes.legend()
    figure.suptitle("policy service: mutual TLS vs plaintext")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
