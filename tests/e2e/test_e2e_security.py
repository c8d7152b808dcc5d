"""The authorization matrix on a live local stack with mutual TLS: every RPC of every service,
called by every role, by an anonymous caller and by a caller whose certificate comes from
another CA, ends as designed — allowed (the handler ran: OK or its own validation error),
UNAUTHENTICATED, PERMISSION_DENIED, or refused in the TLS handshake (internal services require
a client certificate from the deployment's CA, so such a caller never reaches a handler).

The expected table is written out here by hand, from the issue's rules, rather than read from
`services.security.access.ACCESS`: a change to the matrix must change this test too. Every
call sends an empty message, so an allowed call is stopped by the handler's own validation and
changes nothing; the request-level rules (who publishes which phase, who owns a request id)
and one real generation through every hop follow.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from e2e_helpers import E2E_ENV, KVRELAY, Output, free_base_port, wait_gone
from grpc_reflection.v1alpha import reflection_pb2

from services.gateway.client import GatewayClient, generate_request
from services.launcher.stack import Stack, StackConfig
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2
from services.security.certs import IdentitySpec, default_bundle, write_bundle
from services.security.roles import Role
from services.security.tokens import token_line
from services.security.transport import TransportSecurity

pytestmark = pytest.mark.slow

CALL_S = 10.0
API_KEY = "alice-api-key-0123456789abcdef"
OPERATOR_TOKEN = "bob-operator-token-0123456789abcdef"

# (service the method lives on, method, streaming)
METHODS: tuple[tuple[str, str, str], ...] = (
    ("policy", "/kvrelay.v1.PolicyService/RegisterManifest", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/GetManifest", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/ListManifests", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/BeginRequest", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/PublishState", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/GetFence", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/EndRequest", "unary"),
    ("policy", "/kvrelay.v1.PolicyService/Session", "bidi"),
    ("prefill", "/kvrelay.v1.PrefillWorker/Prefill", "unary"),
    ("prefill", "/kvrelay.v1.OffloadService/Recall", "unary"),
    ("prefill", "/kvrelay.v1.OffloadService/RenewLease", "unary"),
    ("prefill", "/kvrelay.v1.OffloadService/Release", "unary"),
    ("decode", "/kvrelay.v1.DecodeWorker/GetTransferEndpoint", "unary"),
    ("decode", "/kvrelay.v1.DecodeWorker/AcceptTransfer", "unary"),
    ("decode", "/kvrelay.v1.DecodeWorker/StreamTokens", "stream"),
    ("gateway", "/kvrelay.v1.Gateway/Generate", "stream"),
)
INTERNAL = ("policy", "prefill", "decode")
CERT_CALLERS = ("gateway", "prefill", "decode", "operator", "client", "policy")
CALLERS = (*CERT_CALLERS, "anonymous", "foreign", "api-key", "operator-token", "bad-key")

ALLOWED, UNAUTH, DENIED, HANDSHAKE = "allowed", "UNAUTHENTICATED", "PERMISSION_DENIED", "handshake"

# Who may call each internal method (every other certificate holder: PERMISSION_DENIED).
MAY_CALL = {
    "RegisterManifest": {"operator"},
    "GetManifest": {"gateway", "prefill", "decode", "operator"},
    "ListManifests": {"gateway", "prefill", "decode", "operator"},
    "BeginRequest": {"gateway"},
    "PublishState": {"prefill", "decode"},
    "GetFence": {"gateway", "prefill", "decode", "operator"},
    "EndRequest": {"gateway"},
    "Session": {"gateway", "prefill", "decode", "operator"},  # its calls: their own rules (below)
    "Prefill": {"gateway"},
    "Recall": {"decode"},
    "RenewLease": {"decode"},
    "Release": {"decode"},
    "GetTransferEndpoint": {"prefill"},
    "AcceptTransfer": {"prefill"},
    "StreamTokens": {"gateway"},
}


def expected(service: str, method: str, caller: str) -> str:
    name = method.rsplit("/", 1)[1]
    # The stack's gateway certificate also holds the operator role (it registers the default
    # manifests at start-up); the "gateway" caller here holds the gateway role alone.
    if service in INTERNAL:
        if caller in ("anonymous", "foreign", "api-key", "operator-token", "bad-key"):
            return HANDSHAKE  # no client certificate from the deployment's CA
        return ALLOWED if caller in MAY_CALL[name] else DENIED
    # The gateway asks for no client certificate: clients present an API key (--auth-tokens).
    if caller == "api-key":
        return ALLOWED
    if caller == "operator-token":
        return DENIED  # a known token without the client role
    return UNAUTH


@dataclass(frozen=True)
class Secured:
    stack: Stack
    certs: Path
    foreign: Path

    def security(self, caller: str) -> TransportSecurity:
        ca = self.certs / "ca.pem"
        if caller in CERT_CALLERS:
            name = f"as-{caller}"
            return TransportSecurity.from_files(cert=self.certs / f"{name}.pem", key=self.certs / f"{name}.key", ca=ca)
        if caller == "foreign":
            return TransportSecurity.from_files(cert=self.foreign / "gateway.pem",
                                                key=self.foreign / "gateway.key", ca=ca)
        token = {"api-key": API_KEY, "operator-token": OPERATOR_TOKEN, "bad-key": "not-a-known-key"}
        return TransportSecurity(root_certs=ca.read_bytes(), bearer_token=token.get(caller, ""))

    def address(self, service: str) -> str:
        stack = self.stack
        return {"policy": stack.policy_address, "prefill": stack.prefill_addresses[0],
                "decode": stack.decode_addresses[0], "gateway": stack.gateway_address}[service]


@pytest.fixture(scope="module")
def secured(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root = tmp_path_factory.mktemp("mtls")
    certs, foreign = root / "certs", root / "foreign"
    default_bundle(certs)
    default_bundle(foreign)  # another CA, the same names
    roles = {"gateway": Role.GATEWAY, "prefill": Role.PREFILL, "decode": Role.DECODE,
             "operator": Role.OPERATOR, "client": Role.CLIENT, "policy": Role.POLICY}
    write_bundle(certs, [IdentitySpec(f"as-{caller}", frozenset({role})) for caller, role in roles.items()])
    tokens = root / "tokens"
    tokens.write_text(f"{token_line(API_KEY, 'alice', frozenset({Role.CLIENT}))}\n"
                      f"{token_line(OPERATOR_TOKEN, 'bob', frozenset({Role.OPERATOR}))}\n")
    config = StackConfig.with_free_ports(
        checkpoint, tls_dir=certs, log_dir=root / "logs", metrics_base_port=0,
        extra_args=(("gateway", ("--auth-tokens", str(tokens))),))
    with Stack(config) as stack:
        yield Secured(stack, certs, foreign)


def outcome(secured: Secured, service: str, method: str, kind: str, caller: str) -> str:
    peer = Role(service)
    with secured.security(caller).channel(secured.address(service), peer) as channel:
        try:
            if kind == "unary":
                channel.unary_unary(method)(b"", timeout=CALL_S)
            elif kind == "bidi":  # opened and half-closed at once: admitted or refused
                for _ in channel.stream_stream(method)(iter(()), timeout=CALL_S):
                    break
            else:
                for _ in channel.unary_stream(method)(b"", timeout=CALL_S):
                    break
        except grpc.RpcError as error:
            return _classify(error)
    return ALLOWED


def _classify(error: grpc.RpcError) -> str:
    code = error.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        return HANDSHAKE  # told apart from a dead server: a certificate holder reached it
    return ALLOWED  # the handler ran and refused the empty message itself


def test_every_rpc_by_every_caller_is_allowed_or_refused_as_designed(secured: Secured) -> None:
    got = {(m, c): outcome(secured, s, m, k, c) for s, m, k in METHODS for c in CALLERS}
    want = {(m, c): expected(s, m, c) for s, m, _ in METHODS for c in CALLERS}
    wrong = {key: (got[key], want[key]) for key in want if got[key] != want[key]}
    assert not wrong, f"(method, caller): (got, expected): {wrong}"
    assert sum(v == ALLOWED for v in got.values()) == 1 + sum(len(v) for v in MAY_CALL.values())


def test_health_is_open_to_certificate_holders_and_reflection_needs_a_kvrelay_identity(secured: Secured) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for service in INTERNAL:
        for caller in ("client", "foreign"):
            with secured.security(caller).channel(secured.address(service), Role(service)) as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=CALL_S)
                    result = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.RpcError as error:
                    result = _classify(error)
            assert result == ("SERVING" if caller == "client" else HANDSHAKE), (service, caller)
        with secured.security("client").channel(secured.address(service), Role(service)) as channel:
            info = channel.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                         request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                         response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
            replies = list(info(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=CALL_S))
        assert replies and replies[0].list_services_response.service


def test_a_worker_cannot_pass_for_the_policy_service(secured: Secured) -> None:
    """Clients check the server's role name: a prefill worker's port answering as 'policy' fails."""
    channel = secured.security("gateway").channel(secured.address("prefill"), Role.POLICY)
    with channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/kvrelay.v1.PolicyService/GetFence")(b"", timeout=CALL_S)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def _policy_call(secured: Secured, caller: str, method: str, request: bytes) -> grpc.StatusCode:
    with secured.security(caller).channel(secured.address("policy"), Role.POLICY) as channel:
        try:
            channel.unary_unary(f"/kvrelay.v1.PolicyService/{method}")(request, timeout=CALL_S)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_each_call_in_a_session_is_held_to_its_own_methods_rule(secured: Secured) -> None:
    """A Session admits every internal role; inside it a call of a method the caller may not
    make is PERMISSION_DENIED in its own reply, and the stream serves the caller's next call."""
    from services.policy import PolicyClient, PolicyClientConfig
    from services.policy.errors import PolicyPermissionDenied

    async def calls(caller: str) -> dict[str, str]:
        config = PolicyClientConfig(secured.address("policy"), timeout_s=CALL_S, session_streams=1,
                                    security=secured.security(caller))
        outcomes: dict[str, str] = {}
        async with PolicyClient(config) as client:
            for name, call in (("BeginRequest", client.begin_request(f"session-{caller}")),
                               ("GetFence", client.get_fence(f"session-{caller}")),
                               ("EndRequest", client.end_request(f"session-{caller}", 1))):
                try:
                    await call
                    outcomes[name] = ALLOWED
                except PolicyPermissionDenied:
                    outcomes[name] = DENIED
                except Exception:  # noqa: BLE001 (the handler ran and refused the call itself)
                    outcomes[name] = ALLOWED
            assert client._sessions is not None  # all of it over the stream, none fell back
        return outcomes

    for caller in ("gateway", "decode", "operator"):
        got = asyncio.run(calls(caller))
        assert got == {name: ALLOWED if caller in MAY_CALL[name] else DENIED for name in got}, caller


