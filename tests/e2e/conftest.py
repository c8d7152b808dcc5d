"""End-to-end fixtures: a tiny random Llama checkpoint speaking the needle vocabulary, and
ONE local stack for all of them, started the way a user starts it — `kvrelay up` with two
prefill and two decode workers — so every service is a separate process on loopback, talking
real gRPC, real Redis and real gloo pair groups. It stops right after the last e2e test, and
that stop is a test of its own: SIGTERM (what Ctrl-C does) must stop every service."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from e2e_helpers import (
    E2E_ENV,
    KVRELAY,
    Output,
    UpStack,
    free_base_port,
    save_tiny_checkpoint,
    wait_gone,
)

from services.launcher.stack import StackConfig
from services.model import LoadedModel, load

_HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("e2e-checkpoint"))


@pytest.fixture(scope="session")
def loaded(checkpoint: Path) -> LoadedModel:
    torch.set_num_threads(1)
    return load(checkpoint, "cpu", "float32")


def start_stack(checkpoint: Path, log_dir: Path) -> UpStack:
    base = free_base_port()
    up = subprocess.Popen(
        [*KVRELAY, "up", "--checkpoint", str(checkpoint), "--prefill", "2", "--decode", "2",
         "--base-port", str(base), "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **E2E_ENV},
    )
    output = Output(up)
    try:
        output.wait_for(rf"kvrelay gateway listening on 127\.0\.0\.1:{base}\b", 300)
        started = UpStack(StackConfig.with_counts(checkpoint, prefill=2, decode=2, base_port=base, log_dir=log_dir),
                          up, output)
        assert sorted(started.pids) == ["decode-0", "decode-1", "gateway", "policy", "prefill-0", "prefill-1"]
        return started
    except BaseException:
        up.kill()
        raise


def stop_stack(started: UpStack) -> None:
    """SIGTERM to `kvrelay up` (what Ctrl-C does) must stop every service it started."""
    try:
        assert not started.dead(), f"services died during the session: {started.dead()}"
        started.up.send_signal(signal.SIGTERM)
        assert started.up.wait(timeout=120) == 0, started.output.text
        assert wait_gone(list(started.pids.values()), 10) == [], started.output.text
    finally:
        if started.up.poll() is None:
            started.up.kill()


_RUNNING: dict[str, UpStack] = {}


@pytest.fixture
def stack(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> UpStack:
    """The shared stack, started by the first e2e test that asks for it."""
    if "up" not in _RUNNING:
        _RUNNING["up"] = start_stack(checkpoint, tmp_path_factory.mktemp("e2e-logs"))
    return _RUNNING["up"]


def stack_log_tail(started: UpStack, lines: int = 12) -> str:
    """The last warnings and health transitions of every service log of `started`."""
    assert started.config.log_dir is not None
    wanted = ("WARNING", "ERROR", "is healthy", "is unhealthy", "ready again", "still ready")
    parts = []
    for log in sorted(Path(started.config.log_dir).glob("*.log")):
        picked = [line[:300] for line in log.read_text(errors="replace").splitlines() if any(w in line for w in wanted)]
        if picked:
            parts.append(f"--- {log.name}\n" + "\n".join(picked[-lines:]))
    return "\n".join(parts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A failed e2e test's report carries the stack's recent warnings and health changes: CI
    shows the report, not the logs."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "up" in _RUNNING and _HERE in item.path.parents:
        report.sections.append(("stack logs", stack_log_tail(_RUNNING["up"])))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the stack after the last e2e test rather than at the end of the whole suite."""
    if "up" in _RUNNING and (nextitem is None or _HERE not in nextitem.path.parents):
        stop_stack(_RUNNING.pop("up"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for started in _RUNNING.values():  # an interrupted run
        started.up.kill()
