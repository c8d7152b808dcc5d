"""The HTTP front in a real in-process gateway (real policy service and Redis, no workers up):
/health follows the gateway's readiness, a backend that is down is a 503 in OpenAI's error
shape, a gateway that requires API keys checks them on HTTP as gRPC does, and
a certificate and key in the config serve HTTPS."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from policy_service.server import PolicyServer
from services.gateway import GatewayConfig, WorkerSource
from services.gateway.config import HttpConfig
from services.gateway.server import GatewayServer
from services.model.default import DEMO_CHECKPOINT
from services.redis_embedded import free_loopback_port
from services.rpc.server import ServerConfig
from services.security.certs import default_bundle
from services.security.roles import Role
from services.security.tokens import TokenTable, token_line
from services.security.transport import TransportSecurity

pytestmark = pytest.mark.timeout(120)
BODY = {"model": "demo_checkpoint", "prompt": "the code of alice is", "max_tokens": 2}


async def start(policy_server: PolicyServer, security: TransportSecurity, http: HttpConfig | None = None) -> GatewayServer:
    nobody = f"127.0.0.1:{free_loopback_port()}"  # no worker listens there
    config = GatewayConfig(
        checkpoint=DEMO_CHECKPOINT, policy_address=policy_server.address,
        prefill_workers=WorkerSource.parse(nobody, "prefill_workers"),
        decode_workers=WorkerSource.parse(nobody, "decode_workers"),
        server=ServerConfig(port=0, shutdown_grace_s=0.2, security=security), http=http or HttpConfig(port=0),
        admission_timeout_s=1.0,
    )
    return await GatewayServer.start(config)


def nobody(gateway: GatewayServer) -> str:
    return ",".join(gateway.config.decode_workers.addresses)


@pytest.fixture
async def open_gateway(policy_server: PolicyServer) -> AsyncIterator[GatewayServer]:
    gateway = await start(policy_server, TransportSecurity.local_plaintext())
    yield gateway
    await gateway.stop(0)


async def test_health_follows_readiness_and_a_down_backend_is_a_503(open_gateway: GatewayServer) -> None:
    assert open_gateway.http is not None
    async with httpx.AsyncClient(base_url=open_gateway.http.url, timeout=30) as client:
        health = await client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "unavailable"})
        reply = await client.post("/v1/completions", json=BODY)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error.pop("message").startswith(f"no healthy decode worker among {nobody(open_gateway)} (")
        assert error == {"type": "service_unavailable_error", "param": None, "code": "backend_unavailable"}
        assert (await client.get("/v1/models")).json()["data"][0]["id"] == "demo_checkpoint"


async def test_a_gateway_with_api_keys_checks_them_on_http(policy_server: PolicyServer) -> None:
    """The HTTP front takes the same API keys as gRPC Generate: none or a wrong one is 401, a
    token without the client role 403, the key itself gets through to the backends (503 here:
    no workers)."""
    tokens = TokenTable.from_text(token_line("s3cret", "alice", frozenset({Role.CLIENT})) + "\n"
                                  + token_line("ops", "bob", frozenset({Role.OPERATOR})))
    gateway = await start(policy_server, TransportSecurity(plaintext=True, tokens=tokens))
    try:
        assert gateway.http is not None
        async with httpx.AsyncClient(base_url=gateway.http.url, timeout=30) as client:
            for headers, status, kind in (({}, 401, "authentication_error"),
                                          ({"Authorization": "Bearer wrong"}, 401, "authentication_error"),
                                          ({"Authorization": "Bearer ops"}, 403, "permission_error")):
                reply = await client.post("/v1/completions", json=BODY, headers=headers)
                assert reply.status_code == status, reply.text
                assert reply.json()["error"]["type"] == kind
                assert reply.json()["error"]["param"] == "authorization"
            assert (await client.get("/v1/models")).status_code == 401
            keyed = {"Authorization": "Bearer s3cret"}
            assert (await client.get("/v1/models", headers=keyed)).status_code == 200
            reply = await client.post("/v1/completions", json=BODY, headers=keyed)
            assert reply.status_code == 503, reply.text
    finally:
        await gateway.stop(0)


async def test_the_http_front_serves_https_with_a_certificate(policy_server: PolicyServer, tmp_path: Path) -> None:
    bundle = tmp_path / "certs"
    default_bundle(bundle, hosts=("127.0.0.1",))
    http = HttpConfig(port=0, ssl_certfile=bundle / "gateway.pem", ssl_keyfile=bundle / "gateway.key")
    gateway = await start(policy_server, TransportSecurity.local_plaintext(), http)
    try:
        assert gateway.http is not None and gateway.http.url.startswith("https://127.0.0.1:")
        async with httpx.AsyncClient(base_url=gateway.http.url, timeout=30,
                                     verify=ssl.create_default_context(cafile=str(bundle / "ca.pem"))) as client:
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "demo_checkpoint"
        async with httpx.AsyncClient(base_url=gateway.http.url.replace("https", "http"), timeout=30) as plain:
            with pytest.raises(httpx.HTTPError):  # no plain HTTP on the TLS port
                await plain.get("/v1/models")
    finally:
        await gateway.stop(0)
