"""The one manifest cache of the services that read manifests (gateway, prefill, decode).

By content identity a manifest is fetched from the policy service once, parsed once and kept:
it never changes under its sha (past `capacity` the least recently used is dropped, and
fetched again if asked for). A name resolves to the generation asked for, or (generation 0) to
the newest registered generation that fits the cache's deployment
(`services.kvpolicy.fit.check_fits`): a newer generation that does not fit, or whose stored
JSON this build cannot read, is skipped and logged once, so one bad registration cannot take a
policy name away from the deployment it served. A resolved name is remembered for
`name_ttl_s` only, since a newer generation may be registered.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from services.echo import echo, truncated
from services.kvpolicy.errors import KVPolicyError, ManifestInvalid
from services.kvpolicy.fit import Deployment, ManifestUnfit, check_fits
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy.client import PolicyClient
from services.policy.errors import NotFound, PolicyUnavailable
from services.policy.types import ManifestRef

log = logging.getLogger(__name__)


class ManifestCache:
    """Manifests by sha (parsed, cached) and by name (refs, cached for a TTL). Without a
    `deployment`, a name resolves to its newest generation whatever it declares."""

    def __init__(
        self,
        client: PolicyClient,
        *,
        deployment: Deployment | None = None,
        capacity: int = 64,
        name_ttl_s: float = 5.0,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} must be >= 1")
        self._client = client
        self._deployment = deployment
        self._capacity = capacity
        self._name_ttl_s = name_ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._by_sha: OrderedDict[str, KVVisibilityPolicyManifest] = OrderedDict()
        self._by_name: dict[tuple[str, int], tuple[float, ManifestRef]] = {}
        # sha -> why it cannot serve this deployment; final, since a sha never changes.
        self._unservable: OrderedDict[str, KVPolicyError] = OrderedDict()

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
        """The ref of `name` at `policy_generation` (0 = the newest registered generation that
        fits the deployment). NotFound with field `name` for an unknown policy (its message
        lists the registered names), with field `policy_generation` for a generation `name`
        does not have; ManifestUnfit (of the newest) when no generation of `name` fits."""
        key = (name, policy_generation)
        cached = self._by_name.get(key)
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        refs = await self._client.list_manifests(name, timeout_s=self._timeout_s)
        if not refs:
            every = await self._client.list_manifests(timeout_s=self._timeout_s)
            known = ", ".join(sorted({r.name for r in every})) or "none"
            reason = f"unknown policy {echo(name)}; registered: {truncated(known)}"
            raise NotFound(reason, field="name")
        matching = [r for r in refs if policy_generation in (0, r.policy_generation)]
        if not matching:
            generations = ", ".join(str(g) for g in sorted(r.policy_generation for r in refs))
            reason = f"policy {echo(name)} has no generation {policy_generation}"
            raise NotFound(f"{reason}; registered: {truncated(generations)}", field="policy_generation")
        ref = matching[0] if policy_generation else await self._newest_servable(matching)
        self._by_name[key] = (self._clock() + self._name_ttl_s, ref)
        return ref

    async def _newest_servable(self, refs: list[ManifestRef]) -> ManifestRef:
        newest_first = sorted(refs, key=lambda r: r.policy_generation, reverse=True)
        if self._deployment is None:
            return newest_first[0]
        first: KVPolicyError | None = None
        for ref in newest_first:
            why = await self._unservable_reason(ref)
            if why is None:
                return ref
            first = first or why
        assert first is not None
        newest = newest_first[0].policy_generation
        raise ManifestUnfit(first.field, f"{first.reason} (generation {newest}; no generation fits)")

    async def _unservable_reason(self, ref: ManifestRef) -> KVPolicyError | None:
        """None if the manifest under `ref` fits the deployment; else why not (remembered)."""
        known = self._unservable.get(ref.sha256)
        if known is not None:
            return known
        assert self._deployment is not None
        try:
            check_fits(await self.get(ref.sha256), self._deployment)
            return None
        except (ManifestUnfit, ManifestInvalid) as exc:
            log.warning("policy %r generation %d (manifest %s) is skipped: it cannot serve this "
                        "deployment: %s", ref.name, ref.policy_generation, ref.sha256, exc)
            self._unservable[ref.sha256] = exc
            while len(self._unservable) > self._capacity:
                self._unservable.popitem(last=False)
            return exc

    async def _fetch(self, sha256: str) -> KVVisibilityPolicyManifest:
        stored = await self._client.get_manifest(sha256, timeout_s=self._timeout_s)
        manifest = KVVisibilityPolicyManifest.from_json(stored.canonical_json)
        if manifest.sha256 != sha256:
            raise PolicyUnavailable(f"the policy service returned manifest {manifest.sha256} for {sha256}",
                                    field="sha256")
        return manifest
