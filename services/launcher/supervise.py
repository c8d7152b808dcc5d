"""Supervised restarts for `kvrelay up`: a service that exits unexpectedly is started again.

What an operator expects from a local supervisor (systemd's `Restart=on-failure` with
`StartLimitBurst`, Kubernetes' CrashLoopBackOff): the rest of the stack keeps running, the
dead service is restarted with the same flags and ports after a backoff that doubles
(`initial_s`, 2x, ... up to `max_s`), and one that keeps dying — `max_restarts` within
`window_s` — is given up and left down, logged. The stack itself is only stopped when it can
no longer serve: the gateway or the replicas' redis-server given up, or every policy replica
or every worker of a role. Peers find a restarted service by its unchanged address (the
gateway's health checks, the policy client's reconnects; the replicas reconnect to a restarted
redis-server and write back what it lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.launcher.stack import ServiceProcess, Stack


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff from `initial_s` doubling to `max_s`; at most `max_restarts` per `window_s`."""

    initial_s: float = 0.5
    max_s: float = 10.0
    max_restarts: int = 5
    window_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("initial_s: must be positive and <= max_s")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError("max_restarts/window_s: out of range")


def restart_delay(policy: RestartPolicy, recent: Sequence[float], now: float) -> float | None:
    """Seconds to wait before restarting a service that restarted at times `recent`, or None
    when it has used up its restarts within the window (pure)."""
    within = [t for t in recent if now - t < policy.window_s]
    if len(within) >= policy.max_restarts:
        return None
    return float(min(policy.max_s, policy.initial_s * 2 ** len(within)))


@dataclass(frozen=True)
class Event:
    """What the supervisor saw or did: `kind` is exited, restarting (scheduled), restarted,
    ready (a restarted service is healthy) or given_up."""

    kind: str
    service: ServiceProcess
    detail: str = ""


@dataclass
class _Watch:
    restarts: list[float] = field(default_factory=list)
    due_at: float | None = None  # a restart is scheduled for then
    starting: bool = False  # restarted, not yet healthy
    given_up: bool = False


class Supervisor:
    """Watches the services of a started `Stack`; call `poll()` every half second or so."""

    def __init__(
        self, stack: Stack, policy: RestartPolicy | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stack = stack
        self.policy = policy or RestartPolicy()
        self._clock = clock
        self._watches = {service.name: _Watch() for service in stack.services}

    def poll(self) -> list[Event]:
        """Notice exits, restart what is due, report restarted services that became healthy."""
        events: list[Event] = []
        for service in self.stack.services:
            watch = self._watches.setdefault(service.name, _Watch())
            if not watch.given_up:
                events.extend(self._step(service, watch, self._clock()))
        return events

    def broken(self) -> list[str]:
        """Why the stack can no longer serve (given-up services it cannot do without)."""
        down = {s.name for s in self.stack.services if self._watches.get(s.name, _Watch()).given_up}
        reasons = [f"{s.name} is down" for s in self.stack.services if s.role in ("gateway", "redis") and s.name in down]
        for role, kind in (("policy", "replica"), ("prefill", "worker"), ("decode", "worker")):
            names = [s.name for s in self.stack.services if s.role == role]
            if names and set(names) <= down:
                single = role == "policy" and len(names) == 1
                reasons.append(f"{names[0]} is down" if single else f"every {role} {kind} is down")
        return reasons

    def _step(self, service: ServiceProcess, watch: _Watch, now: float) -> list[Event]:
        if service.running:
            if watch.starting and service.check_healthy():
                watch.starting = False
                return [Event("ready", service)]
            return []
        if watch.due_at is None:
            return self._schedule(service, watch, now)
        if now < watch.due_at:
            return []
        watch.due_at = None
        watch.restarts.append(now)
        watch.starting = True
        self.stack.respawn(service)
        return [Event("restarted", service, f"restart {len(watch.restarts)}")]

    def _schedule(self, service: ServiceProcess, watch: _Watch, now: float) -> list[Event]:
        status = service.process.returncode if service.process is not None else None
        exited = Event("exited", service, f"status {status}")
        delay = restart_delay(self.policy, watch.restarts, now)
        if delay is None:
            watch.given_up = True
            limit = f"{self.policy.max_restarts} restarts within {self.policy.window_s:g} s"
            return [exited, Event("given_up", service, limit)]
        watch.due_at = now + delay
        watch.starting = False
        return [exited, Event("restarting", service, f"in {delay:g} s")]
