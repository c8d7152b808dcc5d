"""Lifecycle of one policy service process: Redis (external or embedded), store, gRPC server.

`PolicyServer.start(config)` returns a serving instance; `stop()` drains gRPC, closes the
Redis pool and stops the embedded redis-server if it started one. `serve(config)` runs
until SIGINT/SIGTERM (what `kvrelay serve policy` calls).

Health is SERVING only while Redis answers and holds this service's manifests: the
`Recovery` loop (policy_service/recovery.py) restarts a dead embedded redis-server, writes
back the manifests a Redis that lost its data no longer has (from the `ManifestArchive`,
journaled if `manifest_journal` is set) and retries ends Redis could not take.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from collections.abc import Awaitable
from urllib.parse import urlsplit, urlunsplit

import redis.exceptions
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from policy_service.archive import ManifestArchive
from policy_service.config import (
    PolicyServiceConfig,
    is_cluster_url,
    is_sentinel_url,
    plain_redis_url,
    redact_url,
)
from policy_service.durability import Durability, NodeClient
from policy_service.framed import FramedListener
from policy_service.pending_ends import PendingEnds
from policy_service.recovery import Recovery
from policy_service.sentinel import close_sentinels, sentinel_client
from policy_service.service import SERVICE_NAME, PolicyServicer
from policy_service.store import KeySchema, PolicyStore, RedisClient
from services.redis_embedded import EmbeddedRedis, EmbeddedRedisConfig
from services.rpc.kvrelay.v1 import policy_pb2_grpc
from services.rpc.readiness import ReadinessCheck
from services.rpc.server import RpcServer, ServiceBinding, start_server

log = logging.getLogger(__name__)
MIN_REDIS_VERSION = (6, 2)


class PolicyStartupError(RuntimeError):
    """Redis could not be reached, refused our credentials, or is too old."""


def _retry(config: PolicyServiceConfig) -> Retry:
    return Retry(
        ExponentialBackoff(cap=config.redis_backoff_cap_s, base=config.redis_backoff_base_s),
        retries=config.redis_retries,
        supported_errors=(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError),
    )


def redis_client(url: str, config: PolicyServiceConfig) -> RedisClient:
    """An asyncio client for redis:// or rediss:// (user and password from the URL) with
    bounded retries and exponential backoff on connection errors and timeouts; for
    redis+cluster:// or rediss+cluster:// a RedisCluster (the same limits, per node); for
    redis+sentinel:// or rediss+sentinel:// the master its sentinels name (the same limits,
    policy_service.sentinel)."""
    retry = _retry(config)
    if is_sentinel_url(url):
        return sentinel_client(url, config, retry)
    if is_cluster_url(url):
        return RedisCluster.from_url(
            plain_redis_url(url),
            max_connections=config.redis_max_connections,
            socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            retry=retry,
            decode_responses=True,
        )
    return single_client(url, config, retry)


def single_client(url: str, config: PolicyServiceConfig, retry: Retry) -> Redis:
    """A client of one Redis (or of one cluster node) with a blocking pool of
    `redis_max_connections`."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=config.redis_max_connections,
        timeout=config.redis_timeout_s,
        socket_timeout=config.redis_timeout_s,
        socket_connect_timeout=config.redis_timeout_s,
        retry=retry,
        decode_responses=True,
    )
    return Redis(connection_pool=pool)


def node_client_factory(url: str, config: PolicyServiceConfig) -> NodeClient:
    """Makes plain clients of single cluster nodes, with the credentials and limits of the
    cluster URL `url` (a mutation WAITs on its slot's master: policy_service.durability)."""
    parts = urlsplit(plain_redis_url(url))
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""

    def make(host: str, port: int) -> Redis:
        node_url = urlunsplit(parts._replace(netloc=f"{credentials}{host}:{port}"))
        return single_client(node_url, config, _retry(config))

    return make


async def choose_durability(client: RedisClient, config: PolicyServiceConfig, embedded: bool) -> Durability:
    """What `redis_wait_replicas` asks, or by default 1 where Redis has replicas (on a
    cluster: any master), 0 for an embedded or replica-less Redis; warns when fewer replicas
    are connected than every mutation will wait for."""
    if isinstance(client, RedisCluster):
        connected = len(client.get_replicas())
    else:
        connected = int((await client.info("replication")).get("connected_slaves", 0))
    wanted = config.redis_wait_replicas
    replicas = wanted if wanted is not None else 0 if embedded else min(1, connected)
    if replicas > connected:
        log.warning("every mutation waits for %d redis replicas, %d connected now: they fail "
                    "UNAVAILABLE until enough are", replicas, connected)
    log.info("mutations acknowledged after %d redis replicas confirm them (at most %d ms)",
             replicas, config.redis_wait_timeout_ms)
    return Durability(replicas, config.redis_wait_timeout_ms)


async def check_redis(client: RedisClient, url: str) -> None:
    """Fail fast with a clear message on bad credentials, no server, Redis < 6.2, or a URL
    that says cluster (or not) when the server says otherwise."""
    where = redact_url(url)
    try:
        if isinstance(client, RedisCluster):
            await client.initialize()  # reads the slot map from the startup node
        info = await client.info("server")
    except redis.exceptions.AuthenticationError as exc:
        raise PolicyStartupError(f"redis at {where} refused authentication: {exc}") from exc
    except redis.exceptions.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise PolicyStartupError(f"redis at {where} refused authentication: {exc}") from exc
        raise
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise PolicyStartupError(f"redis at {where} is unreachable: {exc}") from exc
    except redis.exceptions.RedisClusterException as exc:  # no cluster there, or none reachable
        raise PolicyStartupError(f"redis cluster at {where} could not be used: {exc}") from exc
    if info.get("redis_mode") == "cluster" and not isinstance(client, RedisCluster):
        raise PolicyStartupError(f"redis at {where} is a cluster node: use a redis+cluster:// URL")
    if info.get("redis_mode") == "sentinel":  # a redis:// URL naming a sentinel's port
        raise PolicyStartupError(f"redis at {where} is a sentinel: use a redis+sentinel:// URL")
    version = tuple(int(part) for part in str(info["redis_version"]).split(".")[:2])
    if version < MIN_REDIS_VERSION:
        raise PolicyStartupError(f"redis at {where} is {info['redis_version']}; kvrelay needs >= 6.2")


