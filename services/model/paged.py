"""Fixed-size KV pages from one preallocated pool, and the ledger that charges them to a byte
budget (issue 17).

A page holds `page_rows` rows of one (request, layer, owner): keys and values `[page_rows, d_h]`
and each row's int32 original position. Every (request, layer, owner) owns whole pages, so the
bytes a request occupies are its rows rounded up to pages, never the batch's longest head.

    pool = PagePool.for_budget(budget_bytes, head_dim, dtype, device)   # one per worker
    lease = pool.ledger.reserve(pages, "request r")   # what admission control checks
    ids = pool.allocate(lease, n)                     # pages charged to that reservation
    pool.free(lease, ids)                             # back to the pool on release

`PageLedger` is the accounting alone (thread-safe: the accept path reserves on the event loop,
the decode loop allocates and frees): a lease's `reserved` pages are its admission-time quota,
its `held` pages are allocated. A lease that needs more than it reserved grows into unreserved
pages, or the allocation is refused with `KVPoolExhausted` naming the budget: the pool never
hands out a page past its capacity. A private pool (`growable`, tests and tools without a
budget) doubles instead of refusing.

The pool places pages so attention can read them in place (`allocate_extents`): an owner's
pages in one extent of consecutive pages, with free growth room after it that its decode
steps continue into; the room is a preference the ledger never charges, handed out when the
pool is full, and a fragmented pool falls back to scattered pages (gathered by attention).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.model.errors import InvalidModelInput, KVPoolExhausted

DEFAULT_PAGE_ROWS = 16
# Free pages kept after an owner's extent for its decode steps to grow into in place.
DEFAULT_GROWTH_PAGES = 8
POSITION_BYTES = 4  # int32 original position per row


def page_nbytes(page_rows: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V rows at `dtype` plus an int32 position per row."""
    return page_rows * (2 * head_dim * dtype.itemsize + POSITION_BYTES)


@dataclass(frozen=True)
class LedgerUsage:
    """A snapshot of a ledger, in pages of `page_bytes`."""

    capacity_pages: int
    reserved_pages: int
    held_pages: int
    page_bytes: int

    @property
    def reserved_bytes(self) -> int:
        return self.reserved_pages * self.page_bytes

    @property
    def held_bytes(self) -> int:
        return self.held_pages * self.page_bytes


class PageLease:
    """The pages one request may hold (`reserved`) and holds (`held`) in a `PageLedger`.
    `release()` gives back the reserved pages it does not hold (idempotent); pages still held
    return as they are freed."""

    def __init__(self, ledger: PageLedger, pages: int, label: str) -> None:
        self.ledger = ledger
        self.label = label
        self.reserved = pages
        self.held = 0
        self.released = False

    @property
    def nbytes(self) -> int:
        """Bytes reserved now (whole pages)."""
        return self.reserved * self.ledger.page_bytes

    def release(self) -> None:
        self.ledger.release(self)


class PageLedger:
    """Reserved and held pages against a capacity of `capacity_pages` pages of `page_bytes`.
    Invariant: held <= reserved <= capacity, per lease and in total."""

    def __init__(self, capacity_pages: int, page_bytes: int, field: str = "kv_budget_bytes",
                 growable: bool = False) -> None:
        if capacity_pages < 0 or page_bytes <= 0:
            raise InvalidModelInput("capacity", "pages must be >= 0 and page bytes > 0")
        self.capacity_pages = capacity_pages
        self.page_bytes = page_bytes
        self.field = field
        self.growable = growable
        self._reserved = 0
        self._held = 0
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_pages * self.page_bytes

    def usage(self) -> LedgerUsage:
        with self._lock:
            return LedgerUsage(self.capacity_pages, self._reserved, self._held, self.page_bytes)

    def reserve(self, pages: int, label: str) -> PageLease:
        """A lease of `pages` pages, or KVPoolExhausted if they do not fit next to the others."""
        if pages < 0:
            raise InvalidModelInput("pages", f"{pages} is negative")
        with self._lock:
            self._take(pages, label)
        return PageLease(self, pages, label)

    def charge(self, lease: PageLease, pages: int) -> None:
        """Count `pages` more as held by `lease`, growing its reservation into unreserved pages
        if it needs more than it reserved (KVPoolExhausted when there are none)."""
        with self._lock:
            extra = lease.held + pages - lease.reserved
            if extra > 0:
                self._take(extra, lease.label)
                lease.reserved += extra
            lease.held += pages
            self._held += pages

    def discharge(self, lease: PageLease, pages: int) -> None:
        """`pages` held by `lease` went back to the pool; a released lease's reservation
        shrinks with them."""
        with self._lock:
            pages = min(pages, lease.held)
            lease.held -= pages
            self._held -= pages
            if lease.released:
                lease.reserved -= pages
                self._reserved -= pages

    def trim(self, lease: PageLease, pages: int) -> None:
        """Shrink a lease's reservation to `pages` (never below what it holds): admission knows
        each (layer, owner)'s rows, so the worst-case page rounding reserved ahead can go."""
        with self._lock:
            target = max(pages, lease.held)
            if not lease.released and target < lease.reserved:
                self._reserved -= lease.reserved - target
                lease.reserved = target

    def release(self, lease: PageLease) -> None:
        with self._lock:
            if not lease.released:
                lease.released = True
                self._reserved -= lease.reserved - lease.held
                lease.reserved = lease.held

    def grow(self, capacity_pages: int) -> None:
        with self._lock:
            self.capacity_pages = max(self.capacity_pages, capacity_pages)

    def _take(self, pages: int, label: str) -> None:
        if self._reserved + pages <= self.capacity_pages or self.growable:
            self._reserved += pages
            if self._reserved > self.capacity_pages:  # growable: the pool grows on allocation
                self.capacity_pages = self._reserved
            return
        raise KVPoolExhausted(
            self.field,
            f"{label} needs {pages} pages of {self.page_bytes} bytes; {self._reserved} of "
            f"{self.capacity_pages} pages ({self.capacity_bytes} bytes) are reserved",
            request_id=label,
        )


