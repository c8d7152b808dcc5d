"""docker/healthcheck.py, the images' HEALTHCHECK: it finds the port of the service in the
container through the CLI's own parsing (flag > KVRELAY_<ROLE>_PORT > default) and reports
the real gRPC health status of a server on loopback."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from deploy_helpers import REPO, default_ports, envvars, serve_roles
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SCRIPT = REPO / "docker" / "healthcheck.py"


def load_script():
    spec = importlib.util.spec_from_file_location("kvrelay_healthcheck", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def healthcheck():
    return load_script()


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield port, servicer
    server.stop(grace=None).wait(5)


def run_script(*cmdline: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "KVRELAY_HEALTHCHECK_TIMEOUT_S": "2", **(env or {})}
    return subprocess.run([sys.executable, str(SCRIPT), *cmdline], capture_output=True, text=True,
                          env=environment, timeout=30, check=False)


def test_served_command_is_found_behind_tini_and_python(healthcheck) -> None:
    cmdline = ["tini", "--", "/opt/venv/bin/python", "/opt/venv/bin/kvrelay", "serve", "decode", "--port", "7"]
    assert healthcheck.served_command(cmdline) == ("decode", ["--port", "7"])
    with pytest.raises(healthcheck.NotAService):
        healthcheck.served_command(["tini", "--", "kvrelay", "generate", "hello"])


@pytest.mark.parametrize("role", sorted(serve_roles()))
def test_listen_address_follows_flag_then_env_then_default(healthcheck, role: str, monkeypatch) -> None:
    names = {param.name: name for name, param in envvars(serve_roles()[role]).items()}
    monkeypatch.delenv(names["port"], raising=False)
    monkeypatch.delenv(names["host"], raising=False)
    assert healthcheck.listen_address(role, []) == f"127.0.0.1:{default_ports()[role]['port']}"
    monkeypatch.setenv(names["port"], "40001")
    monkeypatch.setenv(names["host"], "0.0.0.0")
    assert healthcheck.listen_address(role, []) == "127.0.0.1:40001"
    assert healthcheck.listen_address(role, ["--port", "40002", "--host", "::"]) == "[::1]:40002"
    assert healthcheck.listen_address(role, ["--host", "10.1.2.3"]) == "10.1.2.3:40001"


def test_serving_server_is_healthy(health_server) -> None:
    port, _ = health_server
    done = run_script("kvrelay", "serve", "policy", "--host", "0.0.0.0", "--port", str(port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"127.0.0.1:{port} SERVING"


def test_port_from_the_environment_is_probed(healthcheck, health_server, monkeypatch, capsys) -> None:
    port, _ = health_server
    monkeypatch.setenv("KVRELAY_GATEWAY_PORT", str(port))
    assert healthcheck.main(["kvrelay", "serve", "gateway"]) == 0
    assert capsys.readouterr().out.strip() == f"127.0.0.1:{port} SERVING"


def test_not_serving_server_is_unhealthy(healthcheck, health_server, capsys) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["kvrelay", "serve", "decode", "--port", str(port)]) == 1
    assert capsys.readouterr().out.strip() == f"127.0.0.1:{port} NOT_SERVING"


def test_nothing_listening_is_unhealthy(healthcheck, capsys) -> None:
    with socket.socket() as probe:  # a port that was just free: connections are refused
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    assert healthcheck.main(["kvrelay", "serve", "prefill", "--port", str(closed_port)]) == 1
    assert f"unhealthy: UNAVAILABLE from 127.0.0.1:{closed_port}" in capsys.readouterr().err


def test_a_command_that_is_not_a_service_is_unhealthy(healthcheck, capsys) -> None:
    assert healthcheck.main(["kvrelay", "serve", "nonesuch"]) == 1
    assert "unknown role 'nonesuch'" in capsys.readouterr().err
    assert healthcheck.main(["kvrelay", "serve", "policy", "--port", "not-a-number"]) == 1
