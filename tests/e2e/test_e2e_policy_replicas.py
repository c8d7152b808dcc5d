"""`kvrelay up --policy-replicas 2` (issue 21): two policy-service processes on the one
redis-server the launcher runs, the gateway and the workers given both addresses (round
robin) and both framed Session listeners, where their per-request calls go. Real Generate requests keep running while one replica is SIGKILLed: none fails; the
supervisor restarts the replica and the stack keeps serving. The redis-server SIGKILLed in
turn comes back empty and every replica has the manifests again (from its journal); SIGTERM
stops everything, the redis-server last."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from e2e_helpers import E2E_ENV, KVRELAY, Output, alive, free_base_port, wait_gone

from services.gateway.client import GatewayClient, Generation, generate_request
from services.policy import PolicyClient, PolicyClientConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
LOAD_THREADS = 2
BEFORE_KILL = 6
AFTER_KILL = 16
MAX_REQUESTS = 400  # a bound on the load, far above what the checks need
DEADLINE_S = 60.0
DEFAULT_POLICIES = ("full", "window", "sink-recent", "snapkv", "snapkv-pyramid", "snapkv-adakv")


async def manifest_names(replica: str) -> list[str]:
    """The policies one replica lists once it is SERVING again (a restore makes it NOT_SERVING)."""
    async with PolicyClient(PolicyClientConfig(replica, timeout_s=10.0)) as client:
        deadline = time.monotonic() + 20
        while (problem := await client.check_serving(timeout_s=2.0)) is not None:
            assert time.monotonic() < deadline, problem
            await asyncio.sleep(0.1)
        return [ref.name for ref in await client.list_manifests()]


def serves_again(gateway: str, timeout_s: float) -> Generation:
    """The first Generate that succeeds within `timeout_s`; only UNAVAILABLE (no worker ready
    yet) is retried."""
    deadline = time.monotonic() + timeout_s
    with GatewayClient(gateway, timeout_s=30) as client:
        while True:
            try:
                return client.generate(generate_request("the quiet river", policy="snapkv", max_tokens=2))
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
            time.sleep(0.1)


def free_base_port_from(start: int) -> int:
    """`free_base_port`, scanning from `start`: two engineers' e2e runs at once do not both
    take the first free range above 41000 (and then race for its ports)."""
    for base in range(start, 60000, 97):
        with contextlib.ExitStack() as sockets:
            try:
                for port in range(base, base + 26):
                    sockets.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    return free_base_port()


def metric(metrics_port: int, family: str, *labels: str) -> float:
    """The sum of a replica's `family` samples whose labels contain each of `labels`, from its
    /metrics (0 while it cannot answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as reply:  # noqa: S310
            text = reply.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(family + "{") and all(label in line for label in labels))


def served_calls(metrics_port: int) -> float:
    """Policy calls (unary or in a Session) a replica answered OK."""
    return metric(metrics_port, "kvrelay_rpc_requests_total", "PolicyService/", '"OK"')


class Load:
    """Generate requests from `LOAD_THREADS` threads until stopped, `MAX_REQUESTS` are sent or
    the deadline passes; every failure is kept."""

    def __init__(self, gateway: str, deadline: float) -> None:
        self.gateway, self.deadline = gateway, deadline
        self.completed = 0
        self.failures: list[BaseException] = []
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._sent = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(LOAD_THREADS)]
        for thread in self._threads:
            thread.start()

    def _next(self) -> bool:
        with self._lock:
            self._sent += 1
            return self._sent <= MAX_REQUESTS and not self.stopped.is_set() and time.monotonic() < self.deadline

    def _run(self, index: int) -> None:
        with GatewayClient(self.gateway, timeout_s=30) as client:
            while self._next():
                try:
                    result = client.generate(generate_request(f"the old bridge {index}", policy="full", max_tokens=2))
                    assert result.summary.output_tokens >= 1
                except Exception as exc:  # noqa: BLE001 (every failure is counted and reported)
                    with self._lock:
                        self.failures.append(exc)
                else:
                    with self._lock:
                        self.completed += 1

    def until(self, condition: object) -> None:
        assert callable(condition)
        while not condition() and not self.failures:
            assert time.monotonic() < self.deadline and any(t.is_alive() for t in self._threads), \
                f"load stalled at {self.completed} requests"
            time.sleep(0.05)

    def stop(self) -> None:
        self.stopped.set()
        for thread in self._threads:
            thread.join(timeout=60)


