"""Protobuf <-> policy values, converted once at the RPC edge (server and client)."""

from __future__ import annotations

from services.policy.errors import RequestInvalid
from services.policy.types import Fence, ManifestRef, Phase, StatePublication, StoredManifest
from services.rpc.kvrelay.v1 import common_pb2, policy_pb2


def phase_from_proto(value: int, field: str = "phase") -> Phase:
    try:
        return Phase(value)
    except ValueError:
        raise RequestInvalid(f"{value} is not a known phase", field=field) from None


def fence_to_proto(fence: Fence) -> common_pb2.Fence:
    return common_pb2.Fence(
        request_id=fence.request_id,
        request_generation=fence.request_generation,
        state_generation=fence.state_generation,
        cache_generation=fence.cache_generation,
        receipt_digest=fence.receipt_digest,
        manifest_sha256=fence.manifest_sha256,
        phase=common_pb2.Phase.Value(f"PHASE_{fence.phase.name}"),
        prefill_worker=fence.prefill_worker,
        decode_worker=fence.decode_worker,
        updated_at_unix_ms=fence.updated_at_unix_ms,
        lease_remaining_ms=fence.lease_remaining_ms,
    )


def fence_from_proto(message: common_pb2.Fence) -> Fence:
    return Fence(
        request_id=message.request_id,
        request_generation=message.request_generation,
        state_generation=message.state_generation,
        cache_generation=message.cache_generation,
        receipt_digest=message.receipt_digest,
        manifest_sha256=message.manifest_sha256,
        phase=phase_from_proto(message.phase, "fence.phase"),
        prefill_worker=message.prefill_worker,
        decode_worker=message.decode_worker,
        updated_at_unix_ms=message.updated_at_unix_ms,
        lease_remaining_ms=message.lease_remaining_ms,
    )


def publication_to_proto(publication: StatePublication, lease_ms: int = 0) -> policy_pb2.PublishStateRequest:
    return policy_pb2.PublishStateRequest(
        request_id=publication.request_id,
        request_generation=publication.request_generation,
        parent_state_generation=publication.parent_state_generation,
        state_generation=publication.state_generation,
        cache_generation=publication.cache_generation,
        receipt_digest=publication.receipt_digest,
        manifest_sha256=publication.manifest_sha256,
        phase=common_pb2.Phase.Value(f"PHASE_{publication.phase.name}"),
        prefill_worker=publication.prefill_worker,
        decode_worker=publication.decode_worker,
        lease_ms=lease_ms,
    )


def publication_from_proto(message: policy_pb2.PublishStateRequest) -> StatePublication:
    """Validated publication; raises RequestInvalid naming the first bad field."""
    return StatePublication(
        request_id=message.request_id,
        request_generation=message.request_generation,
        parent_state_generation=message.parent_state_generation,
        state_generation=message.state_generation,
        cache_generation=message.cache_generation,
        receipt_digest=message.receipt_digest,
        manifest_sha256=message.manifest_sha256,
        phase=phase_from_proto(message.phase),
        prefill_worker=message.prefill_worker,
        decode_worker=message.decode_worker,
    )


def ref_to_proto(ref: ManifestRef) -> common_pb2.ManifestRef:
    return common_pb2.ManifestRef(sha256=ref.sha256, name=ref.name, policy_generation=ref.policy_generation)


def ref_from_proto(message: common_pb2.ManifestRef) -> ManifestRef:
    return ManifestRef(sha256=message.sha256, name=message.name, policy_generation=message.policy_generation)


def manifest_to_proto(manifest: StoredManifest) -> common_pb2.Manifest:
    return common_pb2.Manifest(ref=ref_to_proto(manifest.ref), canonical_json=manifest.canonical_json)


def manifest_from_proto(message: common_pb2.Manifest) -> StoredManifest:
    return StoredManifest(ref=ref_from_proto(message.ref), canonical_json=message.canonical_json)
