"""Configuration of one policy service process. CLI flags and environment variables fill it
at the entry point (`kvrelay serve policy`); nothing writes to it afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from services.kvpolicy.fit import Deployment
from services.policy.types import MAX_LEASE_MS
from services.redis_embedded import APPENDFSYNC_MODES
from services.rpc.server import ServerConfig

# `+cluster`: a Redis Cluster (redis-py's RedisCluster; the URL names one startup node).
# `+sentinel`: the master a set of Redis Sentinels names (redis-py's Sentinel.master_for):
# `redis+sentinel://[user:pass@]host:port[,host:port...]/<master-name>[/db]`.
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel",
                 "rediss+sentinel")
SENTINEL_PORT = 26379
_MAX_SENTINELS = 16


class RedisUrlInvalid(ValueError):
    """`redis_url` does not parse; the message names the field, never the password."""

    field = "redis_url"


@dataclass(frozen=True)
class SentinelUrl:
    """What a `redis+sentinel://` (`rediss+sentinel://`: TLS) URL names: the sentinels to ask,
    the master's name among them, the database, and the credentials of the master and its
    replicas (also sent to the sentinels: see `policy_service.sentinel`). `query`: the URL's
    query string, parsed by redis-py as for a redis:// URL (TLS options, for example)."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    query: str = ""


@dataclass(frozen=True)
class PolicyServiceConfig:
    """`redis_url=None` starts a private embedded redis-server (AOF on if `redis_data_dir`).

    `deployments`: what the workers behind this policy service run. A manifest that fits none
    of them (`services.kvpolicy.fit.check_fits`) is refused at registration with
    FAILED_PRECONDITION naming the field, so that it never becomes a policy's newest
    generation. Empty: every valid manifest is accepted (a policy service shared by tools, or
    one whose operator did not say what is served; it logs a warning at start-up).
    """

    server: ServerConfig = field(default_factory=lambda: ServerConfig(port=50061))
    redis_url: str | None = None
    redis_data_dir: Path | None = None
    redis_appendfsync: str = "everysec"
    key_prefix: str = "kvr:"
    default_lease_ms: int = 15 * 60 * 1000
    end_retention_ms: int = 60 * 1000
    max_manifest_bytes: int = 1024 * 1024
    # Redis connection: per-command socket timeout and bounded retries with backoff; the whole
    # retry budget stays well under a client's default 2 s deadline.
    redis_timeout_s: float = 0.5
    redis_retries: int = 3
    redis_backoff_base_s: float = 0.02
    redis_backoff_cap_s: float = 0.2
    redis_max_connections: int = 128
    # Acknowledge a mutation once this many replicas have it (WAIT; policy_service.durability).
    # None: 1 where the Redis (or every cluster master) has replicas at start-up, else 0 (an
    # embedded Redis has none). The wait stays under the socket timeout.
    redis_wait_replicas: int | None = None
    redis_wait_timeout_ms: int = 200
    # Send concurrent script calls together, as pipelines (policy_service.batching); False:
    # one round trip per call (the path before; kept for the bench's comparison).
    redis_pipelining: bool = True
    # Where manifests survive a Redis that lost its data (policy_service.archive): a journal
    # file (None: memory only, lost with the process), checked every `recovery_interval_s`.
    manifest_journal: Path | None = None
    recovery_interval_s: float = 1.0
    deployments: tuple[Deployment, ...] = ()
    # The framed Session listener's port on `server.host` (policy_service.framed): the
    # per-request calls without gRPC, with the server's TLS and tokens. None: no listener;
    # 0: a free port.
    session_port: int | None = None

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            scheme = _split(self.redis_url).scheme
            if scheme not in REDIS_SCHEMES:
                raise RedisUrlInvalid(f"redis_url: scheme {scheme!r} is not one of {REDIS_SCHEMES}")
            if is_sentinel_url(self.redis_url):
                parse_sentinel_url(self.redis_url)
        if self.redis_appendfsync not in APPENDFSYNC_MODES:
            raise ValueError(f"redis_appendfsync: {self.redis_appendfsync!r} is not one of {APPENDFSYNC_MODES}")
        if not self.key_prefix or any(c.isspace() or c in "{}" for c in self.key_prefix):
            raise ValueError("key_prefix: must be non-empty without whitespace or braces")
        for name in ("default_lease_ms", "end_retention_ms"):
            value = getattr(self, name)
            if not 0 < value <= MAX_LEASE_MS:
                raise ValueError(f"{name}: {value} is not in (0, {MAX_LEASE_MS}]")
        if not 0 < self.max_manifest_bytes < self.server.max_message_bytes:
            raise ValueError("max_manifest_bytes: must be positive and below server.max_message_bytes")
        if self.redis_timeout_s <= 0 or self.redis_retries < 0 or self.redis_max_connections < 1:
            raise ValueError("redis_timeout_s/redis_retries/redis_max_connections: out of range")
        if self.redis_wait_replicas is not None and not 0 <= self.redis_wait_replicas <= 16:
            raise ValueError(f"redis_wait_replicas: {self.redis_wait_replicas} is not in [0, 16]")
        if not 0 < self.redis_wait_timeout_ms < 1000 * self.redis_timeout_s:
            raise ValueError(f"redis_wait_timeout_ms: {self.redis_wait_timeout_ms} is not in "
                             f"(0, redis_timeout_s = {self.redis_timeout_s} s)")
        if not 0 < self.redis_backoff_base_s <= self.redis_backoff_cap_s:
            raise ValueError("redis_backoff_base_s: must be positive and <= redis_backoff_cap_s")
        if self.session_port is not None and not 0 <= self.session_port <= 65535:
            raise ValueError(f"session_port: {self.session_port} is not in [0, 65535]")
        if self.session_port and self.session_port == self.server.port:
            raise ValueError(f"session_port: {self.session_port} is the gRPC port too")
        if not 0 < self.recovery_interval_s <= 60:
            raise ValueError(f"recovery_interval_s: {self.recovery_interval_s} is not in (0, 60]")


