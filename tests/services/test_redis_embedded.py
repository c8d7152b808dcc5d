"""The private redis-server: loopback only, password required, AOF when asked, clean stop."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.redis_embedded import (
    EmbeddedRedis,
    EmbeddedRedisConfig,
    EmbeddedRedisError,
    find_redis_server,
)


def test_starts_on_loopback_with_a_generated_password() -> None:
    with EmbeddedRedis() as server:
        assert server.port > 0 and len(server.password) >= 24
        with redis.Redis.from_url(server.url, decode_responses=True) as client:
            assert client.ping()
            assert client.config_get("bind")["bind"] == "127.0.0.1"
            assert client.config_get("appendonly")["appendonly"] == "no"
        for password in ("wrong", None):
            no_retry = Retry(NoBackoff(), 0)
            with redis.Redis(host="127.0.0.1", port=server.port, password=password, retry=no_retry) as intruder, \
                    pytest.raises(redis.AuthenticationError):
                intruder.ping()


def test_password_is_not_on_the_command_line() -> None:
    with EmbeddedRedis() as server:
        assert server.pid is not None
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline
        assert server.password in server.config_file.read_text()
        assert stat.S_IMODE(server.config_file.stat().st_mode) == 0o600


def test_aof_keeps_acknowledged_writes_across_sigkill(tmp_path: Path) -> None:
    server = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path))
    try:
        server.start()
        port = server.port
        with redis.Redis.from_url(server.url) as client:
            for i in range(100):
                client.set(f"k{i}", i)
            server.kill()
            assert not server.running
            server.start()
            assert server.port == port  # a restart keeps the port clients know
            assert [int(client.get(f"k{i}")) for i in range(100)] == list(range(100))
    finally:
        server.close()
    assert not server.running


def test_without_a_data_dir_nothing_survives_a_restart() -> None:
    server = EmbeddedRedis()
    try:
        server.start()
        with redis.Redis.from_url(server.url) as client:
            client.set("k", 1)
            server.kill()
            server.start()
            assert client.get("k") is None
    finally:
        server.close()


def test_stop_terminates_the_process_and_close_cleans_up() -> None:
    server = EmbeddedRedis()
    server.start()
    pid = server.pid
    assert pid is not None
    server.close()
    assert not server.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_an_occupied_explicit_port_is_a_clear_error() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = EmbeddedRedis(EmbeddedRedisConfig(port=port, start_timeout_s=5.0))
        with pytest.raises(EmbeddedRedisError, match=f"port {port}"):
            server.start()
        server.close()


def test_binary_lookup_and_config_validation() -> None:
    assert os.access(find_redis_server(), os.X_OK)
    assert find_redis_server("/nonexistent/redis-server") == find_redis_server()
    with pytest.raises(ValueError, match="appendfsync"):
        EmbeddedRedisConfig(appendfsync="sometimes")
    with pytest.raises(ValueError, match="password"):
        EmbeddedRedisConfig(password='has"quote')
    with pytest.raises(ValueError, match="port"):
        EmbeddedRedisConfig(port=-1)


OWNER = """
import sys, threading, time
from services.redis_embedded import EmbeddedRedis
server = EmbeddedRedis()
# Started from a thread that ends at once: the server must outlive the thread, not the process.
starter = threading.Thread(target=server.start)
starter.start()
starter.join()
print(server.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_server_outlives_its_starting_thread_but_not_a_sigkilled_owner() -> None:
    import subprocess
    import sys
    import time

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        time.sleep(0.3)  # the starting thread is long gone
        assert _alive(pid), "redis-server died with the thread that started it"
        owner.kill()
        owner.wait(timeout=10)
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(pid), "redis-server outlived its SIGKILLed owner"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
