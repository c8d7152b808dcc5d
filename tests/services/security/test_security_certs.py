"""Development certificates (`services.security.certs`, `kvrelay certs`): the chain verifies, the
SANs carry the SPIFFE identities and hosts, the files land with the right modes and refusals,
and a real grpc mTLS handshake accepts the bundle and rejects foreign or missing client certs."""

from __future__ import annotations

import ipaddress
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from typer.testing import CliRunner

from kvrelay.cli import app
from services.security.certs import (
    CertificateError,
    IdentitySpec,
    create_ca,
    default_bundle,
    issue,
    peer_identity_from_pem,
    write_bundle,
)
from services.security.roles import Role, spiffe_uri

HOSTS = ("localhost", "127.0.0.1", "::1", "kvrelay-policy")
GATEWAY_ROLES = frozenset({Role.GATEWAY, Role.OPERATOR})


@pytest.fixture(scope="module")
def ca() -> tuple[bytes, bytes]:
    return create_ca("test CA", 2)


def _sans(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_leaf_chains_to_ca_with_identity_hosts_and_usages(ca: tuple[bytes, bytes]) -> None:
    ca_cert = x509.load_pem_x509_certificate(ca[0])
    leaf_pem, key_pem = issue(*ca, "gateway", GATEWAY_ROLES, HOSTS, 1)
    leaf = x509.load_pem_x509_certificate(leaf_pem)

    leaf.verify_directly_issued_by(ca_cert)  # issuer name and signature
    constraints = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0
    ca_usage = ca_cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_usage.key_cert_sign and ca_usage.crl_sign
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == ca_ski.digest
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}

    sans = _sans(leaf)
    assert sorted(sans.get_values_for_type(x509.UniformResourceIdentifier)) == [
        spiffe_uri(Role.GATEWAY, "gateway"), spiffe_uri(Role.OPERATOR, "gateway")]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "kvrelay-policy"]
    assert sans.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    key = x509.load_pem_x509_certificate(leaf_pem).public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    assert b"PRIVATE KEY" in key_pem
    assert peer_identity_from_pem(leaf_pem) == ("gateway", GATEWAY_ROLES)


def test_leaf_from_another_ca_does_not_verify(ca: tuple[bytes, bytes]) -> None:
    other = create_ca("other CA", 1)
    leaf = x509.load_pem_x509_certificate(issue(*other, "policy", [Role.POLICY], HOSTS, 1)[0])
    with pytest.raises(ValueError):
        leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca[0]))