def served_deployment(checkpoint: Path, dtype: str | None) -> Deployment:
    """The deployment of workers serving `checkpoint` (HF directory or `.gguf` file; config
    only, no weights) with K/V in `dtype` (default: the checkpoint's), as `--checkpoint` and
    `--dtype` say to every role. Offload stores are the prefill workers' own check."""
    # Imported here: the model runtime is only needed when a checkpoint is named.
    from services.model.config import make_tensor_contract, resolve_dtype
    from services.model.loader import read_checkpoint

    config = read_checkpoint(checkpoint).config
    return Deployment(make_tensor_contract(config, resolve_dtype(dtype, config.checkpoint_dtype)))


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
    return urlsplit(url).scheme.endswith("+cluster")


def plain_redis_url(url: str) -> str:
    """`url` with `+cluster` dropped from its scheme (what redis-py's from_url parses)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))


def _split(url: str) -> SplitResult:
    try:
        return urlsplit(url)
    except ValueError as exc:  # unbalanced [ ] around an IPv6 host
        raise RedisUrlInvalid(f"redis_url: does not parse ({exc})") from None


def is_sentinel_url(url: str) -> bool:
    """Whether `url` names a master through Redis Sentinel (`redis+sentinel://`,
    `rediss+sentinel://`)."""
    return _split(url).scheme.endswith("+sentinel")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of `redis+sentinel://[user:pass@]host[:port][,host[:port]...]/<master>[/db]`
    (port default 26379; IPv6 hosts in brackets); RedisUrlInvalid naming `redis_url` if it
    does not parse. urlsplit cannot read a netloc with several hosts, so it is split here."""
    parts = _split(url)
    if not is_sentinel_url(url):
        raise RedisUrlInvalid(f"redis_url: {parts.scheme!r} is not a +sentinel scheme")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if at else ("", "", "")
    sentinels = tuple(_sentinel_address(item) for item in hostlist.split(","))
    if len(sentinels) > _MAX_SENTINELS:
        raise RedisUrlInvalid(f"redis_url: {len(sentinels)} sentinels, at most {_MAX_SENTINELS}")
    segments = parts.path.strip("/").split("/") if parts.path.strip("/") else []
    if not 1 <= len(segments) <= 2 or not _is_master_name(unquote(segments[0])):
        raise RedisUrlInvalid("redis_url: the path must be /<master-name>[/db] (a sentinel URL "
                              "names its master; letters, digits, '.', '_', '-')")
    db = segments[1] if len(segments) == 2 else "0"
    if not db.isdigit() or int(db) > 65535:
        raise RedisUrlInvalid(f"redis_url: database {db[:20]!r} is not an integer in [0, 65535]")
    return SentinelUrl(sentinels, unquote(segments[0]), int(db), unquote(username) or None,
                       unquote(password) if at and password else None,
                       parts.scheme.startswith("rediss"), parts.query)


def _sentinel_address(item: str) -> tuple[str, int]:
    host, port = item, ""
    if item.startswith("["):  # [IPv6]:port
        host, bracket, rest = item[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise RedisUrlInvalid(f"redis_url: sentinel address {item[:80]!r} is malformed")
        port = rest[1:]
    elif ":" in item:
        host, _, port = item.rpartition(":")
    if not host or any(c.isspace() or c in "/?#@[]" for c in host):
        raise RedisUrlInvalid(f"redis_url: sentinel address {item[:80]!r} has no valid host")
    if port and not (port.isdigit() and 0 < int(port) <= 65535):
        raise RedisUrlInvalid(f"redis_url: sentinel address {item[:80]!r}: port is not in "
                              "[1, 65535]")
    return host, int(port) if port else SENTINEL_PORT


def _is_master_name(name: str) -> bool:
    return 0 < len(name) <= 128 and all(c.isalnum() or c in "._-" for c in name)


def redact_url(url: str) -> str:
    """The URL without its password (in the userinfo, or a `password` query argument, which
    redis-py also reads), for logs and error messages. The hosts are kept as written (a
    sentinel URL lists several, which urlsplit cannot parse)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a redis URL that does not parse)"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***@{hosts}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any("password" in key for key, _ in query):
        hidden = [(key, "***" if "password" in key else value) for key, value in query]
        parts = parts._replace(query=urlencode(hidden, safe="/*"))
    return urlunsplit(parts)
