"""The launcher's supervisor on real (stand-in) processes: a SIGKILLed service is restarted
after a doubling backoff with the same command, the others are left alone, one that keeps
dying is given up, and the stack counts as broken only without a role it needs. The whole
stack under `kvrelay up` is exercised in tests/e2e/test_e2e_up.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher.stack import ServiceProcess, Stack, StackConfig
from services.launcher.supervise import RestartPolicy, Supervisor, restart_delay

SLEEPER = (sys.executable, "-c", "import time; time.sleep(120)")


def test_backoff_doubles_up_to_its_cap_and_stops_after_the_burst() -> None:
    policy = RestartPolicy(initial_s=0.5, max_s=3.0, max_restarts=4, window_s=60.0)
    assert restart_delay(policy, [], 100.0) == 0.5
    assert restart_delay(policy, [99.0], 100.0) == 1.0
    assert restart_delay(policy, [97.0, 98.0, 99.0], 100.0) == 3.0  # 4.0 capped
    assert restart_delay(policy, [96.0, 97.0, 98.0, 99.0], 100.0) is None
    assert restart_delay(policy, [30.0, 31.0, 98.0, 99.0], 100.0) == 2.0  # old restarts age out
    with pytest.raises(ValueError, match="initial_s"):
        RestartPolicy(initial_s=0.0)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A stack of stand-in services (sleeping processes), one per role and two decode workers."""
    started = Stack(StackConfig.with_free_ports(tmp_path, decode=2, log_dir=tmp_path))
    for name, role in (("policy", "policy"), ("prefill-0", "prefill"), ("decode-0", "decode"),
                       ("decode-1", "decode"), ("gateway", "gateway")):
        service = ServiceProcess(name, role, "127.0.0.1:1", SLEEPER, tmp_path / f"{name}.log")
        service.spawn({})
        started.services.append(service)
    yield started
    for service in started.services:
        service.kill()


def test_a_killed_worker_is_restarted_with_backoff_and_the_rest_keeps_running(stack: Stack) -> None:
    now = [0.0]
    supervisor = Supervisor(stack, RestartPolicy(initial_s=1.0, max_s=8.0, max_restarts=2, window_s=60.0),
                            clock=lambda: now[0])
    victim = stack.service("decode-1")
    others = {s.name: s.pid for s in stack.services if s is not victim}
    first_pid = victim.pid
    assert supervisor.poll() == []

    victim.kill()
    assert [e.kind for e in supervisor.poll()] == ["exited", "restarting"]
    now[0] = 0.5
    assert supervisor.poll() == []  # backoff: 1 s
    now[0] = 1.0
    assert [(e.kind, e.service.name) for e in supervisor.poll()] == [("restarted", "decode-1")]
    assert victim.running and victim.pid != first_pid and victim.argv == SLEEPER
    assert {s.name: s.pid for s in stack.services if s is not victim} == others
    assert all(s.running for s in stack.services)

    victim.kill()
    supervisor.poll()
    now[0] = 2.5
    assert supervisor.poll() == []  # second backoff: 2 s
    now[0] = 3.0
    assert [e.kind for e in supervisor.poll()] == ["restarted"]
    victim.kill()
    assert [e.kind for e in supervisor.poll()] == ["exited", "given_up"]
    assert supervisor.broken() == []  # decode-0 still serves
    stack.service("decode-0").kill()
    supervisor.poll()
    now[0] = 100.0
    supervisor.poll()
    assert supervisor.broken() == []  # decode-0 restarted: it had restarts left


def test_the_stack_is_broken_without_its_policy_service(stack: Stack) -> None:
    supervisor = Supervisor(stack, RestartPolicy(max_restarts=0))
    stack.service("policy").kill()
    assert [e.kind for e in supervisor.poll()] == ["exited", "given_up"]
    assert supervisor.broken() == ["policy is down"]
