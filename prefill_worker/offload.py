"""The offload stage: omitted rows -> offload tier, with page summaries (DESIGN §2 step 7).

    plan = offload_plan(manifest, source_k, source_v, positions)   # pure (services.offload.plan)
    offloaded = tier.hold(call, plan, state_generation)            # the store, or not

Per manifest mode, what a request's omitted rows become:

| mode                    | travels with the view     | stays here                          |
| ----------------------- | ------------------------- | ----------------------------------- |
| `omitted_irrecoverable` | nothing                   | nothing                             |
| `recallable_remote`     | page summaries            | the rows, in the `OffloadStore`     |
| `recallable_local`      | page summaries, the rows  | nothing                             |

A `recallable_remote` request whose rows the store refuses (full, or larger than the whole
store) degrades to `omitted_irrecoverable` for that request: nothing extra travels, the
descriptor says so (`offload_degraded`), and the refusal is counted and put on the span.

`OffloadTier` is the host-memory store plus what serves it: handoff ids (one per stored
state, what the decode worker names in Recall/RenewLease/Release) and the ways rows leave
it — `release` when a request ends, `expire` for leases that ran out, `fence` and
`release_request` for requests the policy service has moved on or ended (the OffloadService's
periodic sweep calls the last three).
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, replace

from prefill_worker.wire import PrefillCall
from services.kvpolicy.compress import Compressed
from services.kvpolicy.ledger import Ledger
from services.kvpolicy.manifest import RecoverabilityMode
from services.kvpolicy.packing import PackedKVView
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.state import KVPolicyState
from services.offload.plan import OffloadPlan
from services.offload.store import OffloadStore, OffloadStoreConfig, Refused, Stored, StoreKey
from services.telemetry import metrics
from services.telemetry.spans import annotate
from services.transfer import Sidecar

log = logging.getLogger(__name__)

IRRECOVERABLE = RecoverabilityMode.OMITTED_IRRECOVERABLE


@dataclass(frozen=True)
class Offloaded:
    """What happened to a request's omitted rows, as the send stage and the decode worker
    need it. `mode` is what the decode worker may do (degraded: irrecoverable); `sidecar`
    what travels after the view; `handoff_id` names the stored rows (remote only)."""

    mode: RecoverabilityMode = IRRECOVERABLE
    sidecar: Sidecar | None = None
    handoff_id: str = ""
    lease_ms: int = 0
    degraded: str = ""

    def ledger(self, ledger: Ledger) -> Ledger:
        """`ledger` charged with what travels besides the view (summaries, host-tier rows)."""
        if self.sidecar is None:
            return ledger
        return self.sidecar.charge(ledger)


NOT_OFFLOADED = Offloaded()


@dataclass(frozen=True)
class Packed:
    """A compressed prompt after the offload stage: the packed view and everything bound to it
    (the state it realizes, its receipt), its ledger charged with what travels besides the
    view, and where its omitted rows went. What the send stage moves."""

    view: PackedKVView
    state: KVPolicyState
    receipt: Receipt
    ledger: Ledger
    offload: Offloaded = NOT_OFFLOADED

    @classmethod
    def of(cls, compressed: Compressed, offload: Offloaded = NOT_OFFLOADED) -> Packed:
        ledger = offload.ledger(compressed.ledger)
        return cls(compressed.view, compressed.state, compressed.receipt, ledger, offload)


class UnknownHandoff(LookupError):
    """No stored state has this handoff id (never stored, released, expired or evicted)."""


@dataclass(frozen=True)
class Held:
    """One stored state: its store key, the `[L][H_owner]` grid its pages index, and the
    rendezvous store of the decode worker its view went to (the only place recalled rows
    may go over a pair group; empty until the send stage knows it)."""

    key: StoreKey
    num_layers: int
    num_owners: int
    decode_rendezvous: str = ""


class OffloadTier:
    """This worker's offload store and the handoff ids that name its entries. `address` is
    where decode workers call its OffloadService (host:port, set once the server is bound).
    Thread-safe."""

    def __init__(self, config: OffloadStoreConfig | None, address: str = "") -> None:
        self.store = OffloadStore(config) if config is not None else None
        self.address = address
        self._lock = threading.Lock()
        self._handoffs: dict[str, Held] = {}

    @property
    def serves_remote(self) -> bool:
        """Whether `recallable_remote` manifests can be served (a store is configured)."""
        return self.store is not None

    @property
    def lease_ms(self) -> int:
        return int(self.store.config.lease_s * 1000) if self.store is not None else 0

    def hold(self, call: PrefillCall, plan: OffloadPlan | None, state_generation: int) -> Offloaded:
        """Where the omitted rows of a request go; stores them for `recallable_remote`."""
        if plan is None:
            return NOT_OFFLOADED
        if plan.mode is RecoverabilityMode.RECALLABLE_LOCAL:
            return Offloaded(plan.mode, Sidecar(plan.summaries, plan.rows))
        assert self.store is not None, "ManifestCache admits recallable_remote only with a store"
        key = StoreKey(call.request_id, call.request_generation, state_generation)
        result = self.store.put(key, plan.rows)
        self._forget(*(result.evicted if isinstance(result, Stored) else ()), cause="evicted")
        if isinstance(result, Refused):
            return self._refused(result)
        handoff_id = uuid.uuid4().hex
        summaries = plan.summaries
        with self._lock:
            self._handoffs[handoff_id] = Held(key, summaries.num_layers, summaries.num_owners)
        annotate(offload_bytes=result.nbytes, handoff_id=handoff_id)
        return Offloaded(plan.mode, Sidecar(plan.summaries), handoff_id, self.lease_ms)

    def held(self, handoff_id: str) -> Held:
        """The stored state a handoff id names; UnknownHandoff when it names none."""
        with self._lock:
            held = self._handoffs.get(handoff_id)
        if held is None:
            raise UnknownHandoff(handoff_id)
        return held

    def bind_decode(self, handoff_id: str, rendezvous_address: str) -> None:
        """Record the decode worker (its rendezvous store) that receives the handoff's view."""
        with self._lock:
            held = self._handoffs.get(handoff_id)
            if held is not None:
                self._handoffs[handoff_id] = replace(held, decode_rendezvous=rendezvous_address)

    def release(self, handoff_id: str, cause: str) -> int:
        """Drop the rows a handoff names (idempotent); returns the bytes freed."""
        try:
            key = self.held(handoff_id).key
        except UnknownHandoff:
            return 0
        return self._release_generation(key, cause)

    def release_request(self, request_id: str, cause: str) -> int:
        """Drop every stored state of a request (it ended, or failed before its handoff)."""
        if self.store is None:
            return 0
        freed = self.store.release(request_id)
        with self._lock:
            gone = [h for h, held in self._handoffs.items() if held.key.request_id == request_id]
            for handoff_id in gone:
                del self._handoffs[handoff_id]
        if gone:
            metrics.OFFLOAD_RELEASED.labels(cause).inc(len(gone))
        return freed

    def fence(self, request_id: str, current_generation: int) -> int:
        """The policy service moved the request to `current_generation`: older rows go."""
        if self.store is None:
            return 0
        freed = self.store.fence(request_id, current_generation)
        with self._lock:
            stale = [h for h, held in self._handoffs.items()
                     if held.key.request_id == request_id and held.key.request_generation < current_generation]
            for handoff_id in stale:
                del self._handoffs[handoff_id]
        if stale:
            metrics.OFFLOAD_RELEASED.labels("fenced").inc(len(stale))
        return freed

    def expire(self) -> int:
        """Drop entries whose lease ran out, and the handoff ids of entries the store no longer
        holds (expired here or inside another store call); returns how many went."""
        if self.store is None:
            return 0
        self.store.expire()
        held = set(self.store.keys())
        gone = [key for key in self._keys() if key not in held]
        self._forget(*gone, cause="expired")
        return len(gone)

    def held_requests(self) -> dict[str, int]:
        """Request id -> the newest request generation held, for the fence sweep."""
        newest: dict[str, int] = {}
        for key in self._keys():
            newest[key.request_id] = max(newest.get(key.request_id, 0), key.request_generation)
        return newest

    def _release_generation(self, key: StoreKey, cause: str) -> int:
        assert self.store is not None  # a handoff id exists only with a store
        newer = any(
            k.request_id == key.request_id and k.request_generation > key.request_generation
            for k in self._keys()
        )
        freed = (
            self.store.fence(key.request_id, key.request_generation + 1)
            if newer
            else self.store.release(key.request_id)
        )
        self._forget(key, cause=cause)
        return freed

    def _refused(self, refused: Refused) -> Offloaded:
        metrics.OFFLOAD_REFUSALS.labels(refused.reason.value).inc()
        annotate(offload_refused=refused.reason.value, offload_bytes=refused.nbytes)
        log.warning(
            "offload store refused %s (%d bytes, %d of %d used): %s; the request continues as %s",
            refused.key, refused.nbytes, refused.used_bytes, refused.capacity_bytes,
            refused.reason.value, IRRECOVERABLE.value,
        )
        return Offloaded(degraded=f"offload_refused:{refused.reason.value}")

    def _keys(self) -> list[StoreKey]:
        with self._lock:
            return [held.key for held in self._handoffs.values()]

    def _forget(self, *keys: StoreKey, cause: str) -> None:
        if not keys:
            return
        wanted = set(keys)
        with self._lock:
            gone = [h for h, held in self._handoffs.items() if held.key in wanted]
            for handoff_id in gone:
                del self._handoffs[handoff_id]
        if gone:
            metrics.OFFLOAD_RELEASED.labels(cause).inc(len(gone))
