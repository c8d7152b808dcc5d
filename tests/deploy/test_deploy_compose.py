"""docker/compose.yaml (and the GPU override): valid against the Compose specification's JSON
schema, every kvrelay service runs a real `kvrelay serve ROLE` with that role's own
environment names and default ports, addresses point at services that listen there, and the
stack is wired as documented (Redis password, per-role TLS identities and API keys from generated
files mounted as Compose secrets, never on a command line or in the compose files; the health
check speaks the service's TLS; Jaeger OTLP; health-gated start order)."""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from deploy_helpers import (
    COMPOSE_SECRETS_SCRIPT,
    GATEWAY_HTTP_PORT,
    POLICY_SESSION_PORT,
    PORT_PARAMS,
    REPO,
    copy_with_secrets,
    default_ports,
    envvars,
    is_library_env,
    package_version,
    parse_dockerfile,
    resolve_command,
    role_of,
    run_script,
    serve_roles,
    start_health_server,
)

from services.security.certs import peer_identity_from_pem
from services.security.roles import Role
from services.security.tokens import TokenTable
from services.security.transport import server_name

COMPOSE = REPO / "docker" / "compose.yaml"
COMPOSE_GPU = REPO / "docker" / "compose.gpu.yaml"
TLS_ENV = ("KVRELAY_TLS_CERT", "KVRELAY_TLS_KEY", "KVRELAY_TLS_CA")
FORBIDDEN_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--auth-token", "--auth-tokens",
                   "--api-key", "--plaintext", "--allow-remote-plaintext")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


@functools.cache
def compose_validator() -> jsonschema.protocols.Validator:
    """The Compose specification's schema, as vendored by check-jsonschema (offline)."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendor.joinpath("compose-spec.json").read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def kvrelay_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if str(s.get("image", "")).startswith("kvrelay:")}


def image_env(dockerfile: Path) -> dict[str, str]:
    return parse_dockerfile(dockerfile)[1][-1].env()


def effective_env(service: dict[str, Any]) -> dict[str, str]:
    """The image's ENV overlaid with the service's environment."""
    dockerfile = REPO / service["build"]["dockerfile"]
    return {**image_env(dockerfile), **{k: str(v) for k, v in service.get("environment", {}).items()}}


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("dns:///").rpartition(":")
    return host, int(port)


def listen_port(service: dict[str, Any]) -> int:
    command, rest = resolve_command(service["command"])
    port_var = next(name for name, p in envvars(command).items() if p.name == "port")
    return int(effective_env(service).get(port_var, default_ports()[role_of(service["command"])]["port"]))


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_files_follow_the_compose_specification(path: Path) -> None:
    compose_validator().validate(load(path))


def test_schema_check_rejects_a_misspelled_key() -> None:
    broken = load(COMPOSE)
    broken["services"]["gateway"]["healthcheck"]["intervall"] = "5s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        compose_validator().validate(broken)


def test_every_role_runs_once_with_its_own_environment_names() -> None:
    services = kvrelay_services(load(COMPOSE))
    assert sorted(role_of(s["command"]) for s in services.values()) == sorted(serve_roles())
    for name, service in services.items():
        command, rest = resolve_command(service["command"])
        command.make_context(command.name, rest)
        own = envvars(command)
        unknown = {var for var in service["environment"] if var not in own and not is_library_env(var)}
        assert not unknown, f"{name}: {sorted(unknown)} are not variables of `kvrelay {' '.join(service['command'])}`"
        defaults = default_ports()[role_of(service["command"])]
        pinned = {own[var].name: int(value) for var, value in service["environment"].items()
                  if var in own and own[var].name in PORT_PARAMS}
        assert pinned == defaults, f"{name}: ports {pinned}, the CLI's defaults are {defaults}"
        host_var = next(v for v, p in own.items() if p.name == "host")
        assert effective_env(service)[host_var] == "0.0.0.0", f"{name} must listen on every interface"


def test_addresses_point_at_services_listening_there() -> None:
    compose = load(COMPOSE)
    services = kvrelay_services(compose)
    by_role = {role_of(s["command"]): name for name, s in services.items()}
    address_roles = {"KVRELAY_POLICY_ADDRESS": "policy", "KVRELAY_PREFILL_WORKERS": "prefill",
                     "KVRELAY_DECODE_WORKERS": "decode"}
    seen = set()
    for service in services.values():
        for var, role in address_roles.items():
            if var in service["environment"]:
                host, port = host_port(service["environment"][var])
                assert host == by_role[role], f"{var} names {host}, the {role} service is {by_role[role]}"
                assert port == listen_port(services[host]), f"{var}: {host} listens on {listen_port(services[host])}"
                seen.add(var)
    assert seen == set(address_roles)
    # Every policy client makes its per-request calls on the framed sessions the policy serves.
    policy = services[by_role["policy"]]
    assert policy["environment"]["KVRELAY_POLICY_SESSION_PORT"] == str(POLICY_SESSION_PORT)
    for role in ("gateway", "prefill", "decode"):
        address = services[by_role[role]]["environment"]["KVRELAY_POLICY_SESSION_ADDRESS"]
        assert host_port(address) == (by_role["policy"], POLICY_SESSION_PORT), f"{role}: {address}"
    gateway = services[by_role["gateway"]]
    assert gateway["environment"]["KVRELAY_PREFILL_WORKERS"].startswith("dns:///"), "scaled workers are found by DNS"
    assert gateway["environment"]["KVRELAY_DECODE_WORKERS"].startswith("dns:///")


def test_images_are_built_from_this_repository() -> None:
    version = package_version()
    for path, flavor in ((COMPOSE, "cpu"), (COMPOSE_GPU, "cuda")):
        compose = load(path)
        for name, service in kvrelay_services(compose).items():
            assert service["image"] == f"kvrelay:{version}-{flavor}", name
            assert (COMPOSE.parent / service["build"]["context"]).resolve() == REPO
            dockerfile = REPO / service["build"]["dockerfile"]
            assert dockerfile.exists(), f"{name}: {dockerfile} is missing"
            assert (dockerfile.name == "Dockerfile.cuda") == (flavor == "cuda")


def test_healthchecks_run_the_images_health_script() -> None:
    script = next(c.destination for c in parse_dockerfile(REPO / "docker" / "Dockerfile")[1][-1].copies()
                  if c.sources == ("docker/healthcheck.py",))
    for name, service in kvrelay_services(load(COMPOSE)).items():
        assert service["healthcheck"]["test"] == ["CMD", "python", script], name


def test_start_order_waits_for_health() -> None:
    compose = load(COMPOSE)
    services = compose["services"]
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{dependency} has no healthcheck to wait for"
    by_role = {role_of(s["command"]): n for n, s in kvrelay_services(compose).items()}
    gateway_waits = {d for d, c in services[by_role["gateway"]]["depends_on"].items() if c["condition"] == "service_healthy"}
    assert gateway_waits == {by_role["policy"], by_role["prefill"], by_role["decode"]}
    assert services[by_role["policy"]]["depends_on"]["redis"]["condition"] == "service_healthy"
    for role in ("prefill", "decode"):
        assert services[by_role[role]]["depends_on"][by_role["policy"]]["condition"] == "service_healthy"


@pytest.fixture(scope="module")
def docker_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docker/ with its secrets generated by docker/generate-secrets.sh, as a user starts it."""
    return copy_with_secrets(COMPOSE.parent, tmp_path_factory.mktemp("compose") / "docker",
                             COMPOSE_SECRETS_SCRIPT.name, "secrets")


