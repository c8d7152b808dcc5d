"""Bounded concurrency: a few prompts run, a bounded queue waits, the rest are refused at once
with RESOURCE_EXHAUSTED rather than hanging."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.rpc.errors import ResourceExhausted


class Admission:
    """At most `max_in_flight` holders of a slot at a time, at most `max_queued` waiting for
    one. Waiting is bounded by the caller's own deadline (a cancelled waiter leaves the queue).
    Event-loop confined: use from one asyncio loop only."""

    def __init__(self, max_in_flight: int, max_queued: int) -> None:
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError(f"max_in_flight/max_queued: need >= 1 / >= 0, got {max_in_flight}/{max_queued}")
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_in_flight)
        self._admitted = 0  # running + waiting
        self._running = 0

    @property
    def in_flight(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return self._admitted - self._running

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a slot for the body; ResourceExhausted if every slot and queue place is taken."""
        if self._admitted >= self.max_in_flight + self.max_queued:
            raise ResourceExhausted(
                f"{self.max_in_flight} prompts in flight and {self.max_queued} queued; try another prefill worker"
            )
        self._admitted += 1
        try:
            async with self._slots:
                self._running += 1
                try:
                    yield
                finally:
                    self._running -= 1
        finally:
            self._admitted -= 1
