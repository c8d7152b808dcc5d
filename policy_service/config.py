"""Configuration of one policy service process. CLI flags and environment variables fill it
at the entry point (`kvrelay serve policy`); nothing writes to it afterwards."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from services.kvpolicy.fit import Deployment
from services.policy.types import MAX_LEASE_MS
from services.redis_embedded import APPENDFSYNC_MODES
from services.rpc.server import ServerConfig

# `+cluster`: a Redis Cluster (redis-py's RedisCluster; the URL names one startup node).
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


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

    def __post_init__(self) -> None:
        if self.redis_url is not None:
            scheme = urlsplit(self.redis_url).scheme
            if scheme not in REDIS_SCHEMES:
                raise ValueError(f"redis_url: scheme {scheme!r} is not one of {REDIS_SCHEMES}")
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


def redact_url(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
