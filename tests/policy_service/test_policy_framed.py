"""The framed Session listener (`policy_service.framed`, `services.policy.framed`): the per-request
calls without gRPC, against a real policy service on a real redis-server (and a real Redis
Cluster). Every call must end exactly as it does over gRPC; the connection is authenticated
and authorized as a Session stream (mTLS identity or bearer token); a hostile peer's bytes
close its own connection only; a draining replica's calls go to another without a failure.
Many calls on one connection and a call past its deadline: test_policy_session (both transports)."""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path

import pytest
from policy_helpers import BACKENDS, lifecycle, service_config

import policy_service.framed as framed_module
from policy_service.server import PolicyServer
from services.policy import PolicyClient, PolicyClientConfig, PolicyUnavailable
from services.policy.errors import PolicyPermissionDenied, PolicyUnauthenticated
from services.policy.framing import frame, read_frame
from services.redis_embedded import EmbeddedRedis
from services.rpc.kvrelay.v1 import policy_pb2
from services.rpc.server import ServerConfig
from services.security.certs import default_bundle
from services.security.roles import Role
from services.security.tokens import new_token
from services.security.transport import TransportConfigError, TransportSecurity
from services.telemetry.metrics import POLICY_SESSIONS, POLICY_SESSIONS_OPEN, RPC_REQUESTS

CALLS = 200


def framed(server: PolicyServer, **values: object) -> PolicyClient:
    config = PolicyClientConfig(server.address, session_target=server.session_address, **values)  # type: ignore[arg-type]
    return PolicyClient(config)


def sessions(transport: str) -> tuple[float, float]:
    """(Session streams opened, open now) over `transport`, from the service's metrics."""
    return (POLICY_SESSIONS.labels(transport)._value.get(),  # type: ignore[no-any-return]
            POLICY_SESSIONS_OPEN.labels(transport)._value.get())


def served(method: str, code: str) -> float:
    return RPC_REQUESTS.labels(f"/kvrelay.v1.PolicyService/{method}", code)._value.get()  # type: ignore[no-any-return]


@pytest.mark.parametrize("redis_url", BACKENDS, indirect=True)
async def test_every_call_ends_over_frames_as_over_grpc(policy_server: PolicyServer, snapkv_sha: str) -> None:
    before = served("PublishState", "OK")
    opened = {transport: sessions(transport)[0] for transport in ("framed", "grpc")}
    async with framed(policy_server, timeout_s=5.0, session_streams=1) as fast, \
            PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0, session_streams=1)) as grpc_session:
        over_frames = await lifecycle(fast, "framed-twin", snapkv_sha)
        over_grpc = await lifecycle(grpc_session, "grpc-twin", snapkv_sha)
        assert fast._sessions is not None and fast._sessions.opened == 1  # one connection served all
        # The operator sees which transport each client took: one stream each, open.
        assert {t: sessions(t)[0] - opened[t] for t in opened} == {"framed": 1, "grpc": 1}
        assert sessions("framed")[1] >= 1 and sessions("grpc")[1] >= 1
    assert over_frames == over_grpc
    assert served("PublishState", "OK") - before == 2 * 2  # counted under the method's name
    assert policy_server.framed is not None and policy_server.framed.connections >= 1


