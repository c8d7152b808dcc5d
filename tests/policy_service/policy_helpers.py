"""Helpers shared by the policy service tests (imported by basename; tests have no packages)."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from policy_service.config import PolicyServiceConfig
from services.policy import (
    NotFound,
    Phase,
    PolicyClient,
    RequestEnded,
    RequestInvalid,
    StaleGeneration,
    StatePublication,
)
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


def publication(request_id: str, generation: int, parent: int, sha: str, tag: object = "") -> StatePublication:
    return StatePublication(request_id, generation, parent, parent + 1, parent + 1,
                            digest(request_id, generation, parent + 1, tag), sha, Phase.PREFILLED)


async def lifecycle(client: PolicyClient, request_id: str, sha: str) -> list[object]:
    """Every per-request call and the errors a client meets, as values to compare."""
    seen: list[object] = []
    fence = await client.begin_request(request_id)
    seen.append((fence.request_generation > 0, fence.phase))  # generations come from the clock
    result = await client.publish_state(publication(request_id, fence.request_generation, 0, sha))
    seen.append((result.fence.state_generation, result.already_published))
    again = await client.publish_state(publication(request_id, fence.request_generation, 0, sha))
    seen.append((again.fence.state_generation, again.already_published))
    for bad in (publication(request_id, fence.request_generation, 0, sha, tag="other"),
                publication(request_id, fence.request_generation + 1, 1, sha)):
        with pytest.raises(StaleGeneration) as stale:
            await client.publish_state(bad)
        seen.append((type(stale.value).__name__, stale.value.field, stale.value.current.state_generation))
    with pytest.raises(RequestInvalid) as invalid:
        await client.get_fence("")
    seen.append(("RequestInvalid", invalid.value.field))
    with pytest.raises(NotFound) as missing:
        await client.get_fence(f"{request_id}-never-begun")
    seen.append(("NotFound", missing.value.field))
    ended = await client.end_request(request_id, fence.request_generation)
    seen.append((ended.ended, ended.state_generation))
    with pytest.raises(RequestEnded) as late:
        await client.publish_state(publication(request_id, fence.request_generation, 1, sha))
    seen.append((type(late.value).__name__, late.value.current.phase))
    return seen
