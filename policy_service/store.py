"""Manifests and generation fences in Redis. Every mutation is one Lua script.

Key schema (prefix configurable, default `kvr:`; a single Redis >= 6.2, not a cluster):

| key                         | type   | content                                                   |
| --------------------------- | ------ | --------------------------------------------------------- |
| `kvr:manifest:{sha}`        | string | canonical JSON, set once, never expires                   |
| `kvr:policy:{name}`         | hash   | policy_generation -> sha                                  |
| `kvr:manifests`             | hash   | sha -> "{policy_generation}:{name}" (list and look-up)    |
| `kvr:req:{request_id}`      | hash   | request_generation, state_generation, cache_generation,   |
|                             |        | receipt_digest, manifest_sha, phase, prefill, decode,     |
|                             |        | updated_at (Redis clock, ms); PEXPIRE = the request lease |
| `kvr:seq:request_generation`| string | global counter that BeginRequest advances                 |

Request generations come from one global counter, so a request id reused after its key
expired still gets a larger generation and older work stays fenced out. Scripts are run
with EVALSHA and reloaded on NOSCRIPT (redis-py's `register_script`), so a restarted Redis
needs no warm-up. A retried script is harmless: publish and end are idempotent, and a
retried BeginRequest only advances the generation once more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from policy_service import lua
from services.policy.errors import ManifestConflict, NotFound, RequestEnded, StaleGeneration
from services.policy.types import (
    Fence,
    ManifestRef,
    Phase,
    PublishResult,
    Registration,
    StatePublication,
    StoredManifest,
)


@dataclass(frozen=True)
class KeySchema:
    """Redis key names under one prefix."""

    prefix: str = "kvr:"

    def manifest(self, sha256: str) -> str:
        return f"{self.prefix}manifest:{sha256}"

    def policy(self, name: str) -> str:
        return f"{self.prefix}policy:{name}"

    def manifest_index(self) -> str:
        return f"{self.prefix}manifests"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def request_generation_counter(self) -> str:
        return f"{self.prefix}seq:request_generation"


class PolicyStore:
    """The policy service's state. `client` must decode responses (decode_responses=True)."""

    def __init__(self, client: Redis, keys: KeySchema | None = None) -> None:
        self.redis = client
        self.keys = keys or KeySchema()
        self._scripts = {name: client.register_script(lua.load(name)) for name in lua.SCRIPT_NAMES}

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        return await self._scripts[script](keys=list(keys), args=list(args))

    async def register_manifest(self, ref: ManifestRef, canonical_json: bytes) -> Registration:
        keys = (self.keys.manifest(ref.sha256), self.keys.policy(ref.name), self.keys.manifest_index())
        args = (ref.sha256, canonical_json.decode("utf-8"), ref.name, ref.policy_generation)
        status, holder = await self._run("register_manifest", keys, args)
        if status == "conflict":
            raise ManifestConflict(
                f"({ref.name!r}, {ref.policy_generation}) already holds manifest {holder}",
                field="policy_generation",
            )
        return Registration(ref=ref, created=status == "created")

    async def get_manifest(self, sha256: str) -> StoredManifest:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.manifest(sha256))
            pipe.hget(self.keys.manifest_index(), sha256)
            text, indexed = await pipe.execute()
        if text is None or indexed is None:
            raise NotFound(f"no manifest {sha256}", field="sha256")
        return StoredManifest(ref=_ref(sha256, indexed), canonical_json=text.encode("utf-8"))

    async def list_manifests(self, name: str = "") -> list[ManifestRef]:
        """Every manifest, or those of one policy name, sorted by (name, policy_generation)."""
        if name:
            by_generation = await self.redis.hgetall(self.keys.policy(name))
            refs = [ManifestRef(_text(sha), name, int(gen)) for gen, sha in by_generation.items()]
        else:
            index = await self.redis.hgetall(self.keys.manifest_index())
            refs = [_ref(_text(sha), _text(indexed)) for sha, indexed in index.items()]
        return sorted(refs, key=lambda r: (r.name, r.policy_generation))

    async def begin_request(self, request_id: str, lease_ms: int) -> Fence:
        keys = (self.keys.request(request_id), self.keys.request_generation_counter())
        reply = await self._run("begin_request", keys, (lease_ms,))
        return fence_from_reply(request_id, reply)

    async def publish_state(self, publication: StatePublication, lease_ms: int) -> PublishResult:
        """Compare-and-publish; raises StaleGeneration (with the current fence) on a mismatch."""
        p = publication
        keys = (self.keys.request(p.request_id), self.keys.manifest(p.manifest_sha256))
        args = (
            p.request_generation, p.parent_state_generation, p.state_generation, p.cache_generation,
            p.receipt_digest, p.manifest_sha256, p.phase.label, p.prefill_worker, p.decode_worker,
            lease_ms,
        )
        reply = await self._run("publish_state", keys, args)
        status = reply[0]
        if status == "missing":
            raise NotFound(f"no live request {p.request_id!r} (never begun, or its lease expired)", field="request_id")
        if status == "no_manifest":
            raise NotFound(f"no manifest {p.manifest_sha256}", field="manifest_sha256")
        fence = fence_from_reply(p.request_id, reply)
        if status == "ended":
            raise RequestEnded("the request has ended", field="request_id", current=fence)
        if status == "stale":
            field, message = stale_reason(p, fence)
            raise StaleGeneration(message, field=field, current=fence)
        return PublishResult(fence=fence, already_published=status == "already")

    async def get_fence(self, request_id: str) -> Fence:
        reply = await self._run("get_fence", (self.keys.request(request_id),), ())
        if reply[0] == "missing":
            raise NotFound(f"no live request {request_id!r}", field="request_id")
        return fence_from_reply(request_id, reply)

    async def end_request(self, request_id: str, request_generation: int, retention_ms: int) -> Fence:
        reply = await self._run("end_request", (self.keys.request(request_id),), (request_generation, retention_ms))
        if reply[0] == "missing":
            raise NotFound(f"no live request {request_id!r}", field="request_id")
        fence = fence_from_reply(request_id, reply)
        if reply[0] == "stale":
            message = f"{request_generation} is not the current request generation {fence.request_generation}"
            raise StaleGeneration(message, field="request_generation", current=fence)
        return fence