async def raw_connection(server: PolicyServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = server.session_address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def welcomed(server: PolicyServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await raw_connection(server)
    writer.write(frame(policy_pb2.SessionHello()))
    welcome = policy_pb2.SessionWelcome.FromString(await asyncio.wait_for(read_frame(reader, 1 << 20), 5) or b"")
    assert not welcome.HasField("error")
    return reader, writer


async def closed_by_peer(reader: asyncio.StreamReader) -> bool:
    """Whether the peer closed the connection (EOF, or a reset) within 5 s."""
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionError:
        return True


@pytest.mark.parametrize("bad", ["oversized", "not-a-call", "cut-off", "no-hello", "garbage-hello"])
async def test_bad_frames_close_only_their_own_connection(
    policy_server: PolicyServer, monkeypatch: pytest.MonkeyPatch, bad: str,
) -> None:
    monkeypatch.setattr(framed_module, "HELLO_TIMEOUT_S", 0.3)
    async with framed(policy_server, timeout_s=5.0, session_streams=1) as bystander:
        await bystander.begin_request(f"bystander-{bad}")
        fence = policy_pb2.SessionCall(call_id=1)
        fence.get_fence.request_id = f"bystander-{bad}"
        if bad in ("no-hello", "garbage-hello"):
            reader, writer = await raw_connection(policy_server)
            if bad == "garbage-hello":
                writer.write(struct.pack(">I", 3) + b"\xff\xff\xff")
        else:
            reader, writer = await welcomed(policy_server)
            writer.write(frame(fence))  # read before the bad frame: still answered
            writer.write({"oversized": struct.pack(">I", 1 << 30),
                          "not-a-call": struct.pack(">I", 2) + b"\xff\xff",
                          "cut-off": struct.pack(">I", 100) + b"\x08"}[bad])
            if bad == "cut-off":
                writer.write_eof()
            answered = policy_pb2.SessionReply.FromString(await asyncio.wait_for(read_frame(reader, 1 << 20), 5) or b"")
            assert answered.call_id == 1 and answered.get_fence.fence.request_id == f"bystander-{bad}"
        assert await closed_by_peer(reader)
        writer.close()
        # The service and the other connection go on.
        assert (await bystander.get_fence(f"bystander-{bad}")).request_id == f"bystander-{bad}"
        assert bystander._sessions is not None and bystander._sessions.opened == 1


async def test_calls_go_on_through_a_replica_that_stops(redis_server: EmbeddedRedis) -> None:
    """Two replicas share one Redis; one stops (drains) while 8 clients call: every call
    succeeds, the drained replica's calls are sent again to the other."""
    prefix = "tframed-replicas:"
    replicas = [await PolicyServer.start(service_config(redis_server.url, key_prefix=prefix, session_port=0))
                for _ in range(2)]
    stopped = False
    try:
        config = PolicyClientConfig(",".join(r.address for r in replicas), timeout_s=5.0,
                                    session_target=",".join(r.session_address for r in replicas))
        async with PolicyClient(config) as client:
            done, deadline = 0, time.monotonic() + 30.0

            async def loop(index: int) -> None:
                nonlocal done
                for serial in range(40):
                    fence = await client.begin_request(f"frep-{index}-{serial}")
                    assert (await client.get_fence(fence.request_id)).request_id == fence.request_id
                    await client.end_request(fence.request_id, fence.request_generation)
                    done += 1
                    await asyncio.sleep(0.005)

            loops = asyncio.gather(*(loop(i) for i in range(8)))
            while done < 40 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            served_before = [r.framed.connections if r.framed else 0 for r in replicas]
            await replicas[0].stop()
            stopped = True
            await asyncio.wait_for(loops, deadline - time.monotonic())
        assert done == 8 * 40
        assert all(count >= 1 for count in served_before), served_before  # both had connections
    finally:
        for index, replica in enumerate(replicas):
            if index or not stopped:
                await replica.stop(0)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_bundle(tmp_path_factory.mktemp("framed-certs")).directory


def role_security(bundle: Path, role: str, **values: object) -> TransportSecurity:
    return TransportSecurity.from_files(cert=bundle / f"{role}.pem", key=bundle / f"{role}.key",
                                        ca=bundle / "ca.pem", **values)  # type: ignore[arg-type]


async def test_mtls_identities_are_held_to_each_calls_rule(redis_server: EmbeddedRedis, bundle: Path) -> None:
    config = service_config(redis_server.url, session_port=0,
                            server=ServerConfig(port=0, shutdown_grace_s=0.5, security=role_security(bundle, "policy")))
    server = await PolicyServer.start(config)

    def client_of(security: TransportSecurity) -> PolicyClient:
        return PolicyClient(PolicyClientConfig(server.address, timeout_s=3.0, security=security,
                                               session_target=server.session_address))

    try:
        async with client_of(role_security(bundle, "gateway")) as gateway, \
                client_of(role_security(bundle, "prefill")) as prefill:
            fence = await gateway.begin_request("fmtls")
            assert (await prefill.get_fence("fmtls")).request_generation == fence.request_generation
            with pytest.raises(PolicyPermissionDenied, match="BeginRequest needs one of gateway"):
                await prefill.begin_request("fmtls-by-prefill")
        async with client_of(role_security(bundle, "client")) as outsider:  # no Session role
            with pytest.raises(PolicyPermissionDenied, match="Session needs one of"):
                await outsider.get_fence("fmtls")
        anonymous = TransportSecurity(root_certs=(bundle / "ca.pem").read_bytes())
        async with client_of(anonymous) as nobody:  # refused in the handshake: no certificate
            with pytest.raises(PolicyUnavailable):
                await nobody.get_fence("fmtls", timeout_s=1.0)
    finally:
        await server.stop(0)


async def test_tls_without_client_certificates_authenticates_by_bearer_token(
    redis_server: EmbeddedRedis, bundle: Path, tmp_path: Path,
) -> None:
    token, line = new_token("gw-7", frozenset({Role.GATEWAY}))
    (tmp_path / "tokens").write_text(line + "\n")
    security = role_security(bundle, "policy", require_client_cert=False, tokens_file=tmp_path / "tokens")
    config = service_config(redis_server.url, session_port=0,
                            server=ServerConfig(port=0, shutdown_grace_s=0.5, security=security))
    server = await PolicyServer.start(config)
    ca = (bundle / "ca.pem").read_bytes()

    def client_of(bearer: str) -> PolicyClient:
        return PolicyClient(PolicyClientConfig(server.address, timeout_s=3.0, session_target=server.session_address,
                                               security=TransportSecurity(root_certs=ca, bearer_token=bearer)))

    try:
        async with client_of(token) as gateway:
            assert (await gateway.begin_request("ftoken")).request_id == "ftoken"
        for bearer in ("", "not-a-token"):
            async with client_of(bearer) as stranger:
                with pytest.raises(PolicyUnauthenticated, match="no identity"):
                    await stranger.get_fence("ftoken")
    finally:
        await server.stop(0)


async def test_plaintext_framed_sessions_stay_on_loopback() -> None:
    with pytest.raises(TransportConfigError, match="plaintext policy sessions to '10.0.0.7'"):
        PolicyClient(PolicyClientConfig("127.0.0.1:1", session_target="10.0.0.7:50062"))
    with pytest.raises(ValueError, match="session_target: 'nowhere' is not host:port"):
        PolicyClientConfig("127.0.0.1:1", session_target="nowhere")
