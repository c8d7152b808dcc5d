"""docker/healthcheck.py, the images' HEALTHCHECK and the Kubernetes exec probe: it finds the
port of the service in the container through the CLI's own parsing (flag > KVRELAY_<ROLE>_PORT >
default), speaks the service's own transport (plaintext only with --plaintext; else mTLS with the
container's certificate from KVRELAY_TLS_* or the TLS flags, checking the server's certificate
for the role's name) and reports the real gRPC health status of a server on loopback."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_helpers import REPO, default_ports, envvars, serve_roles, start_health_server
from grpc_health.v1 import health, health_pb2

from services.redis_embedded import EmbeddedRedis, free_loopback_port
from services.security.certs import BundlePaths, default_bundle

SCRIPT = REPO / "docker" / "healthcheck.py"
TLS_VARIABLES = ("KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY", "KVRELAY_TLS_CA", "KVRELAY_PLAINTEXT")


def load_script():
    spec = importlib.util.spec_from_file_location("kvrelay_healthcheck", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def healthcheck():
    return load_script()


@pytest.fixture(autouse=True)
def no_inherited_transport(monkeypatch) -> None:
    """Each test says how the service it probes speaks; nothing comes from the caller's shell."""
    for name in TLS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> BundlePaths:
    """The development set of `kvrelay certs`: what compose and Kubernetes mount."""
    return default_bundle(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def foreign_bundle(tmp_path_factory: pytest.TempPathFactory) -> BundlePaths:
    """Certificates of the same names from another CA."""
    return default_bundle(tmp_path_factory.mktemp("foreign-certs"))


def tls_env(certs: BundlePaths, name: str) -> dict[str, str]:
    """The variables a container of identity `name` carries (k8s/base, docker/compose.yaml)."""
    leaves = {leaf: (cert, key) for leaf, cert, key in certs.leaves}
    cert, key = leaves[name]
    return {"KVRELAY_TLS_CERT": str(cert), "KVRELAY_TLS_KEY": str(key), "KVRELAY_TLS_CA": str(certs.ca_cert)}


@pytest.fixture
def mtls_health_server(bundle: BundlePaths) -> Iterator[int]:
    """A gRPC health service behind the policy identity's certificate that requires a client
    certificate from the bundle's CA (built with grpc directly, not with the code under test)."""
    directory = bundle.directory
    started = start_health_server(((directory / "policy.key").read_bytes(),
                                   (directory / "policy.pem").read_bytes(), bundle.ca_cert.read_bytes()))
    yield started.port
    started.server.stop(grace=None).wait(5)


@pytest.fixture
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    started = start_health_server()
    yield started.port, started.servicer
    started.server.stop(grace=None).wait(5)


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
    done = run_script("kvrelay", "serve", "policy", "--host", "0.0.0.0", "--port", str(port), "--plaintext")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"127.0.0.1:{port} SERVING"


def test_port_from_the_environment_is_probed(healthcheck, health_server, monkeypatch, capsys) -> None:
    port, _ = health_server
    monkeypatch.setenv("KVRELAY_GATEWAY_PORT", str(port))
    monkeypatch.setenv("KVRELAY_PLAINTEXT", "1")
    assert healthcheck.main(["kvrelay", "serve", "gateway"]) == 0
    assert capsys.readouterr().out.strip() == f"127.0.0.1:{port} SERVING"


def test_not_serving_server_is_unhealthy(healthcheck, health_server, capsys) -> None:
    port, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main(["kvrelay", "serve", "decode", "--port", str(port), "--plaintext"]) == 1
    assert capsys.readouterr().out.strip() == f"127.0.0.1:{port} NOT_SERVING"


def test_nothing_listening_is_unhealthy(healthcheck, capsys) -> None:
    with socket.socket() as probe:  # a port that was just free: connections are refused
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    assert healthcheck.main(["kvrelay", "serve", "prefill", "--port", str(closed_port), "--plaintext"]) == 1
    assert f"unhealthy: UNAVAILABLE from 127.0.0.1:{closed_port}" in capsys.readouterr().err


def test_a_command_that_is_not_a_service_is_unhealthy(healthcheck, capsys) -> None:
    assert healthcheck.main(["kvrelay", "serve", "nonesuch"]) == 1
    assert "unknown role 'nonesuch'" in capsys.readouterr().err
    assert healthcheck.main(["kvrelay", "serve", "policy", "--port", "not-a-number"]) == 1


def test_mtls_server_is_healthy_with_the_containers_certificate_from_the_environment(
        mtls_health_server: int, bundle: BundlePaths) -> None:
    port = mtls_health_server
    done = run_script("kvrelay", "serve", "policy", "--host", "0.0.0.0", "--port", str(port),
                      env=tls_env(bundle, "policy"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"127.0.0.1:{port} SERVING"


def test_tls_flags_of_the_serve_command_are_used_too(healthcheck, mtls_health_server: int,
                                                     bundle: BundlePaths, capsys) -> None:
    flags = [f"--tls-{kind}={value}" for kind, value in
             zip(("cert", "key", "ca"), tls_env(bundle, "policy").values(), strict=True)]
    assert healthcheck.main(["kvrelay", "serve", "policy", "--port", str(mtls_health_server), *flags]) == 0
    assert capsys.readouterr().out.strip().endswith("SERVING")


@pytest.mark.parametrize("case", ["plaintext", "another CA", "another role's name"])
def test_mtls_server_is_unhealthy_to_a_probe_that_does_not_verify(
        healthcheck, mtls_health_server: int, bundle: BundlePaths, foreign_bundle: BundlePaths,
        case: str, monkeypatch, capsys) -> None:
    """The SERVING answer above needs the right transport: a plaintext probe, a certificate
    from another CA, or a server certificate without the probed role's name all fail."""
    role, extra = "policy", []
    if case == "plaintext":
        extra = ["--plaintext"]
    for name, value in tls_env(foreign_bundle if case == "another CA" else bundle, "policy").items():
        if case != "plaintext":
            monkeypatch.setenv(name, value)
    if case == "another role's name":  # the policy's certificate does not name decode.kvrelay.internal
        role = "decode"
    assert healthcheck.main(["kvrelay", "serve", role, "--port", str(mtls_health_server), *extra]) == 1
    assert f"unhealthy: UNAVAILABLE from 127.0.0.1:{mtls_health_server}" in capsys.readouterr().err


def test_a_service_without_tls_material_or_plaintext_is_unhealthy(healthcheck, capsys) -> None:
    assert healthcheck.main(["kvrelay", "serve", "gateway", "--port", "1"]) == 1
    assert "no TLS material" in capsys.readouterr().err


def test_a_real_policy_service_with_mtls_from_the_environment_is_healthy(
        healthcheck, bundle: BundlePaths, redis_server: EmbeddedRedis, monkeypatch, capsys,
        tmp_path: Path) -> None:
    """`kvrelay serve policy` configured as the Kubernetes Deployment configures it (TLS paths in
    KVRELAY_TLS_*, nothing on its command line) and probed as the exec probe probes it."""
    port = free_loopback_port()
    env = {**os.environ, **tls_env(bundle, "policy"), "REDIS_URL": redis_server.url,
           "KVRELAY_POLICY_PORT": str(port), "KVRELAY_POLICY_METRICS_PORT": "0"}
    command = ["kvrelay", "serve", "policy"]
    log = tmp_path / "policy.log"
    with log.open("wb") as out:
        server = subprocess.Popen([str(Path(sys.executable).parent / "kvrelay"), "serve", "policy"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        for name in ("KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY", "KVRELAY_TLS_CA", "KVRELAY_POLICY_PORT"):
            monkeypatch.setenv(name, env[name])
        deadline = time.monotonic() + 60
        while healthcheck.main(command) != 0:
            assert server.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, f"not SERVING within 60 s: {log.read_text()[-2000:]}"
            time.sleep(0.2)
        assert capsys.readouterr().out.strip().splitlines()[-1] == f"127.0.0.1:{port} SERVING"
        monkeypatch.setenv("KVRELAY_PLAINTEXT", "1")
        for name in ("KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY", "KVRELAY_TLS_CA"):
            monkeypatch.delenv(name)
        assert healthcheck.main(command) == 1, "the real server speaks only TLS"
    finally:
        server.terminate()
        server.wait(timeout=20)
