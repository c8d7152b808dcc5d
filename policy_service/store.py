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
| `kvr:epoch`                 | string | random token; gone = Redis lost its data (see recovery.py)|

Request generations come from one global counter, so a request id reused after its key
expired still gets a larger generation and older work stays fenced out. A counter that is
gone (a fresh or wiped Redis) restarts above every generation issued before (Redis's clock in
microseconds, or this service's high-water mark), so work from before the loss can never
match a request begun after it. Scripts are run with EVALSHA and reloaded on NOSCRIPT
(redis-py's `register_script`), so a restarted Redis needs no warm-up. A retried script is
harmless: publish and end are idempotent, and a retried BeginRequest only advances the
generation once more.

Redis may lose data the service owns. Manifests: every one stored is kept in the
`ManifestArchive`, and a read that misses one the archive holds writes it back first
(`republish`), so a request never fails on a manifest Redis forgot. Request fences are not
restored: work of a request whose key is gone is answered NotFound, never continued. An end
that Redis could not take is kept in `PendingEnds` and retried (`retry_end`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from redis.asyncio import Redis

from policy_service import lua
from policy_service.archive import ManifestArchive, parse_canonical
from policy_service.pending_ends import PendingEnd, PendingEnds
from services.echo import echo
from services.policy.errors import (
    ManifestConflict,
    NotFound,
    RequestEnded,
    RequestInvalid,
    StaleGeneration,
)
from services.policy.types import (
    Fence,
    ManifestRef,
    Phase,
    PublishResult,
    Registration,
    StatePublication,
    StoredManifest,
    check_manifest_ref,
)
from services.telemetry.metrics import POLICY_UNDECODABLE_ENTRIES

log = logging.getLogger(__name__)
# Redis could not be reached or could not answer (what services.rpc.errors maps to UNAVAILABLE).
REDIS_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError)
_MISSING_REQUEST = "(never begun, its lease expired, or the policy store lost it)"
_MAX_UNARCHIVABLE = 1024


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

    def epoch(self) -> str:
        return f"{self.prefix}epoch"


class PolicyStore:
    """The policy service's state. `client` must decode responses (decode_responses=True).
    `archive` keeps every stored manifest to write back what Redis loses; `pending_ends`
    keeps the ends Redis could not take (both optional: without, nothing is kept)."""

    def __init__(
        self,
        client: Redis,
        keys: KeySchema | None = None,
        *,
        archive: ManifestArchive | None = None,
        pending_ends: PendingEnds | None = None,
    ) -> None:
        self.redis = client
        self.keys = keys or KeySchema()
        self.archive = archive
        self.pending_ends = pending_ends
        self._scripts = {name: client.register_script(lua.load(name)) for name in lua.SCRIPT_NAMES}
        self._high_water = 0  # the largest request generation this service has handed out
        self._unarchivable: set[str] = set()  # index entries `mirror` found no valid manifest for
        # Called when a script finds Redis unreachable (the recovery loop checks at once).
        self.on_redis_error: Callable[[], None] | None = None
        self._undecodable_logged: set[tuple[str, str]] = set()

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        try:
            return await self._scripts[script](keys=list(keys), args=list(args))
        except REDIS_UNAVAILABLE:
            if self.on_redis_error is not None:
                self.on_redis_error()
            raise

    async def register_manifest(self, ref: ManifestRef, canonical_json: bytes) -> Registration:
        status, holder = await self._register(ref, canonical_json)
        if status == "conflict":
            raise ManifestConflict(
                f"({ref.name!r}, {ref.policy_generation}) already holds manifest {holder}",
                field="policy_generation",
            )
        if self.archive is not None:
            self.archive.remember(StoredManifest(ref, canonical_json))
        return Registration(ref=ref, created=status == "created")

    async def _register(self, ref: ManifestRef, canonical_json: bytes) -> tuple[str, str]:
        keys = (self.keys.manifest(ref.sha256), self.keys.policy(ref.name), self.keys.manifest_index())
        args = (ref.sha256, canonical_json.decode("utf-8"), ref.name, ref.policy_generation)
        status, holder = await self._run("register_manifest", keys, args)
        return status, holder

    async def republish(self, sha256: str | None = None) -> int:
        """Write archived manifests (all, or the one with `sha256`) back into Redis; returns how
        many it lacked. Idempotent; a (name, generation) that meanwhile holds another manifest
        keeps it (logged)."""
        if self.archive is None:
            return 0
        found = self.archive.get(sha256) if sha256 else None
        records = self.archive.manifests() if sha256 is None else [found] if found else []
        restored = 0
        for stored in records:
            status, holder = await self._register(stored.ref, stored.canonical_json)
            restored += status == "created"
            if status == "conflict":
                log.warning("manifest %s not restored: (%r, %d) now holds %s", stored.ref.sha256,
                            stored.ref.name, stored.ref.policy_generation, holder)
        if restored:
            log.warning("restored %d manifests that redis had lost", restored)
        return restored

    async def mirror(self) -> int:
        """Add the manifests Redis holds and the archive lacks (other replicas registered them)
        to the archive; returns how many. Cheap when nothing is new (one HLEN)."""
        if self.archive is None or self.archive.full:
            return 0
        if await self.redis.hlen(self.keys.manifest_index()) <= len(self.archive) + len(self._unarchivable):
            return 0
        shas = [_text(sha) for sha in await self.redis.hkeys(self.keys.manifest_index())]
        added = 0
        for sha in [sha for sha in shas if not self.archive.get(sha) and sha not in self._unarchivable]:
            text = await self.redis.get(self.keys.manifest(sha))
            stored = parse_canonical(_text(text).encode("utf-8")) if text else None
            if stored is not None and stored.ref.sha256 == sha:
                added += self.archive.remember(stored)
            elif len(self._unarchivable) < _MAX_UNARCHIVABLE:
                self._unarchivable.add(sha)  # not a valid manifest: not fetched again
        return added

    async def epoch(self) -> str | None:
        """The token of the data set Redis holds; None once Redis lost (or never had) it."""
        value = await self.redis.get(self.keys.epoch())
        return _text(value) if value is not None else None

    async def claim_epoch(self, token: str) -> str:
        """Set the epoch to `token` unless another replica did first; returns the one in force."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.epoch(), token, nx=True)
            pipe.get(self.keys.epoch())
            _, current = await pipe.execute()
        return _text(current)

    async def get_manifest(self, sha256: str) -> StoredManifest:
        try:
            return await self._get_manifest(sha256)
        except NotFound:
            if not await self.republish(sha256):
                raise
        return await self._get_manifest(sha256)

    async def _get_manifest(self, sha256: str) -> StoredManifest:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.manifest(sha256))
            pipe.hget(self.keys.manifest_index(), sha256)
            text, indexed = await pipe.execute()
        if text is None or indexed is None:
            raise NotFound(f"no manifest {sha256}", field="sha256")
        return StoredManifest(ref=_ref(sha256, indexed), canonical_json=text.encode("utf-8"))

    async def list_manifests(self, name: str = "") -> list[ManifestRef]:
        """Every manifest, or those of one policy name, sorted by (name, policy_generation);
        if the archive holds more than Redis does, it writes them back first."""
        refs = await self._list_manifests(name)
        if self.archive is not None and len(refs) < self.archive.count(name) and await self.republish():
            refs = await self._list_manifests(name)
        return refs

    async def _list_manifests(self, name: str) -> list[ManifestRef]:
        """Every manifest, or those of one policy name, sorted by (name, policy_generation).
        An entry that does not decode into a valid ref (written by hand or by another build)
        is skipped, logged once and counted, so that it cannot break listing for everyone."""
        if name:
            key = self.keys.policy(name)
            by_generation = await self.redis.hgetall(key)
            entries = [(_text(sha), f"{_text(gen)}:{name}") for gen, sha in by_generation.items()]
        else:
            key = self.keys.manifest_index()
            index = await self.redis.hgetall(key)
            entries = [(_text(sha), _text(indexed)) for sha, indexed in index.items()]
        refs = [ref for sha, indexed in entries if (ref := self._decoded(key, sha, indexed))]
        return sorted(refs, key=lambda r: (r.name, r.policy_generation))

    def _decoded(self, key: str, sha256: str, indexed: str) -> ManifestRef | None:
        try:
            ref = _ref(sha256, indexed)
            check_manifest_ref(ref)
            return ref
        except (ValueError, RequestInvalid) as exc:
            POLICY_UNDECODABLE_ENTRIES.inc()
            entry = (key, sha256)
            if entry not in self._undecodable_logged and len(self._undecodable_logged) < 1024:
                self._undecodable_logged.add(entry)
                log.error("skipping undecodable manifest entry %s[%s] = %s: %s",
                          key, echo(sha256), echo(indexed), echo(str(exc), 200))
            return None

    async def begin_request(self, request_id: str, lease_ms: int) -> Fence:
        keys = (self.keys.request(request_id), self.keys.request_generation_counter())
        reply = await self._run("begin_request", keys, (lease_ms, self._high_water + 1))
        fence = fence_from_reply(request_id, reply)
        self._high_water = max(self._high_water, fence.request_generation)
        return fence

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
        if reply[0] == "no_manifest" and await self.republish(p.manifest_sha256):
            reply = await self._run("publish_state", keys, args)
        status = reply[0]
        if status == "missing":
            raise NotFound(f"no live request {p.request_id!r} {_MISSING_REQUEST}", field="request_id")
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
            raise NotFound(f"no live request {request_id!r} {_MISSING_REQUEST}", field="request_id")
        return fence_from_reply(request_id, reply)

    async def end_request(self, request_id: str, request_generation: int, retention_ms: int) -> Fence:
        """Mark the request ended; if Redis cannot be reached, the end is also kept in
        `pending_ends` to be retried (`retry_end`) before the error goes to the caller."""
        try:
            return await self._end(request_id, request_generation, retention_ms)
        except REDIS_UNAVAILABLE:
            if self.pending_ends is not None:
                self.pending_ends.add(request_id, request_generation, retention_ms)
            raise

    async def retry_end(self, end: PendingEnd) -> None:
        """One more try of a pending end; settled unless Redis is still unreachable (raises)."""
        with contextlib.suppress(NotFound, StaleGeneration):
            # NotFound: the key is gone; stale: a newer generation began. Nothing left to end.
            await self._end(end.request_id, end.request_generation, end.retention_ms)
        if self.pending_ends is not None:
            self.pending_ends.settle(end)

    async def _end(self, request_id: str, request_generation: int, retention_ms: int) -> Fence:
        reply = await self._run("end_request", (self.keys.request(request_id),), (request_generation, retention_ms))
        if reply[0] == "missing":
            raise NotFound(f"no live request {request_id!r} {_MISSING_REQUEST}", field="request_id")
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
