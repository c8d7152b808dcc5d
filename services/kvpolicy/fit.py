"""Whether a deployment can run a manifest: the one fit check of the gateway, the prefill worker
and the decode worker (each maps `ManifestUnfit` to its own error, naming the same field).

A manifest fits when its tensor contract is the served model's — shapes, K/V dtypes, key
positional stage and the resolved query-to-K/V head map (the grouping label is implied by the
map) — and, for `recallable_remote`, the deployment keeps omitted rows in an offload store.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.kvpolicy.errors import KVPolicyError
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    TensorContract,
)

CONTRACT_FIELDS = (
    "num_layers",
    "num_q_heads",
    "num_kv_heads",
    "head_dim",
    "k_dtype",
    "v_dtype",
    "key_positional_stage",
)


class ManifestUnfit(KVPolicyError):
    """A valid manifest this deployment cannot run; `field` names the manifest field
    (`tensor.num_layers`, `tensor.q_to_kv_head_map`, `recoverability.mode`)."""


@dataclass(frozen=True)
class Deployment:
    """What runs a manifest: the served model's KV tensor contract, and whether omitted rows
    can stay in an offload store (`offload_store`; a prefill worker without one cannot serve
    `recallable_remote`; services that hold no rows themselves leave it True)."""

    contract: TensorContract
    offload_store: bool = True


def check_fits(manifest: KVVisibilityPolicyManifest, deployment: Deployment) -> None:
    """Raise ManifestUnfit naming the first field in which `manifest` does not fit."""
    declared, served = manifest.tensor, deployment.contract
    for name in CONTRACT_FIELDS:
        wanted, actual = getattr(declared, name), getattr(served, name)
        if wanted != actual:
            reason = f"is {_plain(wanted)} in the manifest, {_plain(actual)} in the served model"
            raise ManifestUnfit(f"tensor.{name}", reason)
    if declared.resolved_q_to_kv_head_map() != served.resolved_q_to_kv_head_map():
        raise ManifestUnfit(
            "tensor.q_to_kv_head_map",
            f"is {list(declared.resolved_q_to_kv_head_map())} in the manifest,"
            f" {list(served.resolved_q_to_kv_head_map())} in the served model",
        )
    mode = manifest.recoverability.mode
    if mode is RecoverabilityMode.RECALLABLE_REMOTE and not deployment.offload_store:
        reason = f"is {mode.value}, which needs an offload store this worker does not run"
        raise ManifestUnfit("recoverability.mode", reason)


def _plain(value: object) -> object:
    return getattr(value, "value", value)