class PagePool:
    """The KV pages of one worker: keys/values `[num_pages, page_rows, d_h]` and positions
    `[num_pages, page_rows]` int32, preallocated once; a free list; the `ledger` they are
    charged to. Pages come back zeroed, so a row past a (request, owner)'s length is 0, never a
    NaN left by an earlier request (attention masks it, and 0 * NaN would leak through).

    Every page a cache has written or zeroed holds finite values from then on (the cache stores
    non-finite K/V as finite, `DecodeCache`), so a padded attention plan may read a neighbour's
    or a free page under its mask once `clean` has zeroed the never-touched ones among them."""

    def __init__(self, num_pages: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", page_rows: int = DEFAULT_PAGE_ROWS,
                 field: str = "kv_budget_bytes", growable: bool = False,
                 growth_pages: int = DEFAULT_GROWTH_PAGES) -> None:
        if page_rows <= 0 or head_dim <= 0 or growth_pages < 0:
            raise InvalidModelInput("page_rows", "page rows and head dim must be positive, "
                                    "growth pages >= 0")
        self.page_rows = page_rows
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        page_bytes = page_nbytes(page_rows, head_dim, dtype)
        self.ledger = PageLedger(num_pages, page_bytes, field, growable)
        # torch.empty: the OS backs a page of the pool only once something is written to it.
        self.keys = torch.empty(num_pages, page_rows, head_dim, dtype=dtype, device=self.device)
        self.values = torch.empty_like(self.keys)
        self.positions = torch.empty(num_pages, page_rows, dtype=torch.int32, device=self.device)
        self.growth_pages = growth_pages
        self._is_free = np.ones(num_pages, dtype=bool)  # host bitmap: True = free
        self._touched = np.zeros(num_pages, dtype=bool)  # zeroed or written since creation
        self._free_count = num_pages
        self._lock = threading.Lock()

    @classmethod
    def for_budget(cls, budget_bytes: int, head_dim: int, dtype: torch.dtype,
                   device: str | torch.device = "cpu", page_rows: int = DEFAULT_PAGE_ROWS,
                   field: str = "kv_budget_bytes") -> PagePool:
        """As many pages as `budget_bytes` holds (rounded down: never past the budget)."""
        return cls(budget_bytes // page_nbytes(page_rows, head_dim, dtype), head_dim, dtype,
                   device, page_rows, field)

    @property
    def num_pages(self) -> int:
        return int(self.keys.shape[0])

    @property
    def page_bytes(self) -> int:
        return self.ledger.page_bytes

    @property
    def preallocated_bytes(self) -> int:
        """Bytes of the whole pool (every page, in use or not)."""
        return self.num_pages * self.page_bytes

    @property
    def pages_in_use(self) -> int:
        with self._lock:
            return self.num_pages - self._free_count

    def allocate(self, lease: PageLease, count: int) -> torch.Tensor:
        """`count` zeroed pages charged to `lease` -> their ids `[count]` int64 (one extent
        where the pool has one)."""
        return self.allocate_extents(lease, [count])

    def allocate_extents(self, lease: PageLease, counts: Sequence[int],
                         after: Sequence[int] | None = None,
                         near: Sequence[int] | None = None) -> torch.Tensor:
        """Zeroed pages for several owners in one charge to `lease`: `counts[i]` pages for owner
        i, which continue its last page `after[i]` (-1: it has none) -> ids `[sum(counts)]`
        int64, owner after owner.

        Placement keeps an owner's pages consecutive so attention reads them in place
        (`services.model.attention.paged_plan`): the pages right after `after[i]` when they are
        free (a decode step's new page), else a new extent at the first free run with
        `growth_pages` free pages left after it for the owner to grow into and as many kept
        before it for the owner in front (a growable pool grows to make one), else any free
        run long enough, else any free pages. A new extent is looked for from page `near[i]`
        on first (the cache keeps each layer's owners in a region of their own, so a layer's
        owners across the batch sit at one stride and attention reads them as one strided
        view). Growth room is a preference, never charged: a full pool hands it out."""
        total = sum(counts)
        if total <= 0:
            return torch.zeros(0, dtype=torch.long, device=self.device)
        self.ledger.charge(lease, total)  # refuses before any page is taken
        with self._lock:
            placed = [self._place(count, -1 if after is None else after[i],
                                  0 if near is None else near[i])
                      for i, count in enumerate(counts) if count > 0]
            pages = np.concatenate(placed)
            self._touched[pages] = True
        index = torch.from_numpy(pages).to(self.device)
        self._zero(index)
        return index

    def clean(self, ids: torch.Tensor) -> None:
        """Zero the pages among `ids` nothing has written or zeroed yet (`torch.empty` left
        them as they were), so reading them under a mask is safe; the others keep their rows."""
        pages = np.unique(ids.cpu().numpy()) if ids.numel() else np.zeros(0, dtype=np.int64)
        with self._lock:
            pages = pages[(pages >= 0) & (pages < self._touched.size)]
            fresh = pages[~self._touched[pages]]
            self._touched[fresh] = True
        if fresh.size:
            self._zero(torch.from_numpy(fresh).to(self.device))

    def _zero(self, index: torch.Tensor) -> None:
        self.keys.index_fill_(0, index, 0)
        self.values.index_fill_(0, index, 0)
        self.positions.index_fill_(0, index, 0)

    def free(self, lease: PageLease, ids: torch.Tensor | Sequence[int]) -> None:
        """Give pages back to the pool and discharge them from `lease`."""
        pages = np.asarray(ids.cpu() if isinstance(ids, torch.Tensor) else list(ids),
                           dtype=np.int64)
        if not pages.size:
            return
        with self._lock:
            self._is_free[pages] = True
            self._free_count += int(pages.size)
        self.ledger.discharge(lease, int(pages.size))

    def _place(self, count: int, after: int, near: int) -> np.ndarray:
        """Take `count` free pages for one owner (see `allocate_extents`), under the lock."""
        free, start = self._is_free, after + 1
        if after >= 0 and start + count <= free.size and bool(free[start:start + count].all()):
            return self._take(np.arange(start, start + count))
        room = self.growth_pages
        first = self._extent(count, room, near)
        if first is None and near > 0:
            first = self._extent(count, room, 0)
        if first is None and self.ledger.growable:
            self._grow(count + 2 * room)  # a free tail with room on both sides
            first = self._extent(count, room, 0)
        if first is None:
            first = self._extent(count, 0, 0)
        if first is not None:
            return self._take(np.arange(first, first + count))
        if self._free_count < count:  # only a growable pool: the ledger refused a fixed one
            self._grow(count)
        return self._take(np.flatnonzero(self._is_free)[:count])

    def _extent(self, count: int, room: int, near: int) -> int | None:
        """First page, at or after `near`, of the first free run that holds `count` pages with
        `room` free pages on either side (none before it at page 0), or None."""
        edges = np.flatnonzero(np.diff(self._is_free, prepend=False, append=False))
        starts, stops = edges[0::2], edges[1::2]  # free runs [start, stop)
        first = np.maximum(starts + np.where(starts > 0, room, 0), near)
        fits = np.flatnonzero(stops - first >= count + room)
        return int(first[fits[0]]) if fits.size else None

    def _take(self, ids: np.ndarray) -> np.ndarray:
        self._is_free[ids] = False
        self._free_count -= int(ids.size)
        return ids

    def _grow(self, count: int) -> None:
        # Only a growable (private) pool gets here: the ledger refused a fixed one already.
        old = self.num_pages
        new = max(2 * old, old + count, 16)
        for name in ("keys", "values", "positions"):
            tensor = getattr(self, name)
            grown = torch.empty((new, *tensor.shape[1:]), dtype=tensor.dtype, device=self.device)
            grown[:old] = tensor
            setattr(self, name, grown)
        self._is_free = np.concatenate([self._is_free, np.ones(new - old, dtype=bool)])
        self._touched = np.concatenate([self._touched, np.zeros(new - old, dtype=bool)])
        self._free_count += new - old
        self.ledger.grow(new)
