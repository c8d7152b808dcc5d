"""Gateway-side admission: a request that finds every worker of a role at its limit waits here,
first come first served and bounded by its deadline, instead of being refused.

A worker pool with a per-worker limit on outstanding requests (`WorkerPool(max_outstanding=)`)
hands out a worker only while one has room; the others queue in a `WaitQueue`. So a burst
queues at the gateway rather than overflowing the workers' own short queues (which refuse at
once with RESOURCE_EXHAUSTED). A waiter is refused with `WorkersBusy` (RESOURCE_EXHAUSTED)
only when its wait expires or `max_waiting` others are already waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

from services.rpc.errors import ResourceExhausted

T = TypeVar("T")


class WorkersBusy(ResourceExhausted):
    """Every worker of a role stayed at its limit for as long as the request could wait."""


class _Waiter:
    __slots__ = ("woken",)

    def __init__(self) -> None:
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class WaitQueue(Generic[T]):
    """FIFO waiters for something `attempt` can take (it returns None while nothing is free).
    The owner calls `notify()` whenever something may have become free. Event-loop confined."""

    def __init__(
        self, max_waiting: int, on_waiting: Callable[[int], None] = lambda _count: None
    ) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting: {max_waiting} must be >= 0")
        self.max_waiting = max_waiting
        self._on_waiting = on_waiting  # told the number waiting whenever it changes (a gauge)
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def take(
        self, attempt: Callable[[], T | None], timeout_s: float, what: Callable[[], str]
    ) -> T:
        """What `attempt` returns, at once if nobody waits and it succeeds, else in turn within
        `timeout_s`; WorkersBusy (its message starts with `what()`) when the turn never comes.
        Whatever `attempt` raises ends the wait with that error."""
        if not self._waiters:
            taken = attempt()
            if taken is not None:
                return taken
        if len(self._waiters) >= self.max_waiting:
            raise WorkersBusy(f"{what()}, and {len(self._waiters)} requests are already waiting")
        waiter = _Waiter()
        self._waiters.append(waiter)
        self._on_waiting(len(self._waiters))
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                while True:
                    await waiter.woken
                    taken = attempt()
                    if taken is not None:
                        return taken
                    waiter.woken = asyncio.get_running_loop().create_future()
        except TimeoutError:
            raise WorkersBusy(f"{what()} for the {timeout_s:.3g} s this request could wait") from None
        finally:
            self._waiters.remove(waiter)
            self._on_waiting(len(self._waiters))
            self.notify()  # the next in line may find room, or inherit a wake this one left unused

    def notify(self) -> None:
        """Let the first waiter try again."""
        if self._waiters and not self._waiters[0].woken.done():
            self._waiters[0].woken.set_result(None)
