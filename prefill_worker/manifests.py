"""Manifests by content identity: fetched once from the policy service, parsed, checked against
the loaded model, and cached (a manifest never changes under its sha)."""

from __future__ import annotations

from collections import OrderedDict

from prefill_worker.errors import ManifestUnsupported
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    TensorContract,
)
from services.policy import NotFound, PolicyClient
from services.rpc.errors import Unavailable

_CONTRACT_FIELDS = (
    "num_layers",
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "k_dtype",
    "v_dtype",
    "gqa_grouping",
    "key_positional_stage",
)


def check_servable(
    manifest: KVVisibilityPolicyManifest, model: TensorContract, *, offload_store: bool = False
) -> None:
    """Raise ManifestUnsupported unless this worker can run `manifest` on a model whose
    cache has the tensor contract `model`: same shapes, dtypes, GQA map and key stage, and,
    for `recallable_remote`, an offload store to keep the omitted rows in (`offload_store`).
    `recallable_local` needs none: its rows travel with the view."""
    for name in _CONTRACT_FIELDS:
        wanted, actual = getattr(manifest.tensor, name), getattr(model, name)
        if wanted != actual:
            raise ManifestUnsupported(f"manifest says {wanted}, the loaded model has {actual}", field=f"tensor.{name}")
    if manifest.tensor.resolved_q_to_kv_head_map() != model.resolved_q_to_kv_head_map():
        raise ManifestUnsupported(
            f"manifest maps query heads {list(manifest.tensor.resolved_q_to_kv_head_map())},"
            f" the loaded model {list(model.resolved_q_to_kv_head_map())}",
            field="tensor.q_to_kv_head_map",
        )
    if manifest.recoverability.mode is RecoverabilityMode.RECALLABLE_REMOTE and not offload_store:
        raise ManifestUnsupported(
            f"{manifest.recoverability.mode.value} needs an offload tier this worker does not run",
            field="recoverability.mode",
        )


class ManifestCache:
    """Manifests by sha, at most `capacity` of them (least recently used goes first)."""

    def __init__(
        self, policy: PolicyClient, model: TensorContract, capacity: int = 64, *, offload_store: bool = False
    ) -> None:
        self._policy = policy
        self._model = model
        self._capacity = capacity
        self._offload_store = offload_store
        self._manifests: OrderedDict[str, KVVisibilityPolicyManifest] = OrderedDict()

    async def get(self, sha256: str) -> KVVisibilityPolicyManifest:
        """The servable manifest registered under `sha256`; NotFound naming `manifest_sha256`
        if there is none, ManifestUnsupported if this worker cannot run it."""
        manifest = self._manifests.get(sha256)
        if manifest is None:
            manifest = await self._fetch(sha256)
            self._manifests[sha256] = manifest
            while len(self._manifests) > self._capacity:
                self._manifests.popitem(last=False)
        self._manifests.move_to_end(sha256)
        return manifest

    async def _fetch(self, sha256: str) -> KVVisibilityPolicyManifest:
        try:
            stored = await self._policy.get_manifest(sha256)
        except NotFound as exc:
            raise NotFound(f"no manifest is registered under {sha256}", field="manifest_sha256") from exc
        manifest = KVVisibilityPolicyManifest.from_json(stored.canonical_json)
        if manifest.sha256 != sha256:
            raise Unavailable(f"the policy service returned manifest {manifest.sha256} for {sha256}")
        check_servable(manifest, self._model, offload_store=self._offload_store)
        return manifest