def env_file(directory: Path, service: dict[str, Any]) -> dict[str, str]:
    """The variables of the service's env_file (compose paths are relative to the file)."""
    lines = (directory / service["env_file"]).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_redis_requires_the_password_the_policy_service_uses(docker_copy: Path) -> None:
    compose = load(docker_copy / COMPOSE.name)
    services = compose["services"]
    redis = services["redis"]
    # redis-server reads a config file that includes the password from a Compose secret file.
    (conf,) = [c for c in redis["configs"] if c["source"] == "redis_conf"]
    assert redis["command"] == ["redis-server", conf["target"]]
    lines = compose["configs"]["redis_conf"]["content"].splitlines()
    assert "appendonly yes" in lines and "dir /data" in lines
    assert redis["secrets"] == ["redis_auth"]
    assert f"include /run/secrets/{redis['secrets'][0]}" in lines
    auth = (docker_copy / compose["secrets"]["redis_auth"]["file"]).read_text()
    (password,) = re.fullmatch(r"requirepass (\S+)\n", auth).groups()
    assert re.fullmatch(r"[0-9a-f]{64}", password), "32 random bytes, URL-safe"
    assert env_file(docker_copy, redis) == {"REDISCLI_AUTH": password}
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -q PONG"]
    policy = next(s for s in kvrelay_services(compose).values() if role_of(s["command"]) == "policy")
    assert "REDIS_URL" not in policy["environment"]
    url = env_file(docker_copy, policy)["REDIS_URL"]
    match = re.fullmatch(r"redis://:(?P<password>[^@]+)@(?P<host>[\w-]+):(?P<port>\d+)/\d+", url)
    assert match, url
    assert match["password"] == password and match["host"] == "redis" and match["port"] == "6379"
    assert "/data" in " ".join(redis["volumes"]), "AOF persistence on a volume"
    secrets_dir = docker_copy / "secrets"
    assert oct(secrets_dir.stat().st_mode & 0o777) == "0o700"
    assert (secrets_dir / ".gitignore").read_text() == "*\n", "generated secrets are never committed"


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_no_password_in_the_compose_files_or_on_a_command_line(path: Path) -> None:
    text = path.read_text()
    assert "kvrelay-dev" not in text and "PASSWORD" not in text, "no password or default for one"
    assert not re.search(r"redis://:[^@$]", text), "REDIS_URL with a password belongs in an env file"
    for name, service in load(path)["services"].items():
        words = [*service.get("command", []), *service.get("entrypoint", []),
                 *service.get("healthcheck", {}).get("test", [])]
        line = " ".join(str(w) for w in words)
        assert "requirepass" not in line and " -a " not in f" {line} " and "AUTH" not in line, name
        assert not any(flag in line for flag in FORBIDDEN_FLAGS), f"{name}: {line}"
    assert "BEGIN" not in text and "PRIVATE KEY" not in text, "no key material in the compose file"


