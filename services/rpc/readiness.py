"""Readiness: a server reports SERVING only while every dependency it needs is usable.

A service names its dependencies as `ReadinessCheck`s (the policy service: Redis answers
PING; the workers: the policy service reports SERVING; the gateway: the policy service and
at least one healthy worker of each role). `Readiness` evaluates them all before the server
reports anything (so health says NOT_SERVING until the first pass succeeds), then again
every `interval_s` (every quarter of it while not ready, so that a dependency that comes
back is seen within a fraction of a second), and flips the gRPC health status of "" and every
hosted service on each transition, logging why. Probes are bounded by `timeout_s`. A probe
that answers no, or raises, counts as not ready at once; one that only answers too late counts
so after `unready_after_timeouts` such evaluations in a row while the service was ready (slow
is not gone: every worker probes the same policy service, so one busy second of it used to
turn every worker NOT_SERVING together, and the gateway then had no worker of a role). A
service that learns of a change itself (the policy service's recovery loop) calls `evaluate()`
at once; evaluations never interleave, so the last one wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ReadinessCheck:
    """One dependency: `probe()` returns None when it is usable, else why not."""

    name: str
    probe: Callable[[], Awaitable[str | None]]


def readiness_problems(results: Sequence[tuple[str, str | None]]) -> list[str]:
    """'name: reason' for every check that failed (pure)."""
    return [f"{name}: {reason}" for name, reason in results if reason is not None]


class Readiness:
    """Keeps the health status of `services` in step with `checks`."""

    def __init__(
        self,
        health_servicer: health.aio.HealthServicer,
        services: Sequence[str],
        checks: Sequence[ReadinessCheck],
        *,
        interval_s: float = 2.0,
        timeout_s: float = 1.0,
        unready_after_timeouts: int = 3,
    ) -> None:
        if unready_after_timeouts < 1:
            raise ValueError(f"unready_after_timeouts: {unready_after_timeouts} must be >= 1")
        self._health = health_servicer
        self._services = ["", *services]
        self._checks = list(checks)
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._unready_after_timeouts = unready_after_timeouts
        self._timeouts = [0] * len(self._checks)  # per check: evaluations in a row it timed out
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self.problems: list[str] | None = None  # None: not evaluated yet

    @property
    def ready(self) -> bool:
        return self.problems == []

    async def hold(self) -> None:
        """Report NOT_SERVING until the first evaluation (before the server starts)."""
        await self._set(NOT_SERVING)

    async def evaluate(self) -> bool:
        """Run every probe once, set the health status, return whether all passed."""
        async with self._lock:
            return await self._evaluate()

    async def _evaluate(self) -> bool:
        answers = await asyncio.gather(*(self._probe(check) for check in self._checks))
        results = []
        for index, (check, (reason, timed_out)) in enumerate(zip(self._checks, answers, strict=True)):
            self._timeouts[index] = self._timeouts[index] + 1 if timed_out else 0
            tolerated = self.ready and timed_out and self._timeouts[index] < self._unready_after_timeouts
            if tolerated:
                log.info("%s: %s (%d in a row; still ready)", check.name, reason, self._timeouts[index])
            results.append((check.name, None if tolerated else reason))
        problems = readiness_problems(results)
        if problems != self.problems:
            if problems:
                log.warning("not ready: %s", "; ".join(problems))
            elif self.problems is not None:
                log.info("ready again")
            await self._set(NOT_SERVING if problems else SERVING)
        self.problems = problems
        return not problems

    def start(self) -> None:
        """Re-evaluate every `interval_s` in the background (no-op without checks)."""
        if self._checks and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="readiness")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s if self.ready else self._interval_s / 4)
            try:
                await self.evaluate()
            except Exception:  # one failed round must not freeze the status where it was
                log.exception("readiness evaluation failed")

    async def _probe(self, check: ReadinessCheck) -> tuple[str | None, bool]:
        """(why not ready or None, whether the probe only ran out of time)."""
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that arrives
            # as the probe ends, and stop() would then wait forever.
            async with asyncio.timeout(self._timeout_s):
                return await check.probe(), False
        except TimeoutError as exc:  # ours, or the probe's own deadline (a slow answer, not a no)
            return str(exc) or f"no answer within {self._timeout_s:g} s", True
        except Exception as exc:  # noqa: BLE001 - any failure of a probe means "not ready"
            return f"{type(exc).__name__}: {exc}", False

    async def _set(self, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        for name in self._services:
            await self._health.set(name, status)
