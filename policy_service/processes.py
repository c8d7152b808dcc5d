"""Policy-service processes for benches and tests: `kvrelay serve policy` in a process of its
own (so that it shares no event loop with the load), one or several replicas on one Redis.

`policy_service_processes(redis_url, key_prefix, count)` yields the started replicas once each
is SERVING; each can be killed on its own (`PolicyProcess.kill`, SIGKILL: a replica lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.redis_embedded import free_loopback_port
from services.security.roles import Role
from services.security.transport import TransportSecurity

_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PolicyProcess:
    """One running replica: its gRPC address, /metrics port (0: off) and framed Session
    listener's address ("": off)."""

    address: str
    metrics_port: int
    process: subprocess.Popen[bytes]
    session_address: str = ""

    def kill(self) -> None:
        """SIGKILL: the replica is gone without draining (what a crashed pod does)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=_STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL if it did not exit in time."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()


def spawn(redis_url: str, key_prefix: str, security_args: Sequence[str], metrics: bool,
          extra_args: Sequence[str] = (), port: int = 0, framed: bool = False) -> PolicyProcess:
    """Start one `kvrelay serve policy` on free loopback ports, or gRPC on `port` (a replica
    back on its address), with a framed Session listener if `framed`; not yet waited for."""
    port, metrics_port = port or free_loopback_port(), free_loopback_port() if metrics else 0
    session_port = free_loopback_port() if framed else 0
    command = [sys.executable, "-m", "kvrelay", "serve", "policy", "--host", "127.0.0.1",
               "--port", str(port), "--key-prefix", key_prefix, "--metrics-port", str(metrics_port),
               "--session-port", str(session_port), *security_args, *extra_args]
    env = {**os.environ, "REDIS_URL": redis_url}  # not on the command line: it holds the password
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    return PolicyProcess(f"127.0.0.1:{port}", metrics_port, process,
                         f"127.0.0.1:{session_port}" if session_port else "")


@contextlib.asynccontextmanager
async def policy_service_processes(
    redis_url: str, key_prefix: str, count: int = 1, security_args: Sequence[str] = ("--plaintext",),
    security: TransportSecurity | None = None, metrics: bool = False, extra_args: Sequence[str] = (),
    framed: bool = False,
) -> AsyncIterator[list[PolicyProcess]]:
    """`count` replicas with `security_args` (their transport flags) on one Redis, each with a
    framed Session listener if `framed`; yields them once each is SERVING to a health check
    made with `security`; stops every one after."""
    replicas: list[PolicyProcess] = []
    try:
        for _ in range(count):
            replicas.append(spawn(redis_url, key_prefix, security_args, metrics, extra_args, framed=framed))
        await asyncio.gather(*(wait_serving(r.address, r.process, _START_TIMEOUT_S,
                                            security or TransportSecurity.local_plaintext()) for r in replicas))
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@contextlib.asynccontextmanager
async def policy_service_process(
    redis_url: str, key_prefix: str, security_args: Sequence[str] = ("--plaintext",),
    security: TransportSecurity | None = None,
) -> AsyncIterator[str]:
    """One replica (`policy_service_processes`); yields its address."""
    async with policy_service_processes(redis_url, key_prefix, 1, security_args, security) as replicas:
        yield replicas[0].address


async def wait_serving(address: str, process: subprocess.Popen[bytes], timeout_s: float,
                       security: TransportSecurity) -> None:
    """Until the service at `address` reports SERVING; RuntimeError if `process` exits."""
    deadline = time.monotonic() + timeout_s
    async with security.aio_channel(address, Role.POLICY) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"policy service exited with {process.returncode}")
            with contextlib.suppress(grpc.aio.AioRpcError):
                response = await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"policy service at {address} not SERVING after {timeout_s}s")