class PolicyServer:
    """A running policy service."""

    def __init__(self, config: PolicyServiceConfig, rpc: RpcServer, client: RedisClient,
                 embedded: EmbeddedRedis | None, recovery: Recovery, servicer: PolicyServicer,
                 framed: FramedListener | None = None) -> None:
        self.config = config
        self.servicer = servicer
        self.rpc = rpc
        self.redis = client
        self.embedded = embedded
        self.recovery = recovery
        self.framed = framed

    @property
    def address(self) -> str:
        return self.rpc.address

    @property
    def session_address(self) -> str:
        """host:port of the framed Session listener ("" without one): a client's
        `session_target`."""
        if self.framed is None:
            return ""
        return dataclasses.replace(self.config.server, port=self.framed.port).bind_address

    @classmethod
    async def start(cls, config: PolicyServiceConfig) -> PolicyServer:
        embedded = None
        url = config.redis_url
        if url is None:
            embedded_config = EmbeddedRedisConfig(
                data_dir=config.redis_data_dir, appendfsync=config.redis_appendfsync
            )
            embedded = EmbeddedRedis(embedded_config)
            await asyncio.to_thread(embedded.start)
            url = embedded.url
        client = redis_client(url, config)
        recovery: Recovery | None = None
        framed: FramedListener | None = None
        try:
            await check_redis(client, url)
            store = policy_store(client, config, await choose_durability(client, config, embedded is not None),
                                 node_client_factory(url, config) if is_cluster_url(url) else None)
            recovery = Recovery(store, url, interval_s=config.recovery_interval_s, embedded=embedded)
            store.on_redis_error = recovery.poke
            await recovery.start()
            servicer = PolicyServicer(store, config)
            binding = ServiceBinding(
                SERVICE_NAME, lambda server: policy_pb2_grpc.add_PolicyServiceServicer_to_server(servicer, server)
            )
            if config.session_port is not None:  # listening before health says SERVING
                framed = FramedListener(servicer.sessions, config.server.security, config.server.max_message_bytes)
                await framed.start(config.server.host, config.session_port)
            rpc = await start_server(config.server, [binding], [ReadinessCheck("redis", recovery.problem)])
            recovery.on_change = rpc.readiness.evaluate
        except BaseException:
            if framed is not None:
                await framed.stop(0)
            if recovery is not None:
                await recovery.stop()
                await _closed("the scripts' Redis client", recovery.store.scripts.aclose())
            await _closed("the Redis client", close_client(client))
            if embedded is not None:
                await asyncio.to_thread(embedded.close)
            raise
        log.info("policy service on %s%s, redis %s", rpc.address,
                 f", framed sessions on port {framed.port}" if framed else "",
                 "embedded" if embedded else redact_url(url))
        return cls(config, rpc, client, embedded, recovery, servicer, framed)

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain gRPC (Session streams stop taking calls first: their clients move to another
        replica), close Redis connections, stop the embedded redis-server (AOF flushed)."""
        self.servicer.sessions.drain()
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        stops = [self.rpc.stop(grace), *([self.framed.stop(grace)] if self.framed is not None else [])]
        await asyncio.gather(*stops)
        await self.recovery.stop()
        await _closed("the scripts' Redis client", self.recovery.store.scripts.aclose())
        await _closed("the Redis client", close_client(self.redis))
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.close)


async def close_client(client: RedisClient) -> None:
    """Close the client and its connections (a cluster client owns one pool per node; a
    sentinel-managed one also has the sentinels' connections)."""
    if isinstance(client, RedisCluster):
        await client.aclose()
    else:
        await client.aclose(close_connection_pool=True)
        await close_sentinels(client)


async def _closed(what: str, closing: Awaitable[None]) -> None:
    """Await one close of a stop, which must go on to the next: redis-py gives each
    connection's close `socket_connect_timeout` to finish and raises TimeoutError past it (a
    loaded host), after the socket was closed. Raised, it left the embedded redis-server
    running."""
    try:
        await closing
    except (TimeoutError, OSError, redis.exceptions.RedisError) as exc:
        log.warning("closing %s: %s", what, exc)


def policy_store(client: RedisClient, config: PolicyServiceConfig, durable: Durability | None = None,
                 node_client: NodeClient | None = None) -> PolicyStore:
    """The store with its archive (journal read back), its pending ends (retried for as
    long as a request lease lasts: past that Redis drops the key anyway) and `durable`."""
    archive = ManifestArchive(config.manifest_journal)
    archive.load()
    pending = PendingEnds(deadline_s=config.default_lease_ms / 1000)
    return PolicyStore(client, KeySchema(config.key_prefix), archive=archive, pending_ends=pending,
                       durability=durable, node_client=node_client, pipelining=config.redis_pipelining)


async def serve(config: PolicyServiceConfig) -> None:
    """Run until SIGINT or SIGTERM, then stop cleanly."""
    server = await PolicyServer.start(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    framed = f", framed sessions on {server.session_address}" if server.framed else ""
    print(f"kvrelay policy service listening on {server.address}{framed}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
