"""The host-memory offload store: omitted rows of recallable requests, bounded in bytes.

Entries are keyed by (request id, request generation, state generation) and hold the
`OmittedRows` of that state. Every entry carries a lease that the decode worker renews
while the request lives (`renew`; a `fetch` renews too). An entry leaves the store when
its request ends (`release`), its lease expires, its request generation is fenced out
(`fence`, or a `put` under a newer generation), or LRU eviction makes room for a new
entry. `put` never exceeds the byte bound: when an entry cannot fit it returns a typed
`Refused` and the caller degrades as the manifest declares. All methods are thread-safe;
the clock is injectable so tests can move time.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.offload.errors import StoreInvalid
from services.offload.pages import OmittedRows, PageRef, RecalledPage


class OnFull(StrEnum):
    EVICT_LRU = "evict_lru"  # evict least recently used entries to make room
    REFUSE = "refuse"  # keep every live entry; refuse the new one


class RefusalReason(StrEnum):
    LARGER_THAN_CAPACITY = "larger_than_capacity"
    STORE_FULL = "store_full"
    STALE_GENERATION = "stale_generation"


@dataclass(frozen=True)
class OffloadStoreConfig:
    """Byte bound, lease length and what a full store does."""

    capacity_bytes: int
    lease_s: float
    on_full: OnFull = OnFull.EVICT_LRU

    def __post_init__(self) -> None:
        if self.capacity_bytes < 1:
            raise StoreInvalid("capacity_bytes", f"must be positive, got {self.capacity_bytes}")
        if not self.lease_s > 0:
            raise StoreInvalid("lease_s", f"must be positive, got {self.lease_s}")
        allowed = [m.value for m in OnFull]
        if self.on_full not in allowed:
            raise StoreInvalid("on_full", f"{self.on_full!r} is not one of {allowed}")
        object.__setattr__(self, "on_full", OnFull(self.on_full))


@dataclass(frozen=True)
class StoreKey:
    request_id: str
    request_generation: int
    state_generation: int

    def __post_init__(self) -> None:
        if not self.request_id:
            raise StoreInvalid("request_id", "must not be empty")
        if self.request_generation < 1:
            raise StoreInvalid(
                "request_generation", f"must be >= 1, got {self.request_generation}"
            )
        if self.state_generation < 1:
            raise StoreInvalid("state_generation", f"must be >= 1, got {self.state_generation}")


@dataclass(frozen=True)
class Stored:
    """The entry is held until `lease_deadline` unless renewed; `evicted` made room for it."""

    key: StoreKey
    nbytes: int
    lease_deadline: float
    evicted: tuple[StoreKey, ...] = ()


@dataclass(frozen=True)
class Refused:
    """The entry was not stored; the request degrades as its manifest declares."""

    key: StoreKey
    nbytes: int
    reason: RefusalReason
    used_bytes: int
    capacity_bytes: int


PutResult = Stored | Refused


@dataclass(frozen=True)
class Fetched:
    """Rows of the asked pages the store holds, and the pages it no longer holds."""

    key: StoreKey
    pages: tuple[RecalledPage, ...]
    missing: tuple[PageRef, ...]

    @property
    def nbytes(self) -> int:
        return sum(page.nbytes for page in self.pages)

    @property
    def rows(self) -> int:
        return sum(int(page.positions.shape[0]) for page in self.pages)


@dataclass
class _Entry:
    rows: OmittedRows
    nbytes: int
    deadline: float


class OffloadStore:
    """Omitted rows per (request, request generation, state generation), LRU + lease, bounded."""

    def __init__(
        self, config: OffloadStoreConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[StoreKey, _Entry] = OrderedDict()  # least recent first
        self._floors: dict[str, int] = {}  # request id -> lowest request generation admitted
        self._used = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def keys(self) -> tuple[StoreKey, ...]:
        """Keys held now (expired leases excluded), least recently used first."""
        with self._lock:
            self._expire(self._clock())
            return tuple(self._entries)

    def put(self, key: StoreKey, rows: OmittedRows) -> PutResult:
        """Hold `rows` under `key` with a fresh lease, or refuse it.

        An older request generation than one already seen is refused as stale; a newer one
        fences out the request's older entries (stale whether or not this put succeeds).
        Re-putting a key replaces its entry. Under `evict_lru` the least recently used
        entries of other requests make room; otherwise, or when even that is not enough,
        the put is refused and every other entry stays.
        """
        with self._lock:
            now = self._clock()
            self._expire(now)
            if key.request_generation < self._floors.get(key.request_id, 0):
                return self._refuse(key, rows.nbytes, RefusalReason.STALE_GENERATION)
            self._fence(key.request_id, key.request_generation)
            if rows.nbytes > self.config.capacity_bytes:
                return self._refuse(key, rows.nbytes, RefusalReason.LARGER_THAN_CAPACITY)
            victims = self._victims(key, rows.nbytes)
            if victims is None:
                return self._refuse(key, rows.nbytes, RefusalReason.STORE_FULL)
            for victim in (key, *victims):
                self._drop(victim)
            entry = _Entry(rows, rows.nbytes, now + self.config.lease_s)
            self._entries[key] = entry
            self._used += entry.nbytes
            return Stored(key, entry.nbytes, entry.deadline, tuple(victims))

    def fetch(self, key: StoreKey, pages: Sequence[PageRef]) -> Fetched:
        """Copies of the rows of `pages`; pages of an entry the store no longer holds are missing.

        A page reference outside the entry's pages raises PageRefInvalid. Fetching renews
        the entry's lease and makes it the most recently used.
        """
        with self._lock:
            now = self._clock()
            self._expire(now)
            entry = self._entries.get(key)
            if entry is None:
                return Fetched(key, (), tuple(pages))
            self._touch(key, entry, now)
            found = tuple(entry.rows.page(ref, f"pages[{i}]") for i, ref in enumerate(pages))
            return Fetched(key, found, ())

    def renew(self, request_id: str, request_generation: int) -> int:
        """Extend the lease of every entry of this request generation; returns how many."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            keys = [
                k
                for k in self._entries
                if k.request_id == request_id and k.request_generation == request_generation
            ]
            for k in keys:
                self._touch(k, self._entries[k], now)
            return len(keys)

    def release(self, request_id: str) -> int:
        """The request ended: drop all its entries and its fence floor. Returns freed bytes."""
        with self._lock:
            freed = sum(self._drop(k) for k in self._keys_of(request_id))
            self._floors.pop(request_id, None)
            return freed

    def fence(self, request_id: str, current_generation: int) -> int:
        """Drop entries of request generations below `current_generation`; returns freed bytes.

        Later puts under those generations are refused as stale.
        """
        with self._lock:
            return self._fence(request_id, current_generation)

    def expire(self) -> tuple[StoreKey, ...]:
        """Drop every entry whose lease has run out; returns their keys (for a sweeper)."""
        with self._lock:
            return self._expire(self._clock())

    def _fence(self, request_id: str, current_generation: int) -> int:
        floor = max(self._floors.get(request_id, 0), current_generation)
        self._floors[request_id] = floor
        stale = [k for k in self._keys_of(request_id) if k.request_generation < floor]
        return sum(self._drop(k) for k in stale)

    def _expire(self, now: float) -> tuple[StoreKey, ...]:
        expired = tuple(k for k, entry in self._entries.items() if entry.deadline <= now)
        for k in expired:
            self._drop(k)
        return expired

    def _victims(self, key: StoreKey, nbytes: int) -> list[StoreKey] | None:
        """Other requests' LRU entries whose removal makes `nbytes` fit (the entry `key`
        replaces counts as free), or None if they cannot."""
        replaced = self._entries.get(key)
        free = self.config.capacity_bytes - self._used + (replaced.nbytes if replaced else 0)
        if nbytes <= free:
            return []
        if self.config.on_full is OnFull.REFUSE:
            return None
        victims: list[StoreKey] = []
        for k, entry in self._entries.items():
            if k.request_id == key.request_id:
                continue  # never evict the request's own rows to store more of them
            victims.append(k)
            free += entry.nbytes
            if nbytes <= free:
                return victims
        return None

    def _touch(self, key: StoreKey, entry: _Entry, now: float) -> None:
        entry.deadline = now + self.config.lease_s
        self._entries.move_to_end(key)

    def _drop(self, key: StoreKey) -> int:
        entry = self._entries.pop(key, None)
        if entry is None:
            return 0
        self._used -= entry.nbytes
        return entry.nbytes

    def _keys_of(self, request_id: str) -> list[StoreKey]:
        return [k for k in self._entries if k.request_id == request_id]

    def _refuse(self, key: StoreKey, nbytes: int, reason: RefusalReason) -> Refused:
        return Refused(key, nbytes, reason, self._used, self.config.capacity_bytes)
