"""EndRequest calls that Redis did not take, kept to be retried once it is back.

The gateway ends every request once; if Redis is unreachable at that moment the call fails
with UNAVAILABLE and, without this, the request's key stays "begun" until its lease (15
minutes by default) runs out. The store records each such end here; the recovery loop
retries them every pass while Redis answers, until one lands, is answered "missing"/"stale"
(nothing left to end), or its deadline — the request lease, after which Redis drops the key
anyway — passes. Bounded: past `capacity` the oldest is dropped (and logged).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
DEFAULT_CAPACITY = 10_000


@dataclass(frozen=True)
class PendingEnd:
    """One end to retry: the request, its generation, how long an ended key stays readable."""

    request_id: str
    request_generation: int
    retention_ms: int
    give_up_at: float
    owner: str = ""  # the identity that asked (checked against the request's owner on retry)


class PendingEnds:
    """Ends to retry, one per request id (the highest generation wins)."""

    def __init__(
        self, *, deadline_s: float, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if deadline_s <= 0 or capacity < 1:
            raise ValueError("deadline_s/capacity: must be positive")
        self._deadline_s = deadline_s
        self._capacity = capacity
        self._clock = clock
        self._ends: OrderedDict[str, PendingEnd] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._ends)

    def add(self, request_id: str, request_generation: int, retention_ms: int, owner: str = "") -> None:
        current = self._ends.get(request_id)
        if current is not None and current.request_generation >= request_generation:
            return
        self._ends[request_id] = PendingEnd(
            request_id, request_generation, retention_ms, self._clock() + self._deadline_s, owner
        )
        self._ends.move_to_end(request_id)
        while len(self._ends) > self._capacity:
            oldest, _ = self._ends.popitem(last=False)
            self.dropped += 1
            log.warning("too many pending EndRequests (%d); %s is left to its lease", self._capacity, oldest)

    def due(self) -> list[PendingEnd]:
        """Every end still worth retrying, oldest first; those past their deadline are dropped."""
        now = self._clock()
        for end in [e for e in self._ends.values() if e.give_up_at <= now]:
            del self._ends[end.request_id]
            self.dropped += 1
            log.warning("EndRequest %s (g_r %d) gave up: its lease ends it", end.request_id, end.request_generation)
        return list(self._ends.values())

    def settle(self, end: PendingEnd) -> None:
        """`end` landed (or there is nothing left to end): forget it, unless a newer one came."""
        if self._ends.get(end.request_id) == end:
            del self._ends[end.request_id]