def test_requests_ride_through_a_killed_policy_replica(checkpoint: Path, tmp_path: Path) -> None:
    base = free_base_port_from(random.randrange(42000, 58000))
    metrics = base + 4  # its ports (+0..+3, replica 1 +11) sit beside the gRPC ones, all free
    up = subprocess.Popen(
        [*KVRELAY, "up", "--checkpoint", str(checkpoint), "--policy-replicas", "2", "--base-port", str(base),
         "--metrics-base-port", str(metrics), "--http-port", "0", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **E2E_ENV},
    )
    output = Output(up)
    pids: dict[str, int] = {}
    try:
        started = output.wait_for(rf"kvrelay gateway listening on 127\.0\.0\.1:{base}\b|the stack did not start", 150)
        assert "did not start" not in started.group(0), output.text
        pids = {name: int(pid) for name, pid in re.findall(r"ready (\S+)\s+\S+\s+pid (\d+)", output.text)}
        assert sorted(pids) == ["decode-0", "gateway", "policy-0", "policy-1", "prefill-0", "redis"], output.text
        assert re.search(rf"ready policy-1\s+127\.0\.0\.1:{base + 20}\s", output.text), output.text

        load = Load(f"127.0.0.1:{base}", time.monotonic() + DEADLINE_S)
        try:
            load.until(lambda: load.completed >= BEFORE_KILL)
            # The replica that serves the most is lost: it has calls in flight (Session streams
            # may pin a client to one replica), so the kill is one the clients must ride out.
            served = [served_calls(metrics + 1 + 10 * i) for i in range(2)]
            # The per-request calls ride the replicas' framed sessions (base +14, +24), not gRPC.
            streams = {transport: [metric(metrics + 1 + 10 * i, "kvrelay_policy_sessions_total",
                                          f'transport="{transport}"') for i in range(2)]
                       for transport in ("framed", "grpc")}
            assert sum(streams["framed"]) >= 1 and sum(streams["grpc"]) == 0, streams
            lost = served.index(max(served))
            name, victim = f"policy-{lost}", pids[f"policy-{lost}"]
            assert served[lost] > 0, served
            os.kill(victim, signal.SIGKILL)
            killed_at = load.completed
            load.until(lambda: load.completed >= killed_at + AFTER_KILL)
        finally:
            load.stop()
        assert not load.failures, [repr(f) for f in load.failures[:3]]
        print(f"policy calls served before the kill {served}; {load.completed} requests, "
              f"{load.completed - killed_at} after {name} was SIGKILLed, none failed")

        # The supervisor restarts the replica on its port; the rest never stopped.
        match = output.wait_for(rf"ready {name}\s+\S+\s+pid (?!{victim}\b)(\d+)", 60)
        pids[name] = int(match.group(1))
        assert f"restarting {name} in 0.5 s" in output.text
        assert up.poll() is None and all(alive(pid) for pid in pids.values()), output.text[-2000:]

        # The shared redis-server lost (in memory: empty when restarted): the supervisor starts
        # it again and the replicas write the manifests back from their journals.
        os.kill(pids["redis"], signal.SIGKILL)
        match = output.wait_for(rf"ready redis\s+\S+\s+pid (?!{pids['redis']}\b)(\d+)", 30)
        pids["redis"] = int(match.group(1))
        for replica in (base + 10, base + 20):
            assert set(asyncio.run(manifest_names(f"127.0.0.1:{replica}"))) >= set(DEFAULT_POLICIES), replica
        for journal in ("policy-0-manifests.jsonl", "policy-1-manifests.jsonl"):  # one file each
            assert len((tmp_path / journal).read_bytes().splitlines()) >= len(DEFAULT_POLICIES), journal
        # The workers report NOT_SERVING while Redis is lost; the gateway sees them back within
        # its health interval (0.5 s), and serves again.
        assert serves_again(f"127.0.0.1:{base}", 20.0).summary.output_tokens >= 1
        assert up.poll() is None and all(alive(pid) for pid in pids.values()), output.text[-2000:]
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            assert up.wait(timeout=60) == 0, output.text[-3000:]
        finally:
            if up.poll() is None:
                up.kill()
    assert wait_gone(list(pids.values()), 10) == [], output.text[-2000:]