def test_peer_identity_none_without_kvrelay_uri_or_with_two_names(ca: tuple[bytes, bytes]) -> None:
    ca_cert = x509.load_pem_x509_certificate(ca[0])
    plain = _foreign_leaf(ca, [x509.DNSName("localhost"), x509.UniformResourceIdentifier("https://x/y")])
    two = _foreign_leaf(ca, [x509.UniformResourceIdentifier(spiffe_uri(Role.GATEWAY, "a")),
                             x509.UniformResourceIdentifier(spiffe_uri(Role.DECODE, "b"))])
    x509.load_pem_x509_certificate(plain).verify_directly_issued_by(ca_cert)
    assert peer_identity_from_pem(plain) is None
    assert peer_identity_from_pem(two) is None
    with pytest.raises(CertificateError, match="cert_pem"):
        peer_identity_from_pem(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


def _foreign_leaf(ca: tuple[bytes, bytes], names: list[x509.GeneralName]) -> bytes:
    """A leaf signed by the CA with arbitrary SANs (what `issue` never writes)."""
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization

    ca_cert = x509.load_pem_x509_certificate(ca[0])
    ca_key = serialization.load_pem_private_key(ca[1], password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(ca_cert.subject).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_issue_rejects_mismatched_or_bad_inputs(ca: tuple[bytes, bytes]) -> None:
    other = create_ca("other CA", 1)
    with pytest.raises(CertificateError, match="ca_key: does not match"):
        issue(ca[0], other[1], "x", [Role.CLIENT], HOSTS, 1)
    leaf_pem, leaf_key = issue(*ca, "x", [Role.CLIENT], HOSTS, 1)
    with pytest.raises(CertificateError, match="ca_cert: is not a CA"):
        issue(leaf_pem, leaf_key, "y", [Role.CLIENT], HOSTS, 1)
    with pytest.raises(CertificateError, match="ca_cert: unreadable"):
        issue(b"garbage", ca[1], "x", [Role.CLIENT], HOSTS, 1)
    with pytest.raises(CertificateError, match="^name:"):
        issue(*ca, "a/b", [Role.CLIENT], HOSTS, 1)
    with pytest.raises(CertificateError, match="^roles:"):
        issue(*ca, "x", [], HOSTS, 1)
    with pytest.raises(CertificateError, match="^hosts:"):
        issue(*ca, "x", [Role.CLIENT], ["bad host!"], 1)
    with pytest.raises(CertificateError, match="^valid_days:"):
        issue(*ca, "x", [Role.CLIENT], HOSTS, 0)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_default_bundle_layout_roles_and_modes(tmp_path: Path) -> None:
    bundle = default_bundle(tmp_path / "certs", hosts=["10.1.2.3"], valid_days=1)
    expected = {"policy": {Role.POLICY}, "gateway": GATEWAY_ROLES, "prefill": {Role.PREFILL},
                "decode": {Role.DECODE}, "operator": {Role.OPERATOR}, "client": {Role.CLIENT}}
    assert bundle.ca_created and _mode(bundle.ca_key) == 0o600
    ca_cert = x509.load_pem_x509_certificate(bundle.ca_cert.read_bytes())
    assert {name for name, _, _ in bundle.leaves} == set(expected)
    for name, cert_path, key_path in bundle.leaves:
        assert (cert_path, key_path) == (bundle.directory / f"{name}.pem", bundle.directory / f"{name}.key")
        assert _mode(key_path) == 0o600
        pem = cert_path.read_bytes()
        x509.load_pem_x509_certificate(pem).verify_directly_issued_by(ca_cert)
        assert peer_identity_from_pem(pem) == (name, frozenset(expected[name]))
    decode = x509.load_pem_x509_certificate((bundle.directory / "decode.pem").read_bytes())
    dns = _sans(decode).get_values_for_type(x509.DNSName)
    assert {"decode", "kvrelay-decode", "kvrelay-decode.kvrelay.svc.cluster.local",
            "*.kvrelay-decode.kvrelay.svc.cluster.local"} <= set(dns)
    assert "kvrelay-policy" not in dns  # a worker cannot pass for the policy service
    assert ipaddress.ip_address("10.1.2.3") in _sans(decode).get_values_for_type(x509.IPAddress)
    assert sorted(p.name for p in bundle.directory.iterdir()) == sorted(
        ["ca.pem", "ca.key", *(f"{n}.{s}" for n in expected for s in ("pem", "key"))])


def test_no_overwrite_without_force_and_reuse_of_existing_ca(tmp_path: Path) -> None:
    first = default_bundle(tmp_path, valid_days=1)
    ca_pem = first.ca_cert.read_bytes()
    policy_pem = (tmp_path / "policy.pem").read_bytes()
    with pytest.raises(CertificateError, match="a CA exists here"):
        default_bundle(tmp_path, valid_days=1)
    assert first.ca_cert.read_bytes() == ca_pem and (tmp_path / "policy.pem").read_bytes() == policy_pem

    extra = write_bundle(tmp_path, [IdentitySpec("extra", frozenset({Role.OPERATOR}))], 1)
    assert not extra.ca_created and first.ca_cert.read_bytes() == ca_pem
    extra_pem = (tmp_path / "extra.pem").read_bytes()
    x509.load_pem_x509_certificate(extra_pem).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca_pem))
    assert _mode(tmp_path / "extra.key") == 0o600
    with pytest.raises(CertificateError, match="extra.pem: exists"):
        write_bundle(tmp_path, [IdentitySpec("extra", frozenset({Role.OPERATOR}))], 1)
    write_bundle(tmp_path, [IdentitySpec("extra", frozenset({Role.CLIENT}))], 1, force=True)
    assert peer_identity_from_pem((tmp_path / "extra.pem").read_bytes()) == (
        "extra", frozenset({Role.CLIENT}))
    assert first.ca_cert.read_bytes() == ca_pem  # --force on one identity keeps the CA

    replaced = default_bundle(tmp_path, valid_days=1, force=True)
    assert replaced.ca_created and replaced.ca_cert.read_bytes() != ca_pem
    (tmp_path / "ca.key").write_bytes(create_ca("other", 1)[1])
    with pytest.raises(CertificateError, match="ca_key: does not match"):
        write_bundle(tmp_path, [IdentitySpec("more", frozenset({Role.CLIENT}))], 1)
    assert not (tmp_path / "more.pem").exists()


