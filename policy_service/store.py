"""Manifests and generation fences in Redis (one Redis >= 6.2, or a Redis Cluster). Every
mutation is one Lua script, and every script touches keys of ONE hash slot, so each runs
atomically on whichever cluster node owns that slot.

Key schema (prefix configurable, default `kvr:`; `{...}` is the Redis Cluster hash tag):

| key                          | type   | content                                                  |
| ---------------------------- | ------ | -------------------------------------------------------- |
| `{kvr:registry}:manifest:SHA`| string | canonical JSON, set once, never expires                  |
| `{kvr:registry}:policy:NAME` | hash   | policy_generation -> sha                                 |
| `{kvr:registry}:manifests`   | hash   | sha -> "{policy_generation}:{name}" (list and look-up)   |
| `{kvr:registry}:epoch`       | string | random token; gone = Redis lost the registry (recovery.py)|
| `kvr:req:{REQUEST_ID}`       | hash   | request_generation, state_generation, cache_generation,  |
|                              |        | receipt_digest, manifest_sha, phase, prefill, decode,    |
|                              |        | updated_at (Redis clock, ms), owner; PEXPIRE = the lease |
| `kvr:gen:{REQUEST_ID}`       | string | the request id's high-water generation (see below)       |

Slots. The registry (manifests, their indexes, the epoch) shares one slot: registration
writes three of its keys in one script, and the epoch sits with what it witnesses, so a
cluster node that loses the registry loses the epoch too and recovery puts the manifests
back. A request's two keys share the slot of its request id, so requests spread over the
whole cluster and there is no hot key. PublishState names a manifest that lives in the
registry's slot, so the script no longer checks it; the store checks it first with one
EXISTS, remembered per process (`_present`) because a manifest is content-addressed and never
deleted: only a loss of data takes it away, and recovery forgets what it remembered when the
epoch changes (`forget_present`). What this gives up: a manifest lost after this process
checked it is not noticed by its next publishes, only by the recovery loop (the epoch went
with it: same slot), which writes it back from the archive within `recovery_interval_s`;
reads (GetManifest, ListManifests) that miss it write it back at once. Manifests are read from any node
through the cluster client, which sends each key to the node owning its slot.

Request generations, without a global counter. BeginRequest gives
  g = max(TIME_us, live request's generation + 1, high-water + 1, caller's floor)
and writes g to the request hash and to the high-water key `gen:{id}`, whose expiry is set as
an absolute instant on Redis's clock: g/1000 ms + `high_water_margin_ms`. Why g is above every
generation issued before for this request id, by case:
  1. the request key is alive (begun again, or ended within its retention): g > its
     generation, read in the same atomic script;
  2. the request key expired (or was ended and dropped) but the high-water key is alive:
     g > high-water, which is the largest generation ever issued for this id (each begin
     writes its own g, the maximum so far, there);
  3. both expired: Redis drops the high-water key only once ITS clock is past g_last + margin,
     so TIME_us now > g_last. A clock that stepped back before that expiry only keeps the key
     longer; this case fails only if the clock steps back by more than the margin AFTER the
     key expired, and then the caller's floor (this service process's high-water mark, above
     every generation it handed out) still holds for what this process issued;
  4. Redis lost its data (restart without persistence, FLUSHALL, eviction, a failover to a
     replica that had not received the write): both keys are gone before their time, so this
     case relies on TIME alone: g stays within microseconds of TIME at issue (it runs ahead
     only by begins that land in the same microsecond), so a clock that did not step back
     below the issue instants gives g > g_last; the caller's floor covers a clock that did,
     for this process's generations.
Generations are microsecond timestamps (~1.8e15), exact in Lua's doubles below 2^53 (year
2255). Run Redis with `maxmemory-policy noeviction`: a `volatile-*` policy may evict a
high-water key early (case 4 then). Scripts are run with EVALSHA and reloaded on NOSCRIPT
(`policy_service.durability.ScriptRunner`, on the node that answered), so a restarted Redis
needs no warm-up. A retried script is harmless: publish and end are idempotent, and a retried
BeginRequest only advances the generation once more.

Failover. With `Durability(replicas=N)` a mutation is acknowledged only once N replicas of
its master have it (WAIT on the connection that wrote it; `policy_service.durability`), so a
replica promoted after the master died holds every acknowledged manifest, begin, publish and
end. A script's writes reach a replica as one MULTI/EXEC (effects replication), so a replica
holds all of a publish or none of it.

Redis may lose data the service owns. Manifests: every one stored is kept in the
`ManifestArchive`, and a read that misses one the archive holds writes it back first
(`republish`), so a request never fails on a manifest Redis forgot. Request fences are not
restored: work of a request whose key is gone is answered NotFound, never continued. An end
that Redis could not take is kept in `PendingEnds` and retried (`retry_end`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis.exceptions
from redis.asyncio import Redis, RedisCluster

from policy_service.archive import ManifestArchive, parse_canonical
from policy_service.durability import Durability, NodeClient, ReplicationLagging, ScriptRunner
from policy_service.pending_ends import PendingEnd, PendingEnds
from services.echo import echo
from services.policy.errors import (
    ManifestConflict,
    NotFound,
    PolicyPermissionDenied,
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
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError)
# A cluster that cannot serve a slot now (CLUSTERDOWN while nodes fail or rejoin, TRYAGAIN
# during a resharding, no node known for the slot, redirections exhausted): unavailable too;
# the store re-raises them as ConnectionError so that the RPC edge answers UNAVAILABLE.
_CLUSTER_UNAVAILABLE = (
    redis.exceptions.ClusterError,  # includes ClusterDownError and MasterDownError
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
    # MOVED/ASK to a client of one node (a mutation sent with its WAIT to its slot's master,
    # policy_service.durability) after a failover moved the slot: it did not run there, and
    # the retry finds the new master. RedisCluster follows these itself.
    redis.exceptions.AskError,
)
REDIS_UNAVAILABLE = (*_UNREACHABLE, *_CLUSTER_UNAVAILABLE)
_MISSING_REQUEST = "(never begun, its lease expired, or the policy store lost it)"
_MAX_UNARCHIVABLE = 1024
_MAX_PRESENT = 4096
DEFAULT_HIGH_WATER_MARGIN_MS = 60_000
# A client of one Redis, or of a Redis Cluster (the store uses only what both offer).
RedisClient = Redis | RedisCluster


@dataclass(frozen=True)
class KeySchema:
    """Redis key names under one prefix (no braces in it: they would move the hash tag)."""

    prefix: str = "kvr:"

    def __post_init__(self) -> None:
        if not self.prefix or any(c in "{}" or c.isspace() for c in self.prefix):
            raise ValueError(f"prefix: {echo(self.prefix)} must be non-empty, without braces or whitespace")

    def _registry(self, name: str) -> str:
        return f"{{{self.prefix}registry}}:{name}"

    def manifest(self, sha256: str) -> str:
        return self._registry(f"manifest:{sha256}")

    def policy(self, name: str) -> str:
        return self._registry(f"policy:{name}")

    def manifest_index(self) -> str:
        return self._registry("manifests")

    def epoch(self) -> str:
        return self._registry("epoch")

    def request(self, request_id: str) -> str:
        return f"{self.prefix}req:{{{request_id}}}"

    def request_high_water(self, request_id: str) -> str:
        return f"{self.prefix}gen:{{{request_id}}}"

    def begin_keys(self, request_id: str) -> tuple[str, str]:
        """KEYS of begin_request.lua (one slot: both tagged with the request id)."""
        return self.request(request_id), self.request_high_water(request_id)


class PolicyStore:
    """The policy service's state. `client` must decode responses (decode_responses=True).
    `archive` keeps every stored manifest to write back what Redis loses; `pending_ends`
    keeps the ends Redis could not take (both optional: without, nothing is kept).
    `high_water_margin_ms`: how long a request id's high-water key outlives the instant its
    generation stands for (the backward clock step it tolerates; see the module doc).
    `durability`: how many replicas must confirm a mutation before it is acknowledged
    (`node_client` makes a client of one cluster master, for its WAIT); `pipelining`:
    concurrent script calls go to Redis together (`policy_service.batching`)."""

    def __init__(
        self,
        client: RedisClient,
        keys: KeySchema | None = None,
        *,
        archive: ManifestArchive | None = None,
        pending_ends: PendingEnds | None = None,
        high_water_margin_ms: int = DEFAULT_HIGH_WATER_MARGIN_MS,
        durability: Durability | None = None,
        node_client: NodeClient | None = None,
        pipelining: bool = True,
    ) -> None:
        if high_water_margin_ms < 0:
            raise ValueError(f"high_water_margin_ms: {high_water_margin_ms} is negative")
        self.redis = client
        self.keys = keys or KeySchema()
        self.archive = archive
        self.pending_ends = pending_ends
        self.high_water_margin_ms = high_water_margin_ms
        self._present: set[str] = set()  # manifests seen in Redis since the last forget_present
        self.scripts = ScriptRunner(client, durability, node_client, pipelining)
        self._high_water = 0  # the largest request generation this service has handed out
        self._unarchivable: set[str] = set()  # index entries `mirror` found no valid manifest for
        # Called when a script finds Redis unreachable (the recovery loop checks at once).
        self.on_redis_error: Callable[[], None] | None = None
        self._undecodable_logged: set[tuple[str, str]] = set()

    async def _run(self, script: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        with self._answering():
            return await self.scripts.read(script, keys, args)

    async def _write(self, script: str, keys: Sequence[str], args: Sequence[str | int],
                     acknowledged: tuple[str, ...]) -> Any:
        """A mutation; a reply whose status is in `acknowledged` only once replicated as far
        as `durability` asks (else ReplicationLagging, UNAVAILABLE)."""
        with self._answering():
            return await self.scripts.write(script, keys, args, lambda reply: reply[0] in acknowledged)

    @contextlib.contextmanager
    def _answering(self, poke: bool = True) -> Iterator[None]:
        """Around a Redis call: when Redis cannot answer, poke `on_redis_error` (the recovery
        loop looks at once; not from the loop's own calls), and raise a cluster's
        can't-answer-now as ConnectionError."""
        try:
            yield
        except AttributeError as exc:
            if not (isinstance(self.redis, RedisCluster) and _torn_down_under_us(exc)):
                raise
            if poke and self.on_redis_error is not None:
                self.on_redis_error()
            raise redis.exceptions.ConnectionError("redis cluster connection closed while in use") from exc
        except (*REDIS_UNAVAILABLE, redis.exceptions.RedisClusterException) as exc:
            # A cluster client that found no node reachable raises RedisClusterException from
            # the connection error; without such a cause it is a usage error, not an outage.
            if isinstance(exc, redis.exceptions.RedisClusterException) and not isinstance(exc, REDIS_UNAVAILABLE) \
                    and not isinstance(exc.__cause__, REDIS_UNAVAILABLE):
                raise
            if poke and self.on_redis_error is not None:
                self.on_redis_error()
            if isinstance(exc, _UNREACHABLE):
                raise
            detail = f"redis cluster cannot answer: {type(exc).__name__}: {echo(str(exc), 200)}"
            raise redis.exceptions.ConnectionError(detail) from exc

    def forget_present(self) -> None:
        """Forget which manifests were seen in Redis (recovery: Redis lost its data)."""
        self._present.clear()

    async def _require_manifest(self, sha256: str) -> None:
        """NotFound unless Redis holds manifest `sha256` (written back from the archive first
        if Redis lost it). Remembered once seen: a manifest is never deleted by the service."""
        if sha256 in self._present:
            return
        with self._answering():
            held = await self.redis.exists(self.keys.manifest(sha256))
        if not held and not await self.republish(sha256):
            raise NotFound(f"no manifest {sha256}", field="manifest_sha256")
        self._seen(sha256)

    def _seen(self, sha256: str) -> None:
        if len(self._present) >= _MAX_PRESENT:
            self._present.clear()  # bounded: the next publishes check again
        self._present.add(sha256)

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
        status, holder = await self._write("register_manifest", keys, args, ("created", "exists"))
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
        with self._answering(poke=False):  # the recovery loop's own call
            return await self._mirror()

    async def _mirror(self) -> int:
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
        with self._answering(poke=False):
            value = await self.redis.get(self.keys.epoch())
        return _text(value) if value is not None else None

    async def claim_epoch(self, token: str) -> str:
        """Set the epoch to `token` unless another replica did first; returns the one in force."""
        with self._answering(poke=False):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(self.keys.epoch(), token, nx=True)
                pipe.get(self.keys.epoch())
                _, current = await pipe.execute()
        return _text(current)

    async def get_manifest(self, sha256: str) -> StoredManifest:
        try:
            return await self._get_manifest(sha256)
        except NotFound:
            if self.archive is None or self.archive.get(sha256) is None:
                raise
            # Read again whatever republish reports: the recovery loop (or another replica)
            # may have written it back meanwhile, so that this call created nothing.
            await self.republish(sha256)
        return await self._get_manifest(sha256)

    async def _get_manifest(self, sha256: str) -> StoredManifest:
        with self._answering():
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
        if self.archive is not None and len(refs) < self.archive.count(name):
            # Listed again even if republish created nothing: a concurrent write-back (the
            # recovery loop, another replica) may have restored them after the first read.
            await self.republish()
            refs = await self._list_manifests(name)
        return refs

    async def _list_manifests(self, name: str) -> list[ManifestRef]:
        """Every manifest, or those of one policy name, sorted by (name, policy_generation).
        An entry that does not decode into a valid ref (written by hand or by another build)
        is skipped, logged once and counted, so that it cannot break listing for everyone."""
        if name:
            key = self.keys.policy(name)
            with self._answering():
                by_generation = await self.redis.hgetall(key)
            entries = [(_text(sha), f"{_text(gen)}:{name}") for gen, sha in by_generation.items()]
        else:
            key = self.keys.manifest_index()
            with self._answering():
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

    async def begin_request(self, request_id: str, lease_ms: int, owner: str = "") -> Fence:
        """Begin (or begin again) `request_id` for `owner`, the identity that holds it until
        its key expires; PolicyPermissionDenied if another identity holds it."""
        args = (lease_ms, self._high_water + 1, owner, self.high_water_margin_ms)
        reply = await self._write("begin_request", self.keys.begin_keys(request_id), args, ("begun",))
        if reply[0] == "foreign":
            raise PolicyPermissionDenied(f"request {request_id!r} was begun by another identity",
                                         field="request_id")
        fence = fence_from_reply(request_id, reply)
        self._high_water = max(self._high_water, fence.request_generation)
        return fence

    async def publish_state(self, publication: StatePublication, lease_ms: int) -> PublishResult:
        """Compare-and-publish; raises StaleGeneration (with the current fence) on a mismatch,
        NotFound if the manifest is not registered (checked first: another hash slot)."""
        p = publication
        await self._require_manifest(p.manifest_sha256)
        keys = (self.keys.request(p.request_id),)
        args = (
            p.request_generation, p.parent_state_generation, p.state_generation, p.cache_generation,
            p.receipt_digest, p.manifest_sha256, p.phase.label, p.prefill_worker, p.decode_worker,
            lease_ms,
        )
        reply = await self._write("publish_state", keys, args, ("published", "already"))
        status = reply[0]
        if status == "missing":
            raise NotFound(f"no live request {p.request_id!r} {_MISSING_REQUEST}", field="request_id")
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

    async def end_request(self, request_id: str, request_generation: int, retention_ms: int,
                          owner: str = "") -> Fence:
        """Mark the request ended; if Redis cannot be reached, the end is also kept in
        `pending_ends` to be retried (`retry_end`) before the error goes to the caller."""
        try:
            return await self._end(request_id, request_generation, retention_ms, owner)
        except (*REDIS_UNAVAILABLE, ReplicationLagging):
            if self.pending_ends is not None:
                self.pending_ends.add(request_id, request_generation, retention_ms, owner)
            raise

    async def retry_end(self, end: PendingEnd) -> None:
        """One more try of a pending end; settled unless Redis is still unreachable (raises)."""
        with contextlib.suppress(NotFound, StaleGeneration, PolicyPermissionDenied):
            # NotFound: the key is gone; stale: a newer generation began; denied: it was never
            # the asker's to end. Nothing left to end.
            await self._end(end.request_id, end.request_generation, end.retention_ms, end.owner)
        if self.pending_ends is not None:
            self.pending_ends.settle(end)

    async def _end(self, request_id: str, request_generation: int, retention_ms: int, owner: str) -> Fence:
        reply = await self._write("end_request", (self.keys.request(request_id),),
                                  (request_generation, retention_ms, owner), ("ended", "already"))
        if reply[0] == "foreign":
            raise PolicyPermissionDenied(f"request {request_id!r} was begun by another identity",
                                         field="request_id")
        if reply[0] == "missing":
            raise NotFound(f"no live request {request_id!r} {_MISSING_REQUEST}", field="request_id")
        fence = fence_from_reply(request_id, reply)
        if reply[0] == "stale":
            message = f"{request_generation} is not the current request generation {fence.request_generation}"
            raise StaleGeneration(message, field="request_generation", current=fence)
        return fence


def _torn_down_under_us(exc: AttributeError) -> bool:
    """redis-py's asyncio cluster client (seen with 8.1) may close a connection that another
    task is still opening, when it re-reads the slot map after a node failed; that task then
    fails inside redis.asyncio.connection with AttributeError (its stream writer is gone). For
    the caller that is a lost connection like any other."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_globals.get("__name__") == "redis.asyncio.connection"


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
