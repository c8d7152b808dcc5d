"""Named policies at the gateway.

The gateway is the one place that knows which checkpoint (and K/V dtype) a deployment
serves, so it registers the default manifests for that tensor contract at start-up;
registration is idempotent (identical bytes are a no-op), and a different manifest under a
default name stops start-up with the policy named. `ManifestResolver` turns a client's
choice (name and generation, or sha256, or nothing = the default policy) into a stored
manifest that fits the served tensor contract (`services.kvpolicy.fit`, the check the
workers repeat); an unknown or unfit one is INVALID_ARGUMENT. A name without a generation
resolves to its newest generation that fits, so a newer registration this deployment cannot
run leaves the name serving the generation before it. Lookups go through the shared
`services.policy.manifests.ManifestCache`: by sha cached forever, by name for a short TTL.

A policy service that comes back with an empty store and no journal (a non-persistent Redis
and a restarted service) has forgotten the defaults; a resolver made with
`restore_defaults=True` registers them again (at most once per `restore_interval_s`) when a
default policy is not found, and retries once, so no gateway restart is needed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.gateway.validation import ManifestChoice
from services.kvpolicy.fit import Deployment, ManifestUnfit, check_fits
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, TensorContract, default_manifests
from services.kvpolicy.retention_manifests import retention_manifests
from services.offload.recall import (
    CODES_RECALL_KNOBS,
    VALUES_RECALL_KNOBS,
    RecallKnobs,
    with_recall,
)
from services.policy import ManifestConflict, NotFound, PolicyClient, Registration
from services.policy.manifests import ManifestCache
from services.rpc.errors import InvalidArgument

log = logging.getLogger(__name__)

# `snapkv-recall`: `snapkv` whose omitted rows stay in the prefill worker's offload store,
# recalled page by page when a decode query's bound on their attention mass passes 0.9.
# Tuned through the gateway on the default model (SmolLM2-135M-Instruct) with the demo's
# passphrase question (`services.launcher.haystack`, 3K tokens of prose) on seeds 101-106,
# not the demo's seed 7. The full cache answered 6 of 6, `snapkv` 3 (it keeps the
# passphrase's first word and loses the rest); 8-row pages x 64 per step answered 5, recalling
# 4.9% of the omitted rows (x 32: 3 of 6, 2.4%; x 16: 4 of 6, 1.2%).
SERVED_RECALL_KNOBS = RecallKnobs(threshold=0.9, page_size=8, max_pages_per_step=64, cadence_steps=1)
# `snapkv-recall-codes`: the same selection and store, with 4-bit row codes of every omitted
# key in the summaries; the decode worker ranks pages by the rows' estimated logits and recalls
# only when a page's estimate clears a floor (`services.offload.recall.CODES_STRATEGY`). Chosen
# with `kvrelay eval recall --suite ruler` on the default model, tuning prompts only; on the
# reported RULER prompts it closed the whole single-needle and multi-key gap at 4K
# (docs/results/recall-smollm2/report.md).
CODES_RECALL_POLICY = "snapkv-recall-codes"
# `snapkv-recall-values`: `snapkv-recall-codes` whose pages also carry their mean value row;
# each decode step's attention adds the still-omitted pages' code-estimated mass carrying
# those means (`recoverability.omitted_value_term`). On the 8K RULER tuning prompts at 10% it
# answered the needle the codes alone miss (docs/results/recall-smollm2/tuning.md); it costs
# d_h values a page more on the wire and on the decode host, and decode time.
VALUES_RECALL_POLICY = "snapkv-recall-values"


def served_manifests(served: TensorContract) -> dict[str, KVVisibilityPolicyManifest]:
    """The manifests every gateway registers for the served tensor contract: the runtime's
    `default_manifests`, `snapkv-recall`, `snapkv-recall-codes`, `snapkv-recall-values` and the
    decode-time retention policies
    (`retention_manifests`: window, sinks + window at both position contracts, H2O,
    Scissorhands, Keyformer, SnapKV + H2O, 1,024 rows per owner)."""
    manifests = default_manifests(served)
    recall = with_recall(manifests["snapkv"], SERVED_RECALL_KNOBS)
    codes = with_recall(manifests["snapkv"], CODES_RECALL_KNOBS, name=CODES_RECALL_POLICY)
    values = with_recall(manifests["snapkv"], VALUES_RECALL_KNOBS, name=VALUES_RECALL_POLICY)
    return {**manifests, recall.name: recall, codes.name: codes, values.name: values,
            **retention_manifests(served)}


class UnknownPolicy(InvalidArgument):
    """The client's choice names no stored manifest (INVALID_ARGUMENT naming the field)."""