def test_cli_writes_bundle_adds_identity_and_exits_2_on_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    directory = tmp_path / "d"
    result = runner.invoke(app, ["certs", "--dir", str(directory), "--days", "1", "--host", "node-1"])
    assert result.exit_code == 0, result.output
    assert "CA (created)" in result.output and "gateway.pem" in result.output
    assert "node-1" in _sans(x509.load_pem_x509_certificate(
        (directory / "policy.pem").read_bytes())).get_values_for_type(x509.DNSName)

    result = runner.invoke(app, ["certs", "--name", "extra", "--role", "operator", "--role", "client"],
                           env={"KVRELAY_CERTS_DIR": str(directory)})
    assert result.exit_code == 0, result.output
    assert "CA (reused)" in result.output and "extra.key" in result.output
    assert peer_identity_from_pem((directory / "extra.pem").read_bytes()) == (
        "extra", frozenset({Role.OPERATOR, Role.CLIENT}))

    bad = [
        (["certs", "--dir", str(directory)], "a CA exists here"),
        (["certs", "--dir", str(directory), "--name", "x"], "needs at least one --role"),
        (["certs", "--dir", str(directory), "--role", "client"], "needs --name"),
        (["certs", "--dir", str(directory), "--name", "x", "--role", "root"], "is not one of"),
        (["certs", "--dir", str(directory), "--name", "../x", "--role", "client"], "name:"),
        (["certs", "--dir", str(directory), "--name", "x", "--role", "client", "--host", "a b"],
         "hosts:"),
    ]
    for args, message in bad:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    assert not (directory / "x.pem").exists()
    result = runner.invoke(app, ["certs", "--dir", str(directory), "--force"])
    assert result.exit_code == 0 and "CA (created)" in result.output


class _RecordingHealth(HealthServicer):
    """The standard health service, recording the peer certificate each Check arrived with."""

    def __init__(self) -> None:
        super().__init__()
        self.peers: list[list[bytes]] = []

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        self.peers.append(list(context.auth_context().get("x509_pem_cert", [])))
        return await super().Check(request, context)


@dataclass(frozen=True)
class _TlsServer:
    port: int
    no_ip_port: int  # serves a certificate whose only host is localhost
    health: _RecordingHealth
    ca_pem: bytes
    certs: Path


@pytest.fixture
async def tls_server(tmp_path: Path) -> AsyncIterator[_TlsServer]:
    bundle = default_bundle(tmp_path, valid_days=1)
    write_bundle(tmp_path, [IdentitySpec("no-ip", frozenset({Role.POLICY}), ("localhost",))], 1)
    ca_pem = bundle.ca_cert.read_bytes()
    server = grpc.aio.server()
    health = _RecordingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port, no_ip_port = (
        server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [((tmp_path / f"{name}.key").read_bytes(), (tmp_path / f"{name}.pem").read_bytes())],
            root_certificates=ca_pem, require_client_auth=True))
        for name in ("policy", "no-ip"))
    await server.start()
    try:
        yield _TlsServer(port, no_ip_port, health, ca_pem, tmp_path)
    finally:
        await server.stop(None)


async def _check(target: str, credentials: grpc.ChannelCredentials,
                 options: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(target, credentials, options=options) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return grpc.StatusCode.OK


async def test_grpc_mtls_by_ip_sees_the_peer_identity(tls_server: _TlsServer) -> None:
    certs = tls_server.certs
    gateway_pem = (certs / "gateway.pem").read_bytes()
    credentials = grpc.ssl_channel_credentials(
        tls_server.ca_pem, (certs / "gateway.key").read_bytes(), gateway_pem)
    # No ssl_target_name_override: grpc checks 127.0.0.1 against the server's IP SAN (a server
    # certificate without it fails the same dial), and "localhost" against its DNS SAN.
    assert await _check(f"127.0.0.1:{tls_server.port}", credentials) == grpc.StatusCode.OK
    assert await _check(f"127.0.0.1:{tls_server.no_ip_port}", credentials) == (
        grpc.StatusCode.UNAVAILABLE)
    assert await _check(f"localhost:{tls_server.no_ip_port}", credentials) == grpc.StatusCode.OK
    assert tls_server.health.peers == [[gateway_pem], [gateway_pem]]
    assert peer_identity_from_pem(tls_server.health.peers[0][0]) == ("gateway", GATEWAY_ROLES)


async def test_grpc_rejects_foreign_ca_missing_cert_and_unlisted_host(
    tls_server: _TlsServer, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    foreign_dir = tmp_path_factory.mktemp("foreign")
    default_bundle(foreign_dir, valid_days=1)
    target = f"127.0.0.1:{tls_server.port}"
    foreign = grpc.ssl_channel_credentials(
        tls_server.ca_pem, (foreign_dir / "gateway.key").read_bytes(),
        (foreign_dir / "gateway.pem").read_bytes())
    assert await _check(target, foreign) == grpc.StatusCode.UNAVAILABLE
    anonymous = grpc.ssl_channel_credentials(tls_server.ca_pem)
    assert await _check(target, anonymous) == grpc.StatusCode.UNAVAILABLE
    # The server's certificate must name the host dialled: the policy cert has no kvrelay-decode.
    certs = tls_server.certs
    valid = grpc.ssl_channel_credentials(
        tls_server.ca_pem, (certs / "gateway.key").read_bytes(), (certs / "gateway.pem").read_bytes())
    override = (("grpc.ssl_target_name_override", "kvrelay-decode"),)
    assert await _check(target, valid, override) == grpc.StatusCode.UNAVAILABLE
    assert tls_server.health.peers == []  # no handler ran for any of them
