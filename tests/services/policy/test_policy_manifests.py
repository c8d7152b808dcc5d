"""The one manifest cache: a manifest is fetched and parsed once per sha, names resolve for
their TTL, and what is missing or wrong is a typed error naming the field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.policy import NotFound, PolicyUnavailable
from services.policy.manifests import ManifestCache
from services.policy.types import ManifestRef, StoredManifest

MANIFESTS = default_manifests(TensorContract(2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32))


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
        return [ManifestRef(m.sha256, m.name, m.policy_generation) for m in self.stored.values()
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
