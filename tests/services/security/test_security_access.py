"""Transport settings, token tables and the authorization decision (`services.security`), and a
real gRPC server in token mode (TLS without client certificates: where mTLS is not available,
callers authenticate with bearer tokens)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.rpc.errors import PermissionDenied, Unauthenticated
from services.rpc.kvrelay.v1 import policy_pb2, policy_pb2_grpc
from services.rpc.server import ServerConfig, ServiceBinding, start_server
from services.security.access import ACCESS, PUBLIC, authorize, identify
from services.security.certs import default_bundle
from services.security.roles import Identity, Role, roles_from_uris, spiffe_uri
from services.security.tokens import TokenFileError, TokenTable, new_token, token_line
from services.security.transport import (
    TransportConfigError,
    TransportSecurity,
    is_loopback,
    target_host,
)


def test_loopback_and_target_hosts() -> None:
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "kvrelay-policy", "::"))
    assert target_host("127.0.0.1:50061") == "127.0.0.1"
    assert target_host("[::1]:50061") == "::1"
    assert target_host("dns:///kvrelay-decode:50063") == "kvrelay-decode"
    assert target_host("ipv4:10.1.2.3:1") == "10.1.2.3"


def test_plaintext_is_loopback_only_unless_asked_and_tls_needs_its_material(tmp_path: Path) -> None:
    plain = TransportSecurity.local_plaintext()
    with pytest.raises(TransportConfigError, match="plaintext: plaintext gRPC to '10.0.0.7'"):
        plain.aio_channel("10.0.0.7:50061", Role.POLICY)
    TransportSecurity(plaintext=True, allow_remote_plaintext=True).channel("10.0.0.7:1", Role.POLICY).close()
    with pytest.raises(TransportConfigError, match="tls_cert: no TLS material"):
        TransportSecurity.from_files(cert=None, key=None, ca=None)
    (tmp_path / "junk.pem").write_text("not a certificate")
    (tmp_path / "x.pem").write_text("-----BEGIN CERTIFICATE-----")
    with pytest.raises(TransportConfigError, match="tls_key: TLS needs this file too"):
        TransportSecurity.from_files(cert=tmp_path / "x.pem", key=None, ca=tmp_path / "x.pem")
    with pytest.raises(TransportConfigError, match="tls_ca: .* is not PEM"):
        TransportSecurity.from_files(cert=None, key=None, ca=tmp_path / "junk.pem")
    with pytest.raises(TransportConfigError, match="tls_ca: cannot read"):
        TransportSecurity.from_files(cert=None, key=None, ca=tmp_path / "missing.pem")
    with pytest.raises(TransportConfigError, match="tls_ca: plaintext was asked for together"):
        TransportSecurity.from_files(cert=None, key=None, ca=tmp_path / "junk.pem", plaintext=True)
    with pytest.raises(TransportConfigError, match="auth_token: a bearer token is sent only over TLS"):
        TransportSecurity(plaintext=True, bearer_token="t")


async def test_a_plaintext_server_refuses_a_non_loopback_interface() -> None:
    with pytest.raises(TransportConfigError, match="not a loopback interface"):
        await start_server(ServerConfig(host="0.0.0.0", port=0), [])


def test_token_tables_parse_and_refuse_bad_lines(tmp_path: Path) -> None:
    token, line = new_token("alice", frozenset({Role.CLIENT}))
    table = TokenTable.from_text(f"# api keys\n{line}  # alice\n\n")
    assert table.identify(token) == Identity("alice", frozenset({Role.CLIENT}), "token")
    assert table.identify(token + "x") is None and table.identify("") is None
    assert table.identify("x" * 10_000) is None
    bad = {
        "abc alice client": "sha256 hex",
        f"{'0' * 64} alice": "expected",
        f"{'0' * 64} alice root": "unknown role",
        f"{'0' * 64} ../x client": "name",
    }
    for text, message in bad.items():
        with pytest.raises(TokenFileError, match=message):
            TokenTable.from_text(text, "tokens")
    with pytest.raises(TokenFileError, match="cannot read"):
        TokenTable.from_file(tmp_path / "missing")


def test_certificate_uris_name_one_holder() -> None:
    uris = [spiffe_uri(Role.GATEWAY, "gw"), spiffe_uri(Role.OPERATOR, "gw"), "spiffe://other/x/y"]
    assert roles_from_uris(uris) == ("gw", frozenset({Role.GATEWAY, Role.OPERATOR}))
    assert roles_from_uris([spiffe_uri(Role.GATEWAY, "a"), spiffe_uri(Role.DECODE, "b")]) is None
    assert roles_from_uris(["spiffe://kvrelay/root/x", "spiffe://kvrelay/gateway/a/b"]) is None


def test_authorize_follows_the_matrix_for_every_method_and_role() -> None:
    keys = TokenTable.from_text(token_line("k", "alice", frozenset({Role.CLIENT})))
    for method, rule in ACCESS.items():
        for role in Role:
            identity = Identity("x", frozenset({role}), "mtls")
            if role in rule.roles:
                authorize(method, identity, keys)
            else:
                with pytest.raises(PermissionDenied):
                    authorize(method, identity, keys)
        with pytest.raises(Unauthenticated):
            authorize(method, None, keys)
    for method in PUBLIC:
        authorize(method, None, keys)
    with pytest.raises(PermissionDenied, match="not open to any caller"):
        authorize("/kvrelay.v1.PolicyService/DropEverything", Identity("x", frozenset(Role), "mtls"), keys)
    # Without a token table, Generate asks for no API key.
    authorize("/kvrelay.v1.Gateway/Generate", None, TokenTable())


def test_identify_prefers_the_certificate_then_the_bearer_token() -> None:
    keys = TokenTable.from_text(token_line("secret", "bob", frozenset({Role.OPERATOR})))
    assert identify({}, [("authorization", "Bearer secret")], keys) == Identity(
        "bob", frozenset({Role.OPERATOR}), "token")
    assert identify({}, [("authorization", "Basic secret")], keys) is None
    assert identify({}, [], keys) is None


class _Fences(policy_pb2_grpc.PolicyServiceServicer):
    """A servicer whose GetFence answers at once: what reaches it passed authorization."""

    async def GetFence(  # type: ignore[override]
        self, request: policy_pb2.GetFenceRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.GetFenceResponse:
        return policy_pb2.GetFenceResponse()


async def test_token_mode_server_authenticates_by_bearer_token(tmp_path: Path) -> None:
    bundle = default_bundle(tmp_path / "certs")
    directory = bundle.directory
    token, line = new_token("worker-7", frozenset({Role.PREFILL}))
    client_token, client_line = new_token("someone", frozenset({Role.CLIENT}))
    (tmp_path / "tokens").write_text(f"{line}\n{client_line}\n")
    security = TransportSecurity.from_files(
        cert=directory / "policy.pem", key=directory / "policy.key", ca=directory / "ca.pem",
        require_client_cert=False, tokens_file=tmp_path / "tokens")
    binding = ServiceBinding("kvrelay.v1.PolicyService",
                             lambda server: policy_pb2_grpc.add_PolicyServiceServicer_to_server(_Fences(), server))
    server = await start_server(ServerConfig(port=0, shutdown_grace_s=0, security=security), [binding])
    ca = (directory / "ca.pem").read_bytes()

    async def call(bearer: str) -> grpc.StatusCode:
        client = TransportSecurity(root_certs=ca, bearer_token=bearer)
        async with client.aio_channel(server.address, Role.POLICY) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # open without a token
            try:
                await channel.unary_unary("/kvrelay.v1.PolicyService/GetFence")(b"", timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    try:
        assert await call("") == grpc.StatusCode.UNAUTHENTICATED
        assert await call("not-a-token") == grpc.StatusCode.UNAUTHENTICATED
        assert await call(client_token) == grpc.StatusCode.PERMISSION_DENIED
        assert await call(token) == grpc.StatusCode.OK
    finally:
        await server.stop(0)