def test_request_ids_belong_to_the_identity_that_began_them(secured: Secured) -> None:
    begin = policy_pb2.BeginRequestRequest(request_id="owned-by-as-gateway").SerializeToString()
    assert _policy_call(secured, "gateway", "BeginRequest", begin) == grpc.StatusCode.OK
    # The stack's own gateway certificate holds the gateway role under another name.
    stack_gateway = TransportSecurity.from_files(
        cert=secured.certs / "gateway.pem", key=secured.certs / "gateway.key", ca=secured.certs / "ca.pem")
    with stack_gateway.channel(secured.address("policy"), Role.POLICY) as channel:
        for method, request in (("BeginRequest", begin), ("EndRequest", policy_pb2.EndRequestRequest(
                request_id="owned-by-as-gateway", request_generation=1).SerializeToString())):
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(f"/kvrelay.v1.PolicyService/{method}")(request, timeout=CALL_S)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method


def test_only_prefill_publishes_prefilled_and_only_decode_recalled_states(secured: Secured) -> None:
    def publish(caller: str, phase: int) -> grpc.StatusCode:
        request = policy_pb2.PublishStateRequest(request_id="no-such-request", phase=phase)
        return _policy_call(secured, caller, "PublishState", request.SerializeToString())

    prefilled, recalled = common_pb2.PHASE_PREFILLED, common_pb2.PHASE_RECALLED
    assert publish("decode", prefilled) == grpc.StatusCode.PERMISSION_DENIED
    assert publish("prefill", recalled) == grpc.StatusCode.PERMISSION_DENIED
    # The right role gets past authorization to the request's own validation.
    assert publish("prefill", prefilled) not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK)
    assert publish("decode", recalled) not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK)