def test_generate_secrets_keeps_existing_files_and_refuses_unsafe_passwords(docker_copy: Path) -> None:
    script = docker_copy / COMPOSE_SECRETS_SCRIPT.name
    auth = docker_copy / "secrets" / "redis-auth.conf"
    before = auth.read_text()
    assert run_script(script).returncode == 0 and auth.read_text() == before
    refused = run_script(script, "--force", env={"KVRELAY_REDIS_PASSWORD": "has/slash-and@at-sign"})
    assert refused.returncode == 2 and auth.read_text() == before


def test_jaeger_receives_otlp_from_every_service_and_ui_and_gateway_are_published() -> None:
    compose = load(COMPOSE)
    jaeger = compose["services"]["jaeger"]
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in jaeger["ports"]
    assert re.fullmatch(r"jaegertracing/all-in-one:\d+\.\d+\.\d+", jaeger["image"])
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+-alpine", compose["services"]["redis"]["image"])
    for name, service in kvrelay_services(compose).items():
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert service["environment"]["OTEL_SERVICE_NAME"] == f"kvrelay-{role_of(service['command'])}"
    gateway = next(s for s in kvrelay_services(compose).values() if role_of(s["command"]) == "gateway")
    port = default_ports()["gateway"]["port"]
    assert gateway["ports"] == [f"{port}:{port}", f"{GATEWAY_HTTP_PORT}:{GATEWAY_HTTP_PORT}"]
    assert gateway["environment"]["KVRELAY_GATEWAY_HTTP_PORT"] == str(GATEWAY_HTTP_PORT)


def test_gpu_override_puts_the_workers_on_cuda() -> None:
    base, gpu = load(COMPOSE), load(COMPOSE_GPU)
    assert set(gpu["services"]) == {"prefill", "decode"} <= set(base["services"])
    for name, service in gpu["services"].items():
        role = role_of(base["services"][name]["command"])
        own = envvars(serve_roles()[role])
        assert service["environment"]["KVRELAY_DEVICE"] == "cuda" and "KVRELAY_DEVICE" in own
        assert all(var in own or is_library_env(var) for var in service["environment"]), name
        assert service["environment"]["NCCL_SOCKET_IFNAME"] == "eth0"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


def secret_file(directory: Path, compose: dict[str, Any], service: dict[str, Any], path: str) -> Path:
    """The host file that Compose mounts at `path` (/run/secrets/<target>) in `service`."""
    assert path.startswith("/run/secrets/"), path
    target = path.removeprefix("/run/secrets/")
    sources = [s["source"] for s in service.get("secrets", []) if isinstance(s, dict) and s.get("target") == target]
    assert len(sources) == 1, f"{path}: {len(sources)} secrets mounted there"
    return directory / compose["secrets"][sources[0]]["file"]


def test_every_kvrelay_service_gets_its_roles_certificate_from_secret_files(docker_copy: Path) -> None:
    compose = load(docker_copy / COMPOSE.name)
    cas = set()
    for name, service in kvrelay_services(compose).items():
        role = role_of(service["command"])
        own = envvars(serve_roles()[role])
        env = service["environment"]
        files = {}
        for var in TLS_ENV:
            assert var in env and var in own, f"{name}: no {var}"
            files[var] = secret_file(docker_copy, compose, service, env[var])
        assert files["KVRELAY_TLS_CERT"].name == f"{role}.pem" and files["KVRELAY_TLS_KEY"].name == f"{role}.key"
        cert = x509.load_pem_x509_certificate(files["KVRELAY_TLS_CERT"].read_bytes())
        ca = x509.load_pem_x509_certificate(files["KVRELAY_TLS_CA"].read_bytes())
        cert.verify_directly_issued_by(ca)
        key = serialization.load_pem_private_key(files["KVRELAY_TLS_KEY"].read_bytes(), password=None)
        assert key.public_key().public_numbers() == cert.public_key().public_numbers(), name  # type: ignore[union-attr]
        identity = peer_identity_from_pem(files["KVRELAY_TLS_CERT"].read_bytes())
        assert identity is not None and Role(role) in identity[1], f"{name}: {identity}"
        dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        assert server_name(Role(role)) in dns and name in dns, f"{name}: {dns}"
        # Bind-mounted as they are: uid 10001 in the container reads the key; the directories
        # above it keep other host users out.
        assert files["KVRELAY_TLS_KEY"].stat().st_mode & 0o777 == 0o644
        assert oct(files["KVRELAY_TLS_KEY"].parent.stat().st_mode & 0o777) == "0o700"
        cas.add(files["KVRELAY_TLS_CA"])
    assert len(cas) == 1
    mounted = {Path(s["file"]).name for s in compose["secrets"].values()}
    assert "ca.key" not in mounted, "the CA's key is mounted nowhere"
    assert (docker_copy / "secrets" / "tls" / "ca.key").stat().st_mode & 0o777 == 0o600