class DefaultManifestConflict(RuntimeError):
    """A default policy name already holds a manifest for another checkpoint or dtype."""


async def register_defaults(
    client: PolicyClient, served: TensorContract, *, timeout_s: float
) -> list[Registration]:
    """Register `served_manifests(served)` once; re-running with the same contract is a no-op."""
    registrations = []
    for name, manifest in served_manifests(served).items():
        try:
            registrations.append(await client.register_manifest(manifest.canonical_json(), timeout_s=timeout_s))
        except ManifestConflict as exc:
            raise DefaultManifestConflict(
                f"policy {name!r} generation {manifest.policy_generation} is already registered with a "
                f"different manifest (another checkpoint or K/V dtype on this policy service?): {exc}"
            ) from exc
    return registrations


class ManifestResolver:
    """Client choice -> a stored manifest that fits the served deployment, through the shared
    manifest cache (by sha forever, by name for `name_ttl_s`) and the one fit check."""

    def __init__(
        self,
        client: PolicyClient,
        served: TensorContract,
        default_policy: str,
        *,
        name_ttl_s: float = 5.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        restore_defaults: bool = False,
        restore_interval_s: float = 1.0,
    ) -> None:
        self.client = client
        self.served = served
        self.restore_defaults = restore_defaults
        self.restores = 0
        self._defaults = frozenset(served_manifests(served)) if restore_defaults else frozenset()
        self._restore_interval_s = restore_interval_s
        self._restored_at = float("-inf")
        self._restore_lock = asyncio.Lock()
        self._timeout_s = timeout_s
        self._clock = clock
        # The gateway holds no rows; whether a prefill worker keeps recallable_remote rows is
        # that worker's check (the same one).
        self.deployment = Deployment(served)
        self.default_policy = default_policy
        self.manifests = ManifestCache(client, deployment=self.deployment, name_ttl_s=name_ttl_s,
                                       timeout_s=timeout_s, clock=clock)

    async def resolve(self, choice: ManifestChoice) -> KVVisibilityPolicyManifest:
        """INVALID_ARGUMENT naming the choice's field for an unknown or unfit manifest."""
        name = choice.name or self.default_policy
        try:
            return await self._resolve(choice)
        except UnknownPolicy:
            if choice.sha256 or name not in self._defaults or not await self._restore():
                raise
            return await self._resolve(choice)

    async def _restore(self) -> bool:
        """Register the defaults again unless that was done within `restore_interval_s`; True
        when they were (re-)registered now."""
        async with self._restore_lock:
            if self._clock() - self._restored_at < self._restore_interval_s:
                return False
            self._restored_at = self._clock()
            created = await register_defaults(self.client, self.served, timeout_s=self._timeout_s)
            self.restores += 1
            log.warning("default manifests were missing at the policy service; %d registered again",
                        sum(r.created for r in created))
            return True

    async def _resolve(self, choice: ManifestChoice) -> KVVisibilityPolicyManifest:
        if choice.sha256:
            return await self._fitting(choice.sha256, "manifest.sha256")
        name = choice.name or self.default_policy
        field = "manifest.by_name.name" if choice.name else "manifest"
        try:
            ref = await self.manifests.ref(name, choice.policy_generation)
        except NotFound as exc:
            wrong = "manifest.by_name.policy_generation" if exc.field == "policy_generation" else field
            raise UnknownPolicy(exc.message, field=wrong) from None
        except ManifestUnfit as exc:
            raise InvalidArgument(_unfit(name, exc), field=field) from None
        return await self._fitting(ref.sha256, field)

    async def _fitting(self, sha256: str, field: str) -> KVVisibilityPolicyManifest:
        try:
            manifest = await self.manifests.get(sha256)
        except NotFound:
            raise UnknownPolicy("no manifest is registered under this sha256", field=field) from None
        try:
            check_fits(manifest, self.deployment)
        except ManifestUnfit as exc:
            raise InvalidArgument(_unfit(manifest.name, exc), field=field) from None
        return manifest


def _unfit(name: str, exc: ManifestUnfit) -> str:
    return f"policy {name!r} does not fit this deployment: {exc.field} {exc.reason}"
