"""Helpers shared by the policy service tests (imported by basename; tests have no packages)."""

from __future__ import annotations

import hashlib
import uuid

from policy_service.config import PolicyServiceConfig
from services.rpc.server import ServerConfig

# Where a test runs against both: one redis-server, and a three-master Redis Cluster.
BACKENDS = ("single", "cluster")


def service_config(redis_url: str, **overrides: object) -> PolicyServiceConfig:
    """A loopback service on a free port with a key prefix no other test uses."""
    values: dict[str, object] = {
        "server": ServerConfig(port=0, shutdown_grace_s=0.5),
        "redis_url": redis_url,
        "key_prefix": f"t{uuid.uuid4().hex[:12]}:",
    }
    values.update(overrides)
    return PolicyServiceConfig(**values)  # type: ignore[arg-type]


def digest(*parts: object) -> str:
    """A receipt-digest-shaped value (SHA-256 hex) derived from `parts`."""
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