def test_a_generation_crosses_every_hop_over_mutual_tls_with_an_api_key(secured: Secured) -> None:
    stack = secured.stack
    with GatewayClient(stack.gateway_address, timeout_s=120, security=secured.security("anonymous"),
                       api_key=API_KEY) as client:
        generation = client.generate(generate_request("the key is 42 . the key is", max_tokens=4))
    assert len(generation.token_ids) == 4
    assert generation.summary.generations.request_generation > 0


def test_kvrelay_up_tls_serves_clients_that_trust_its_ca_only(checkpoint: Path, tmp_path: Path) -> None:
    """The CLI path a user takes: `kvrelay up --tls`, then `kvrelay generate --tls-ca`."""
    base, certs = free_base_port(), tmp_path / "certs"
    env = {**os.environ, **E2E_ENV}
    up = subprocess.Popen(
        [*KVRELAY, "up", "--checkpoint", str(checkpoint), "--tls", "--tls-dir", str(certs),
         "--base-port", str(base), "--metrics-base-port", "0", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    output = Output(up)
    try:
        output.wait_for(rf"kvrelay gateway listening on 127\.0\.0\.1:{base}\b", 240)
        # Printed after the gateway's line: wait for it too (the reader thread may not have
        # read it yet when the gateway's line is seen).
        output.wait_for(re.escape(f"mutual TLS between every service; certificates in {certs}"), 10)
        pids = [int(pid) for pid in re.findall(r"ready \S+\s+\S+\s+pid (\d+)", output.text)]

        def generate(*flags: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*KVRELAY, "generate", "the key is 7 . the key is", "--max-tokens", "2",
                                   "--gateway", f"127.0.0.1:{base}", *flags],
                                  capture_output=True, text=True, timeout=120, env=env)

        trusted = generate("--tls-ca", str(certs / "ca.pem"))
        assert trusted.returncode == 0 and "tokens (prompt / output)" in trusted.stdout, trusted.stdout
        plaintext = generate()
        assert plaintext.returncode == 1 and "UNAVAILABLE" in plaintext.stdout, plaintext.stdout
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, output.text
        assert wait_gone(pids, 10) == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(timeout=10)
