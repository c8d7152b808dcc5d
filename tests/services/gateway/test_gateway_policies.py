"""Default manifests are registered once per tensor contract, and a client's policy choice
resolves to a stored manifest that fits the served checkpoint (or INVALID_ARGUMENT naming it)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.gateway.policies import DefaultManifestConflict, ManifestResolver, register_defaults
from services.gateway.validation import ManifestChoice
from services.kvpolicy.fit import Deployment, ManifestUnfit, check_fits
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.retention_manifests import retention_manifests
from services.policy import PolicyClient, PolicyClientConfig
from services.redis_embedded import EmbeddedRedis
from services.rpc.errors import InvalidArgument
from services.rpc.server import ServerConfig

SERVED = TensorContract(2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32, q_to_kv_head_map=(0, 0, 1, 1))
OTHER = TensorContract(3, 4, 2, 16, DType.FLOAT32, DType.FLOAT32, q_to_kv_head_map=(0, 0, 1, 1))


@pytest.fixture
async def client(policy_server: PolicyServer) -> AsyncIterator[PolicyClient]:
    async with PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0)) as policy_client:
        yield policy_client


async def test_defaults_register_once_and_conflicts_name_the_policy(client: PolicyClient) -> None:
    first = await register_defaults(client, SERVED, timeout_s=5.0)
    assert sorted(r.ref.name for r in first) == sorted(
        [*default_manifests(SERVED), "snapkv-recall", "snapkv-recall-codes",
         "snapkv-recall-values", *retention_manifests(SERVED)]
    )
    assert all(r.created for r in first)
    again = await register_defaults(client, SERVED, timeout_s=5.0)
    assert [r.ref for r in again] == [r.ref for r in first] and not any(r.created for r in again)
    bf16 = replace(SERVED, k_dtype=DType.BFLOAT16, v_dtype=DType.BFLOAT16)
    with pytest.raises(DefaultManifestConflict, match="policy 'full' generation 1"):
        await register_defaults(client, bf16, timeout_s=5.0)


def test_the_fit_check_names_the_field() -> None:
    manifests = default_manifests(SERVED)
    check_fits(manifests["full"], Deployment(SERVED))
    check_fits(manifests["full"], Deployment(replace(SERVED, q_to_kv_head_map=())))  # contiguous either way
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(default_manifests(OTHER)["full"], Deployment(SERVED))
    assert caught.value.field == "tensor.num_layers" and caught.value.reason.startswith("is 3 in the manifest")
    with pytest.raises(ManifestUnfit) as caught:
        check_fits(manifests["full"], Deployment(replace(SERVED, k_dtype=DType.BFLOAT16)))
    assert caught.value.field == "tensor.k_dtype"


async def test_resolver_by_default_name_generation_and_sha(client: PolicyClient) -> None:
    await register_defaults(client, SERVED, timeout_s=5.0)
    manifests = default_manifests(SERVED)
    resolver = ManifestResolver(client, SERVED, "snapkv")
    default = await resolver.resolve(ManifestChoice())
    assert (default.name, default.sha256) == ("snapkv", manifests["snapkv"].sha256)
    by_name = await resolver.resolve(ManifestChoice(name="snapkv-pyramid", policy_generation=1))
    assert by_name.sha256 == manifests["snapkv-pyramid"].sha256
    by_sha = await resolver.resolve(ManifestChoice(sha256=manifests["full"].sha256))
    assert by_sha.name == "full"

    newer = replace(manifests["full"], policy_generation=2, policy_manifest_id="full@2")
    await client.register_manifest(newer.canonical_json())
    fresh = ManifestResolver(client, SERVED, "snapkv")
    assert (await fresh.resolve(ManifestChoice(name="full"))).sha256 == newer.sha256
    assert (await fresh.resolve(ManifestChoice(name="full", policy_generation=1))).sha256 == manifests["full"].sha256


async def test_name_lookups_are_cached_for_their_ttl(client: PolicyClient) -> None:
    manifests = default_manifests(SERVED)
    await register_defaults(client, SERVED, timeout_s=5.0)
    now = [0.0]
    resolver = ManifestResolver(client, SERVED, "snapkv", name_ttl_s=5.0, clock=lambda: now[0])
    assert (await resolver.resolve(ManifestChoice(name="full"))).policy_generation == 1
    newer = replace(manifests["full"], policy_generation=2, policy_manifest_id="full@2")
    await client.register_manifest(newer.canonical_json())
    assert (await resolver.resolve(ManifestChoice(name="full"))).policy_generation == 1
    now[0] = 5.1
    assert (await resolver.resolve(ManifestChoice(name="full"))).policy_generation == 2


@pytest.mark.parametrize(
    ("choice", "field", "message"),
    [
        (ManifestChoice(name="nope"), "manifest.by_name.name", "unknown policy 'nope'"),
        (ManifestChoice(name="full", policy_generation=9), "manifest.by_name.policy_generation", "no generation 9"),
        (ManifestChoice(sha256="0" * 64), "manifest.sha256", "no manifest"),
        (ManifestChoice(name="other"), "manifest.by_name.name", "tensor.num_layers is 3"),
    ],
)
async def test_unresolvable_choices_are_invalid_arguments(
    client: PolicyClient, choice: ManifestChoice, field: str, message: str
) -> None:
    await register_defaults(client, SERVED, timeout_s=5.0)
    foreign = replace(default_manifests(OTHER)["full"], name="other", policy_manifest_id="other@1")
    await client.register_manifest(foreign.canonical_json())
    with pytest.raises(InvalidArgument, match=message) as caught:
        await ManifestResolver(client, SERVED, "snapkv").resolve(choice)
    assert caught.value.field == field


async def test_unknown_default_policy_is_reported_against_manifest(client: PolicyClient) -> None:
    with pytest.raises(InvalidArgument, match="registered: none") as caught:
        await ManifestResolver(client, SERVED, "snapkv").resolve(ManifestChoice())
    assert caught.value.field == "manifest"


async def test_defaults_come_back_when_the_policy_service_lost_them(
    policy_server: PolicyServer, redis_server: EmbeddedRedis
) -> None:
    """A policy service restarted over an empty store without a journal has forgotten the
    defaults; the resolver registers them again and the request resolves, no gateway restart."""
    port = int(policy_server.address.rsplit(":", 1)[1])
    async with PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0)) as client:
        await register_defaults(client, SERVED, timeout_s=5.0)
        resolver = ManifestResolver(client, SERVED, "snapkv", name_ttl_s=0.0, restore_defaults=True)
        before = await resolver.resolve(ManifestChoice())
        await policy_server.stop(0)
        config = PolicyServiceConfig(
            server=ServerConfig(port=port, shutdown_grace_s=0.2), redis_url=redis_server.url,
            key_prefix=f"g{uuid.uuid4().hex[:12]}:",  # a store that holds nothing
        )
        restarted = await PolicyServer.start(config)
        try:
            after = await asyncio.wait_for(resolver.resolve(ManifestChoice()), timeout=10.0)
            assert after.sha256 == before.sha256 and resolver.restores == 1
            with pytest.raises(InvalidArgument):  # a name that is no default is not invented
                await resolver.resolve(ManifestChoice(name="not-a-default"))
            assert resolver.restores == 1
        finally:
            await restarted.stop(0)


async def test_without_restore_a_lost_default_stays_an_invalid_argument(client: PolicyClient) -> None:
    resolver = ManifestResolver(client, SERVED, "snapkv")
    with pytest.raises(InvalidArgument) as caught:
        await resolver.resolve(ManifestChoice())
    assert caught.value.field == "manifest" and resolver.restores == 0