def fence_from_reply(request_id: str, reply: Sequence[Any]) -> Fence:
    """Parse `{status, pttl, FENCE_FIELDS...}` from a script (see lua/prelude.lua)."""
    _, pttl, request_gen, state_gen, cache_gen, digest, manifest_sha, phase, prefill, decode, updated = reply
    return Fence(
        request_id=request_id,
        request_generation=int(request_gen),
        state_generation=int(state_gen),
        cache_generation=int(cache_gen),
        receipt_digest=digest,
        manifest_sha256=manifest_sha,
        phase=Phase.from_label(phase),
        prefill_worker=prefill,
        decode_worker=decode,
        updated_at_unix_ms=int(updated),
        lease_remaining_ms=int(pttl),
    )


def stale_reason(publication: StatePublication, current: Fence) -> tuple[str, str]:
    """Which field of a rejected publication is stale, and why (pure)."""
    p = publication
    if p.request_generation != current.request_generation:
        return "request_generation", (
            f"{p.request_generation} is not the current request generation {current.request_generation}"
        )
    if p.parent_state_generation != current.state_generation:
        if current.state_generation == p.state_generation:
            detail = f"state {p.state_generation} was already published with digest {current.receipt_digest}"
        else:
            detail = f"the current state generation is {current.state_generation}"
        return "parent_state_generation", f"parent {p.parent_state_generation} is not current: {detail}"
    return "cache_generation", (
        f"{p.cache_generation} is older than the current cache generation {current.cache_generation}"
    )


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _ref(sha256: str, indexed: str) -> ManifestRef:
    generation, name = indexed.split(":", 1)
    return ManifestRef(sha256=sha256, name=name, policy_generation=int(generation))
