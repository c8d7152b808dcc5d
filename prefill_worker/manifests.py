"""The manifests this worker can run: the shared cache (`services.policy.manifests`) and the one
fit check (`services.kvpolicy.fit`) against what this worker serves, with the errors of its
edge (NotFound naming `manifest_sha256`, ManifestUnsupported naming the manifest field)."""

from __future__ import annotations

from prefill_worker.errors import ManifestUnsupported
from services.kvpolicy.fit import Deployment, ManifestUnfit, check_fits
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import NotFound
from services.policy.manifests import ManifestCache


def check_servable(manifest: KVVisibilityPolicyManifest, deployment: Deployment) -> None:
    """Raise ManifestUnsupported unless `deployment` (the loaded model's tensor contract, and
    whether this worker runs an offload store) can run `manifest`."""
    try:
        check_fits(manifest, deployment)
    except ManifestUnfit as exc:
        raise ManifestUnsupported(exc.reason, field=exc.field) from exc


class ServableManifests:
    """Manifests by sha that fit this worker's deployment."""

    def __init__(self, cache: ManifestCache, deployment: Deployment) -> None:
        self.cache = cache
        self.deployment = deployment

    async def get(self, sha256: str) -> KVVisibilityPolicyManifest:
        """The manifest registered under `sha256`; NotFound naming `manifest_sha256` if there is
        none, ManifestUnsupported if this worker cannot run it."""
        try:
            manifest = await self.cache.get(sha256)
        except NotFound as exc:
            raise NotFound(f"no manifest is registered under {sha256}", field="manifest_sha256") from exc
        check_servable(manifest, self.deployment)
        return manifest