def test_gateway_reads_api_keys_from_a_secret_file(docker_copy: Path) -> None:
    compose = load(docker_copy / COMPOSE.name)
    services = kvrelay_services(compose)
    gateway = next(s for s in services.values() if role_of(s["command"]) == "gateway")
    assert "KVRELAY_AUTH_TOKENS" in envvars(serve_roles()["gateway"])
    tokens = secret_file(docker_copy, compose, gateway, gateway["environment"]["KVRELAY_AUTH_TOKENS"])
    assert not TokenTable.from_file(tokens), "no key ships: Generate is open until one is added"
    assert tokens.stat().st_mode & 0o777 == 0o644
    others = [s for s in services.values() if role_of(s["command"]) != "gateway"]
    assert all("KVRELAY_AUTH_TOKENS" not in s["environment"] for s in others)


def test_generate_secrets_keeps_certificates_and_replaces_them_with_force(docker_copy: Path) -> None:
    script = docker_copy / COMPOSE_SECRETS_SCRIPT.name
    ca = docker_copy / "secrets" / "tls" / "ca.pem"
    api_keys = docker_copy / "secrets" / "api-keys"
    before, keys_before = ca.read_text(), api_keys.read_text()
    assert run_script(script).returncode == 0 and ca.read_text() == before
    refused = run_script(script, "--force", env={"KVRELAY": str(docker_copy / "no-such-kvrelay")})
    assert refused.returncode == 2 and "KVRELAY" in refused.stderr and ca.read_text() == before
    assert run_script(script, "--force").returncode == 0
    assert ca.read_text() != before, "--force makes a new CA"
    assert api_keys.read_text() == keys_before, "API keys are never replaced"
    assert (docker_copy / "secrets" / "tls" / "gateway.key").stat().st_mode & 0o777 == 0o644


@pytest.fixture
def role_health_server(docker_copy: Path) -> Iterator[Any]:
    """start(role) -> port of a gRPC health service behind the role's generated certificate,
    requiring a client certificate from the generated CA."""
    servers = []

    def start(role: str) -> int:
        tls = docker_copy / "secrets" / "tls"
        started = start_health_server(((tls / f"{role}.key").read_bytes(),
                                       (tls / f"{role}.pem").read_bytes(), (tls / "ca.pem").read_bytes()))
        servers.append(started.server)
        return started.port

    yield start
    for server in servers:
        server.stop(grace=None).wait(5)


@pytest.mark.parametrize("role", sorted(serve_roles()))
def test_the_health_check_finds_each_service_serving_over_mtls(docker_copy: Path, role_health_server,
                                                               role: str) -> None:
    """The service's health check with its compose environment (secret paths moved to the
    generated files) against a server holding the role's generated certificate: SERVING."""
    compose = load(docker_copy / COMPOSE.name)
    name, service = next((n, s) for n, s in kvrelay_services(compose).items() if role_of(s["command"]) == role)
    port = role_health_server(role)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env |= {k: str(v) for k, v in service["environment"].items()}
    for var in (*TLS_ENV, "KVRELAY_AUTH_TOKENS"):
        if var in env:
            env[var] = str(secret_file(docker_copy, compose, service, env[var]))
    port_var = next(v for v, p in envvars(serve_roles()[role]).items() if p.name == "port")
    env[port_var] = str(port)
    env["KVRELAY_HEALTHCHECK_TIMEOUT_S"] = "5"
    assert service["healthcheck"]["test"][1:2] == ["python"]
    done = subprocess.run([sys.executable, str(REPO / "docker" / "healthcheck.py"), "tini", "--", "kvrelay",
                           *service["command"]], capture_output=True, text=True, env=env, timeout=30, check=False)
    assert done.returncode == 0, f"{name}: {done.stderr}"
    assert done.stdout.strip() == f"127.0.0.1:{port} SERVING"
