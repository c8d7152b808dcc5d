"""`kvrelay serve decode` as a real process: it serves gRPC health (NOT_SERVING: its policy
service is unreachable) and its transfer endpoint on the ports it prints, and stops cleanly
on SIGTERM."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rpc.kvrelay.v1 import decode_pb2, decode_pb2_grpc

pytestmark = pytest.mark.timeout(150)
START_S = 90.0
LISTENING = re.compile(r"listening on (?P<grpc>\S+) \(rendezvous (?P<store>\S+)\)")


def _kvrelay() -> list[str]:
    return [sys.executable, "-c", "from kvrelay.cli import app; app()"]


def _wait_for_listening(process: subprocess.Popen[str]) -> re.Match[str]:
    """Read the process's output in a thread until the 'listening' line (bounded by START_S)."""
    lines: queue.Queue[str] = queue.Queue()
    assert process.stdout is not None
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline, seen = time.monotonic() + START_S, []
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=0.2))
        except queue.Empty:
            assert process.poll() is None, f"exited early with {process.returncode}: {''.join(seen)}"
            continue
        match = LISTENING.search(seen[-1])
        if match:
            return match
    raise AssertionError(f"no 'listening' line within {START_S}s: {''.join(seen)}")


def test_serve_decode_starts_serves_and_stops_on_sigterm(checkpoint: Path) -> None:
    command = [*_kvrelay(), "serve", "decode", "--checkpoint", str(checkpoint), "--port", "0",
               "--transfer-port", "0", "--worker-id", "decode-cli", "--torch-threads", "1",
               "--log-level", "WARNING", "--policy-address", "127.0.0.1:1", "--plaintext"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        match = _wait_for_listening(process)
        with grpc.insecure_channel(match["grpc"]) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvrelay.v1.DecodeWorker"), timeout=10
            )
            # Readiness: no policy service answers at --policy-address, so not ready.
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            endpoint = decode_pb2_grpc.DecodeWorkerStub(channel).GetTransferEndpoint(
                decode_pb2.GetTransferEndpointRequest(), timeout=10
            )
        assert (endpoint.rendezvous_address, endpoint.decode_worker) == (match["store"], "decode-cli")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
