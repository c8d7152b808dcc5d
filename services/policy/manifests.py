"""The one manifest cache of the services that read manifests (gateway, prefill, decode).

By content identity a manifest is fetched from the policy service once, parsed once and kept:
it never changes under its sha (past `capacity` the least recently used is dropped, and
fetched again if asked for). A name resolves to the highest registered generation, or the one
asked for, and is remembered for `name_ttl_s` only, since a newer generation may be registered.
Whether a manifest fits a deployment is `services.kvpolicy.fit.check_fits`, not this cache's job.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy.client import PolicyClient
from services.policy.errors import NotFound, PolicyUnavailable
from services.policy.types import ManifestRef


class ManifestCache:
    """Manifests by sha (parsed, cached) and by name (refs, cached for a TTL)."""

    def __init__(
        self,
        client: PolicyClient,
        *,
        capacity: int = 64,
        name_ttl_s: float = 5.0,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} must be >= 1")
        self._client = client
        self._capacity = capacity
        self._name_ttl_s = name_ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._by_sha: OrderedDict[str, KVVisibilityPolicyManifest] = OrderedDict()
        self._by_name: dict[tuple[str, int], tuple[float, ManifestRef]] = {}

    async def get(self, sha256: str) -> KVVisibilityPolicyManifest:
        """The manifest registered under `sha256`. NotFound if there is none; the kvpolicy
        ManifestInvalid if its stored JSON does not parse; PolicyUnavailable if the policy
        service answered with another manifest (or any policy error of the call)."""
        manifest = self._by_sha.get(sha256)
        if manifest is None:
            manifest = await self._fetch(sha256)
            self._by_sha[sha256] = manifest
            while len(self._by_sha) > self._capacity:
                self._by_sha.popitem(last=False)
        self._by_sha.move_to_end(sha256)
        return manifest

    async def ref(self, name: str, policy_generation: int = 0) -> ManifestRef:
        """The ref of `name` at `policy_generation` (0 = the highest registered). NotFound with
        field `name` for an unknown policy (its message lists the registered names), with
        field `policy_generation` for a generation `name` does not have."""
        key = (name, policy_generation)
        cached = self._by_name.get(key)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        refs = await self._client.list_manifests(name, timeout_s=self._timeout_s)
        if not refs:
            known = sorted({r.name for r in await self._client.list_manifests(timeout_s=self._timeout_s)})
            raise NotFound(f"unknown policy {name!r}; registered: {', '.join(known) or 'none'}", field="name")
        matching = [r for r in refs if policy_generation in (0, r.policy_generation)]
        if not matching:
            generations = sorted(r.policy_generation for r in refs)
            reason = f"policy {name!r} has no generation {policy_generation}; registered: {generations}"
            raise NotFound(reason, field="policy_generation")
        ref = max(matching, key=lambda r: r.policy_generation)
        self._by_name[key] = (self._clock() + self._name_ttl_s, ref)
        return ref

    async def _fetch(self, sha256: str) -> KVVisibilityPolicyManifest:
        stored = await self._client.get_manifest(sha256, timeout_s=self._timeout_s)
        manifest = KVVisibilityPolicyManifest.from_json(stored.canonical_json)
        if manifest.sha256 != sha256:
            raise PolicyUnavailable(f"the policy service returned manifest {manifest.sha256} for {sha256}",
                                    field="sha256")
        return manifest
