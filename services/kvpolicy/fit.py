"""Whether a deployment can run a manifest: the one fit check of the gateway, the prefill worker
and the decode worker (each maps `ManifestUnfit` to its own error, naming the same field).

A manifest fits when it declares only what this runtime performs (`check_performed`: no
recall under decode-time retention, original rows only, post-RoPE keys on the wire, the
gateway's fallbacks), its tensor contract is the served model's — shapes, K/V dtypes, key positional stage and the
resolved query-to-K/V head map (the grouping label is implied by the map) — it names the
served logical cache ABI and checkpoint generation, and, for `recallable_remote`, the
deployment keeps omitted rows in an offload store. The policy service refuses at registration
what fits none of the deployments it serves (`check_fits_any`), and the gateway resolves a
policy name to its newest generation that fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.echo import echo
from services.kvpolicy.errors import KVPolicyError
from services.kvpolicy.manifest import (
    CapacityAction,
    InvalidStateAction,
    KeyPositionalStage,
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    RowKind,
    TensorContract,
    cache_abi_sha256,
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
    `recallable_remote`; services that hold no rows themselves leave it True). The served
    logical cache ABI digest is the contract's (`cache_abi_sha256`) unless one is given, and the
    checkpoint generation 0 unless the operator versions the weights."""

    contract: TensorContract
    offload_store: bool = True
    checkpoint_generation: int = 0
    logical_cache_abi_sha256: str | None = None

    @property
    def cache_abi(self) -> str:
        return self.logical_cache_abi_sha256 or cache_abi_sha256(self.contract)


# What each performed-only field may declare, and why the rest is refused.
_PERFORMED = (
    ("tensor.key_positional_stage", KeyPositionalStage.POST_ROPE,
     "every attention path reads keys rotated at their original positions (post_rope)"),
    ("representation.rows", RowKind.ORIGINAL_ROWS,
     "no producer of replacement rows exists: every view carries original rows"),
    ("quality.on_invalid_state", InvalidStateAction.REPREFILL,
     "the gateway prefills a request whose state fails verification again (reprefill)"),
    ("quality.on_capacity_exhausted", CapacityAction.RETRY_OTHER_WORKER,
     "the gateway tries another worker when one has no room (retry_other_worker)"),
)


def check_performed(manifest: KVVisibilityPolicyManifest) -> None:
    """Raise ManifestUnfit naming the first field that declares behaviour this runtime does not
    perform: decode-time retention with recall (the decode worker performs every retention
    method at both position contracts, evicting for good: `omitted_irrecoverable` only),
    replacement rows, keys other than post-RoPE, or a fallback the gateway does not take."""
    retention = manifest.selection.retention
    mode = manifest.recoverability.mode
    if retention is not None and mode is not RecoverabilityMode.OMITTED_IRRECOVERABLE:
        raise ManifestUnfit(
            "recoverability.mode",
            f"{mode.value} with decode-time retention ({retention.method.value}) is not"
            " performed: the decode worker evicts rows for good (omitted_irrecoverable)",
        )
    for path, performed, why in _PERFORMED:
        declared = _field(manifest, path)
        if declared is not performed:
            raise ManifestUnfit(path, f"{_plain(declared)} is not performed: {why}")


def check_fits(manifest: KVVisibilityPolicyManifest, deployment: Deployment) -> None:
    """Raise ManifestUnfit naming the first field in which `manifest` does not fit."""
    check_performed(manifest)
    declared, served = manifest.tensor, deployment.contract
    for name in CONTRACT_FIELDS:
        wanted, actual = getattr(declared, name), getattr(served, name)
        if wanted != actual:
            reason = f"is {_plain(wanted)} in the manifest, {_plain(actual)} in the served model"
            raise ManifestUnfit(f"tensor.{name}", reason)
    if declared.resolved_q_to_kv_head_map() != served.resolved_q_to_kv_head_map():
        raise ManifestUnfit(
            "tensor.q_to_kv_head_map",
            f"is {echo(list(declared.resolved_q_to_kv_head_map()))} in the manifest,"
            f" {echo(list(served.resolved_q_to_kv_head_map()))} in the served model",
        )
    _check_identity(manifest, deployment)
    mode = manifest.recoverability.mode
    if mode is RecoverabilityMode.RECALLABLE_REMOTE and not deployment.offload_store:
        reason = f"is {mode.value}, which needs an offload store this worker does not run"
        raise ManifestUnfit("recoverability.mode", reason)


def _check_identity(manifest: KVVisibilityPolicyManifest, deployment: Deployment) -> None:
    """The manifest was written for the served cache ABI and checkpoint generation."""
    if manifest.logical_cache_abi_sha256 != deployment.cache_abi:
        raise ManifestUnfit(
            "logical_cache_abi_sha256",
            f"is {manifest.logical_cache_abi_sha256} in the manifest, {deployment.cache_abi}"
            " in the served model",
        )
    if manifest.checkpoint_generation != deployment.checkpoint_generation:
        raise ManifestUnfit(
            "checkpoint_generation",
            f"is {manifest.checkpoint_generation} in the manifest,"
            f" {deployment.checkpoint_generation} in the served model",
        )


def _field(manifest: KVVisibilityPolicyManifest, path: str) -> object:
    value: object = manifest
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _plain(value: object) -> object:
    return getattr(value, "value", value)


def check_fits_any(manifest: KVVisibilityPolicyManifest, deployments: Sequence[Deployment]) -> None:
    """Return if `manifest` fits one of `deployments` (any manifest, when there are none);
    otherwise raise the ManifestUnfit of the first deployment."""
    first: ManifestUnfit | None = None
    for deployment in deployments:
        try:
            check_fits(manifest, deployment)
            return
        except ManifestUnfit as exc:
            first = first or exc
    if first is not None:
        raise first
