"""Noticing that Redis lost the policy service's data, and putting back what it owns.

A Redis restarted without persistence (or flushed, or an embedded one that died) comes back
empty while every health check could still say SERVING. The store keeps an epoch key — a
random token claimed by the first replica that finds it missing — so "gone" means "this
Redis lost its data". Each pass (every `interval_s`, and at once when `poke`d):

  1. an embedded redis-server that died is started again (same port and password);
  2. epoch missing: NOT_SERVING, every archived manifest is written back, a new epoch is
     claimed, SERVING again. Epoch changed: another replica restored; this one writes back
     what it alone may know. Fences are not restored (see `policy_service.store`);
  3. manifests other replicas registered are added to the archive (`PolicyStore.mirror`);
  4. ends Redis could not take are retried (`policy_service.pending_ends`).

`problem()` is the readiness probe: None while Redis answers and holds the manifests, else
why not; `on_change` runs when that answer changes (the server re-evaluates its health).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from policy_service.config import redact_url
from policy_service.store import REDIS_UNAVAILABLE, PolicyStore
from services.redis_embedded import EmbeddedRedis, EmbeddedRedisError

log = logging.getLogger(__name__)


class Recovery:
    """The loop that keeps Redis holding the policy service's manifests."""

    def __init__(
        self,
        store: PolicyStore,
        redis_url: str,
        *,
        interval_s: float = 1.0,
        embedded: EmbeddedRedis | None = None,
        on_change: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s: {interval_s} must be positive")
        self.store = store
        self.interval_s = interval_s
        self.embedded = embedded
        self.on_change = on_change
        self.epoch: str | None = None
        self.restores = 0  # how many times Redis was found without its data
        self._where = redact_url(redis_url)
        self._problem: str | None = "not checked yet"
        self._checked_at = 0.0
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """One pass now (so the first health answer is right), then one every `interval_s`."""
        await self.run_pass()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="policy-recovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=5 * self.interval_s + 5)
            self._task = None

    def poke(self) -> None:
        """Run a pass now rather than at the next tick (e.g. after a Redis error)."""
        self._wake.set()

    async def problem(self) -> str | None:
        """Readiness: None while Redis is reachable and holds what this service owns."""
        if self._task is not None and time.monotonic() - self._checked_at > 5 * self.interval_s + 5:
            return "the recovery loop has not run for a while"
        return self._problem

    async def run_pass(self) -> None:
        """One pass (see the module doc); never raises on a Redis failure."""
        async with self._lock:
            try:
                await self._restart_embedded()
                await self._check_epoch()
                await self.store.mirror()
                await self._retry_ends()
                problem = None
            except (*REDIS_UNAVAILABLE, EmbeddedRedisError) as exc:
                problem = f"redis at {self._where} is unreachable: {type(exc).__name__}: {exc}"
            self._checked_at = time.monotonic()
            await self._report(problem)

    async def _loop(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that arrives
            # as the wait ends, and stop() would then wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.run_pass()
            except Exception:  # noqa: BLE001 - one bad pass must not end recovery for good
                log.exception("policy recovery pass failed")

    async def _restart_embedded(self) -> None:
        if self.embedded is not None and not self.embedded.running:
            log.warning("embedded redis-server exited; starting it again on port %d", self.embedded.port)
            await self._report("the embedded redis-server exited; restarting it")
            await asyncio.to_thread(self.embedded.start)

    async def _check_epoch(self) -> None:
        epoch = await self.store.epoch()
        if epoch is not None and epoch == self.epoch:
            return
        self.store.forget_present()  # what this process saw in Redis may be gone with it
        if epoch is None and self.epoch is not None:
            self.restores += 1
            log.warning("redis at %s lost its data (epoch %s is gone); restoring manifests", self._where, self.epoch)
            await self._report("redis lost its data; restoring manifests")
        restored = await self.store.republish()
        self.epoch = await self.store.claim_epoch(secrets.token_hex(8)) if epoch is None else epoch
        log.info("redis epoch %s: %d manifests restored of %d archived", self.epoch, restored,
                 len(self.store.archive or ()))

    async def _retry_ends(self) -> None:
        pending = self.store.pending_ends
        if pending is None:
            return
        for end in pending.due():
            await self.store.retry_end(end)

    async def _report(self, problem: str | None) -> None:
        if problem == self._problem:
            return
        self._problem = problem
        if self.on_change is not None:
            await self.on_change()
