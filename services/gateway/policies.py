"""Named policies at the gateway.

The gateway is the one place that knows which checkpoint (and K/V dtype) a deployment
serves, so it registers the default manifests for that tensor contract at start-up;
registration is idempotent (identical bytes are a no-op), and a different manifest under a
default name stops start-up with the policy named. `ManifestResolver` turns a client's
choice (name and generation, or sha256, or nothing = the default policy) into a stored
manifest that fits the served tensor contract; an unknown or unfit one is INVALID_ARGUMENT.
Content lookups (sha -> manifest) are cached forever, name lookups for a short TTL.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.validation import ManifestChoice
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, TensorContract, default_manifests
from services.policy import ManifestConflict, NotFound, PolicyClient, Registration
from services.policy.types import ManifestRef
from services.rpc.errors import InvalidArgument

_CONTRACT_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "k_dtype", "v_dtype",
                    "key_positional_stage")


class DefaultManifestConflict(RuntimeError):
    """A default policy name already holds a manifest for another checkpoint or dtype."""


@dataclass(frozen=True)
class ResolvedManifest:
    """A stored manifest the served checkpoint can run."""

    sha256: str
    name: str
    policy_generation: int


async def register_defaults(
    client: PolicyClient, served: TensorContract, *, timeout_s: float
) -> list[Registration]:
    """Register `default_manifests(served)` once; re-running with the same contract is a no-op."""
    registrations = []
    for name, manifest in default_manifests(served).items():
        try:
            registrations.append(await client.register_manifest(manifest.canonical_json(), timeout_s=timeout_s))
        except ManifestConflict as exc:
            raise DefaultManifestConflict(
                f"policy {name!r} generation {manifest.policy_generation} is already registered with a "
                f"different manifest (another checkpoint or K/V dtype on this policy service?): {exc}"
            ) from exc
    return registrations


def contract_mismatch(declared: TensorContract, served: TensorContract) -> str | None:
    """Why a manifest's tensor contract does not fit the served model, or None if it does."""
    for name in _CONTRACT_FIELDS:
        if getattr(declared, name) != getattr(served, name):
            return f"tensor.{name} is {getattr(declared, name)}, the served checkpoint has {getattr(served, name)}"
    if declared.resolved_q_to_kv_head_map() != served.resolved_q_to_kv_head_map():
        return "tensor.q_to_kv_head_map differs from the served checkpoint's"
    return None


class ManifestResolver:
    """Client choice -> `ResolvedManifest`, through the policy service, cached."""

    def __init__(
        self,
        client: PolicyClient,
        served: TensorContract,
        default_policy: str,
        *,
        name_ttl_s: float = 5.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.served = served
        self.default_policy = default_policy
        self._name_ttl_s = name_ttl_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._by_sha: dict[str, ResolvedManifest] = {}
        self._by_name: dict[tuple[str, int], tuple[float, ManifestRef]] = {}

    async def resolve(self, choice: ManifestChoice) -> ResolvedManifest:
        if choice.sha256:
            return await self._fetch(choice.sha256, "manifest.sha256")
        name = choice.name or self.default_policy
        field = "manifest.by_name.name" if choice.name else "manifest"
        ref = await self._ref(name, choice.policy_generation, field)
        return await self._fetch(ref.sha256, field)

    async def _ref(self, name: str, generation: int, field: str) -> ManifestRef:
        cached = self._by_name.get((name, generation))
        if cached is not None and cached[0] > self._clock():
            return cached[1]
        refs = await self.client.list_manifests(name, timeout_s=self._timeout_s)
        if not refs:
            known = sorted({ref.name for ref in await self.client.list_manifests(timeout_s=self._timeout_s)})
            raise InvalidArgument(f"unknown policy {name!r}; registered: {', '.join(known) or 'none'}", field=field)
        matching = [ref for ref in refs if generation in (0, ref.policy_generation)]
        if not matching:
            raise InvalidArgument(
                f"policy {name!r} has no generation {generation}; registered: "
                f"{sorted(ref.policy_generation for ref in refs)}",
                field="manifest.by_name.policy_generation",
            )
        ref = max(matching, key=lambda r: r.policy_generation)
        self._by_name[(name, generation)] = (self._clock() + self._name_ttl_s, ref)
        return ref

    async def _fetch(self, sha256: str, field: str) -> ResolvedManifest:
        resolved = self._by_sha.get(sha256)
        if resolved is not None:
            return resolved
        try:
            stored = await self.client.get_manifest(sha256, timeout_s=self._timeout_s)
        except NotFound:
            raise InvalidArgument("no manifest is registered under this sha256", field=field) from None
        manifest = KVVisibilityPolicyManifest.from_json(stored.canonical_json)
        problem = contract_mismatch(manifest.tensor, self.served)
        if problem is not None:
            raise InvalidArgument(f"policy {manifest.name!r} does not fit this deployment: {problem}", field=field)
        resolved = ResolvedManifest(sha256, manifest.name, manifest.policy_generation)
        self._by_sha[sha256] = resolved
        return resolved
