"""The policy service's client of a master named by Redis Sentinel (`redis+sentinel://`).

It is redis-py's own: `redis.asyncio.sentinel.Sentinel(...).master_for(name, ...)`, a plain
`Redis` whose connections ask the sentinels for the master's address when they connect. A
connection to a master that died fails; the retry reconnects, asks again, and once the
sentinels promoted a replica it lands there (until then they report the master down and the
call fails UNAVAILABLE: the client retries). Everything else is as for one Redis: the same
socket timeouts, retries with backoff and a pool of `redis_max_connections` that waits (up
to the socket timeout) for a free connection rather than failing, and WAIT-before-acknowledge
durability (`policy_service.durability`), whose WAIT goes on the connection that wrote.

Credentials: the URL's `user:password@` authenticate to the master and its replicas and, when
the URL carries a password, to the sentinels too (`sentinel_kwargs`): one password for the
whole deployment, as the common Helm charts set it up (sentinels with `requirepass`, each
other's `sentinel sentinel-pass`). A URL without a password talks to both without AUTH.
`rediss+sentinel://` is TLS to both, with the URL's query arguments (`ssl_ca_certs=...`) for
both. Sentinels are asked in turn, so a sentinel's own connection is not retried: the next
sentinel is the retry.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from policy_service.config import PolicyServiceConfig, SentinelUrl, parse_sentinel_url

# What parse_url returns that a sentinel URL says otherwise (hosts, database, scheme).
_NOT_FROM_QUERY = ("host", "port", "db", "path", "connection_class")


class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
    """A sentinel-managed pool (connections find the master through the sentinels) that,
    like the single client's BlockingConnectionPool, waits `timeout` seconds for a free
    connection when `max_connections` are in use rather than raising at once."""


def sentinel_client(url: str, config: PolicyServiceConfig, retry: Retry) -> Redis:
    """A client of the master that the sentinels of `url` name, with `config`'s limits."""
    target = parse_sentinel_url(url)
    timeouts: dict[str, Any] = {"socket_timeout": config.redis_timeout_s,
                                "socket_connect_timeout": config.redis_timeout_s}
    options = connection_options(target)
    sentinel_kwargs = {**timeouts, **options, "retry": Retry(NoBackoff(), 0)}
    if target.password is None:
        sentinel_kwargs.pop("username", None)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(
        target.master_name,
        connection_pool_class=BlockingSentinelConnectionPool,
        max_connections=config.redis_max_connections,
        timeout=config.redis_timeout_s,
        retry=retry,
        decode_responses=True,
        db=target.db,
        **timeouts,
        **options,
    )


def connection_options(target: SentinelUrl) -> dict[str, Any]:
    """Credentials, TLS and the query's arguments (parsed by redis-py as for a redis:// URL)."""
    options: dict[str, Any] = {}
    if target.query:
        parsed = parse_url(f"redis://localhost/0?{target.query}")
        options.update({key: value for key, value in parsed.items() if key not in _NOT_FROM_QUERY})
    if target.username is not None:
        options["username"] = target.username
    if target.password is not None:
        options["password"] = target.password
    if target.tls:
        options["ssl"] = True  # SentinelConnectionPool (and Redis, for sentinels) take TLS from it
    return options


async def close_sentinels(client: Redis) -> None:
    """Close the sentinel connections behind `client` (its own pool is closed with it)."""
    pool = client.connection_pool
    if isinstance(pool, SentinelConnectionPool):
        await pool.sentinel_manager.aclose()
