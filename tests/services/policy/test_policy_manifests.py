"""The one manifest cache: a manifest is fetched and parsed once per sha, names resolve for
their TTL, and what is missing or wrong is a typed error naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.gateway.policies import ManifestResolver
from services.gateway.validation import ManifestChoice
from services.kvpolicy.fit import Deployment, ManifestUnfit
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.policy import NotFound, PolicyClient, PolicyUnavailable
from services.policy.manifests import ManifestCache
from services.policy.types import ManifestRef, StoredManifest
from services.rpc.errors import InvalidArgument

SERVED = TensorContract(2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32)
MANIFESTS = default_manifests(SERVED)


class FakePolicy:
    """The two reads of `PolicyClient` the cache makes, counted."""

    def __init__(self, manifests: list[KVVisibilityPolicyManifest]) -> None:
        self.stored = {m.sha256: m for m in manifests}
        self.fetches: list[str] = []
        self.lists = 0

    async def get_manifest(self, sha256: str, *, timeout_s: float | None = None) -> StoredManifest:
        self.fetches.append(sha256)
        if sha256 not in self.stored:
            raise NotFound("no such manifest")
        manifest = self.stored[sha256]
        return StoredManifest(ManifestRef(sha256, manifest.name, manifest.policy_generation),
                              manifest.canonical_json())

    async def list_manifests(self, name: str = "", *, timeout_s: float | None = None) -> list[ManifestRef]:
        self.lists += 1
        return [ManifestRef(sha, m.name, m.policy_generation) for sha, m in self.stored.items()
                if name in ("", m.name)]


async def test_a_manifest_is_fetched_once_and_the_least_recent_goes_past_capacity() -> None:
    full, window, snapkv = MANIFESTS["full"], MANIFESTS["window"], MANIFESTS["snapkv"]
    policy = FakePolicy([full, window, snapkv])
    cache = ManifestCache(policy, capacity=2)  # type: ignore[arg-type]
    assert await cache.get(full.sha256) == full
    assert await cache.get(full.sha256) is await cache.get(full.sha256)
    await cache.get(window.sha256)
    await cache.get(full.sha256)  # full is now the most recent
    await cache.get(snapkv.sha256)  # evicts window
    await cache.get(full.sha256)
    await cache.get(window.sha256)
    assert policy.fetches == [full.sha256, window.sha256, snapkv.sha256, window.sha256]


async def test_names_resolve_to_the_highest_generation_for_their_ttl() -> None:
    full = MANIFESTS["full"]
    newer = replace(full, policy_generation=2, policy_manifest_id="full@2")
    policy = FakePolicy([full])
    now = [0.0]
    cache = ManifestCache(policy, name_ttl_s=5.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert (await cache.ref("full")).policy_generation == 1
    policy.stored[newer.sha256] = newer
    assert (await cache.ref("full")).policy_generation == 1 and policy.lists == 1
    now[0] = 5.1
    assert (await cache.ref("full")).sha256 == newer.sha256
    assert (await cache.ref("full", 1)).sha256 == full.sha256


async def test_missing_and_mismatched_manifests_are_typed_errors() -> None:
    full = MANIFESTS["full"]
    policy = FakePolicy([full])
    cache = ManifestCache(policy)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        await cache.get("0" * 64)
    with pytest.raises(NotFound, match="registered: full") as caught:
        await cache.ref("nope")
    assert caught.value.field == "name"
    with pytest.raises(NotFound, match="no generation 9") as caught:
        await cache.ref("full", 9)
    assert caught.value.field == "policy_generation"
    policy.stored["ab" * 32] = full  # the service answers another manifest than asked for
    with pytest.raises(PolicyUnavailable):
        await cache.get("ab" * 32)


def unfit_generation(manifest: KVVisibilityPolicyManifest, generation: int) -> KVVisibilityPolicyManifest:
    """`manifest` as a newer generation for another head_dim (issue 15: it broke the name)."""
    return replace(manifest, policy_generation=generation, policy_manifest_id=f"{manifest.name}@{generation}",
                   tensor=replace(manifest.tensor, head_dim=manifest.tensor.head_dim * 2))


async def test_a_name_resolves_to_its_newest_generation_that_fits_the_deployment() -> None:
    snapkv = MANIFESTS["snapkv"]
    fitting = replace(snapkv, policy_generation=2, policy_manifest_id="snapkv@2")
    unfit = unfit_generation(snapkv, 3)
    policy = FakePolicy([snapkv, fitting, unfit])
    now = [0.0]
    cache = ManifestCache(policy, deployment=Deployment(SERVED), name_ttl_s=5.0,  # type: ignore[arg-type]
                          clock=lambda: now[0])
    assert (await cache.ref("snapkv")).sha256 == fitting.sha256
    assert (await cache.ref("snapkv", 3)).sha256 == unfit.sha256  # asked for: the caller's fit check says no
    now[0] = 10.0
    assert (await cache.ref("snapkv")).sha256 == fitting.sha256
    assert policy.fetches.count(unfit.sha256) == 1, "an unfit verdict is final: fetched once"
    # Without a deployment the newest generation is served, whatever it declares.
    assert (await ManifestCache(policy).ref("snapkv")).sha256 == unfit.sha256  # type: ignore[arg-type]


async def test_unreadable_generations_are_skipped_and_no_fit_is_a_typed_error() -> None:
    snapkv = MANIFESTS["snapkv"]
    policy = FakePolicy([snapkv, unfit_generation(snapkv, 2)])
    unreadable = "e" * 64  # a stored JSON this build cannot parse (e.g. written by a newer one)
    policy.stored[unreadable] = replace(snapkv, policy_generation=4, policy_manifest_id="snapkv@4")
    original = policy.get_manifest

    async def get_manifest(sha256: str, *, timeout_s: float | None = None) -> StoredManifest:
        stored = await original(sha256, timeout_s=timeout_s)
        return replace(stored, canonical_json=b'{"schema_version": 99}') if sha256 == unreadable else stored

    policy.get_manifest = get_manifest  # type: ignore[method-assign]
    cache = ManifestCache(policy, deployment=Deployment(SERVED))  # type: ignore[arg-type]
    assert (await cache.ref("snapkv")).sha256 == snapkv.sha256
    lonely = FakePolicy([unfit_generation(MANIFESTS["full"], 2)])
    with pytest.raises(ManifestUnfit, match="no generation fits") as caught:
        await ManifestCache(lonely, deployment=Deployment(SERVED)).ref("full")  # type: ignore[arg-type]
    assert caught.value.field == "tensor.head_dim"


async def test_the_gateway_keeps_serving_the_last_generation_that_fits(policy: PolicyClient) -> None:
    """Real policy service (configured without a deployment, so the unfit generation is stored)."""
    resolver = ManifestResolver(policy, SERVED, "snapkv", name_ttl_s=0.0)
    assert (await resolver.resolve(ManifestChoice())).policy_generation == 1
    unfit = unfit_generation(MANIFESTS["snapkv"], 2)
    await policy.register_manifest(unfit.canonical_json())
    for choice in (ManifestChoice(), ManifestChoice(name="snapkv")):
        assert (await resolver.resolve(choice)).sha256 == MANIFESTS["snapkv"].sha256
    with pytest.raises(InvalidArgument, match="does not fit") as caught:
        await resolver.resolve(ManifestChoice(name="snapkv", policy_generation=2))
    assert caught.value.field == "manifest.by_name.name"


@pytest.fixture
def manifests() -> dict[str, KVVisibilityPolicyManifest]:
    """Registered by the `policy` fixture (tests/conftest.py)."""
    return MANIFESTS
