"""The PolicyService servicer: a thin adapter from protobuf to validated values to the store.

Each method rejects unknown or mistyped fields (a fence authority must never act on a field
that silently fell back to its default), converts the request once, calls one store
method, and converts the result once. Errors become status codes in `services.rpc.errors`.
A manifest is stored only after it validated (every integer range-checked, cheaply) and fits
one of the configured deployments (`PolicyServiceConfig.deployments`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from policy_service.config import PolicyServiceConfig
from policy_service.session import Sessions
from policy_service.store import PolicyStore
from services.kvpolicy.fit import Deployment, ManifestUnfit, check_fits_any
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import wire
from services.policy.errors import ManifestDoesNotFit, ManifestInvalid, StaleGeneration
from services.policy.types import (
    ManifestRef,
    Phase,
    check_generation,
    check_lease_ms,
    check_request_id,
    check_sha256,
)
from services.rpc.errors import maps_errors, reject_unknown_fields
from services.rpc.kvrelay.v1 import policy_pb2, policy_pb2_grpc
from services.security.access import caller, require_role
from services.security.roles import Role
from services.telemetry.metrics import STALE_REJECTIONS
from services.telemetry.spans import annotate

SERVICE_NAME = policy_pb2.DESCRIPTOR.services_by_name["PolicyService"].full_name
log = logging.getLogger(__name__)


def parse_manifest(data: bytes, max_bytes: int) -> KVVisibilityPolicyManifest:
    """Validate manifest JSON bytes with the kvpolicy core (which names the bad field)."""
    if not data:
        raise ManifestInvalid("must not be empty", field="manifest_json")
    if len(data) > max_bytes:
        raise ManifestInvalid(f"{len(data)} bytes exceeds the limit of {max_bytes}", field="manifest_json")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestInvalid(f"not UTF-8: {exc}", field="manifest_json") from None
    try:
        return KVVisibilityPolicyManifest.from_json(text)
    except RecursionError:
        raise ManifestInvalid("JSON nested too deeply", field="manifest_json") from None


def check_servable(manifest: KVVisibilityPolicyManifest, deployments: Sequence[Deployment]) -> None:
    """ManifestDoesNotFit (FAILED_PRECONDITION) naming the field, unless `manifest` fits one of
    `deployments` (or none are configured)."""
    try:
        check_fits_any(manifest, deployments)
    except ManifestUnfit as exc:
        reason = f"{exc.reason}: policy {manifest.name!r} generation {manifest.policy_generation}"
        raise ManifestDoesNotFit(f"{reason} would not run on this deployment", field=exc.field) from None


class PolicyServicer(policy_pb2_grpc.PolicyServiceServicer):
    """Implements kvrelay.v1.PolicyService over a PolicyStore."""

    def __init__(self, store: PolicyStore, config: PolicyServiceConfig) -> None:
        self.store = store
        self.config = config
        self.sessions = Sessions({
            "begin_request": ("BeginRequest", self.begin_request),
            "publish_state": ("PublishState", self.publish_state),
            "get_fence": ("GetFence", self.get_fence),
            "end_request": ("EndRequest", self.end_request),
        })
        if not config.deployments:
            log.warning("no served checkpoint configured (--checkpoint): manifests are registered "
                        "without checking that the workers can run them")

    def _lease(self, lease_ms: int) -> int:
        check_lease_ms(lease_ms)
        return lease_ms or self.config.default_lease_ms

    @maps_errors
    async def RegisterManifest(
        self, request: policy_pb2.RegisterManifestRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.RegisterManifestResponse:
        reject_unknown_fields(request)
        manifest = parse_manifest(request.manifest_json, self.config.max_manifest_bytes)
        check_servable(manifest, self.config.deployments)
        ref = ManifestRef(manifest.sha256, manifest.name, manifest.policy_generation)
        annotate(manifest_sha256=ref.sha256, manifest_name=ref.name, policy_generation=ref.policy_generation)
        registration = await self.store.register_manifest(ref, manifest.canonical_json())
        return policy_pb2.RegisterManifestResponse(ref=wire.ref_to_proto(ref), created=registration.created)

    @maps_errors
    async def GetManifest(
        self, request: policy_pb2.GetManifestRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.GetManifestResponse:
        reject_unknown_fields(request)
        check_sha256(request.sha256, "sha256")
        stored = await self.store.get_manifest(request.sha256)
        return policy_pb2.GetManifestResponse(manifest=wire.manifest_to_proto(stored))

    @maps_errors
    async def ListManifests(
        self, request: policy_pb2.ListManifestsRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.ListManifestsResponse:
        reject_unknown_fields(request)
        if request.name:
            check_request_id(request.name, "name")
        refs = await self.store.list_manifests(request.name)
        return policy_pb2.ListManifestsResponse(manifests=[wire.ref_to_proto(r) for r in refs])

    @maps_errors
    async def BeginRequest(
        self, request: policy_pb2.BeginRequestRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.BeginRequestResponse:
        return await self.begin_request(request)

    @maps_errors
    async def PublishState(
        self, request: policy_pb2.PublishStateRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.PublishStateResponse:
        return await self.publish_state(request)

    @maps_errors
    async def GetFence(
        self, request: policy_pb2.GetFenceRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.GetFenceResponse:
        return await self.get_fence(request)

    @maps_errors
    async def EndRequest(
        self, request: policy_pb2.EndRequestRequest, context: grpc.aio.ServicerContext
    ) -> policy_pb2.EndRequestResponse:
        return await self.end_request(request)

    async def Session(
        self, requests: AsyncIterator[policy_pb2.SessionCall], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[policy_pb2.SessionReply]:
        async with contextlib.aclosing(self.sessions.serve(requests)) as replies:
            async for reply in replies:
                yield reply

    # The per-request calls, unary or in a Session: typed errors propagate to the caller's edge.

    async def begin_request(self, request: policy_pb2.BeginRequestRequest) -> policy_pb2.BeginRequestResponse:
        reject_unknown_fields(request)
        check_request_id(request.request_id)
        fence = await self.store.begin_request(request.request_id, self._lease(request.lease_ms), _owner())
        annotate(request_id=fence.request_id, request_generation=fence.request_generation)
        return policy_pb2.BeginRequestResponse(fence=wire.fence_to_proto(fence))

    async def publish_state(self, request: policy_pb2.PublishStateRequest) -> policy_pb2.PublishStateResponse:
        reject_unknown_fields(request)
        publisher = PUBLISHERS.get(request.phase)  # before the fields: a wrong role learns nothing
        if publisher is not None:
            require_role(caller(), publisher, f"publishing a {Phase(request.phase).label} state")
        publication = wire.publication_from_proto(request)
        annotate(request_id=publication.request_id, request_generation=publication.request_generation,
                 state_generation=publication.state_generation, cache_generation=publication.cache_generation,
                 manifest_sha256=publication.manifest_sha256, phase=publication.phase.name)
        with _counting_stale():
            result = await self.store.publish_state(publication, self._lease(request.lease_ms))
        annotate(already_published=result.already_published)
        return policy_pb2.PublishStateResponse(
            fence=wire.fence_to_proto(result.fence), already_published=result.already_published
        )

    async def get_fence(self, request: policy_pb2.GetFenceRequest) -> policy_pb2.GetFenceResponse:
        reject_unknown_fields(request)
        check_request_id(request.request_id)
        fence = await self.store.get_fence(request.request_id)
        return policy_pb2.GetFenceResponse(fence=wire.fence_to_proto(fence))

    async def end_request(self, request: policy_pb2.EndRequestRequest) -> policy_pb2.EndRequestResponse:
        reject_unknown_fields(request)
        check_request_id(request.request_id)
        check_generation(request.request_generation, "request_generation", minimum=1)
        annotate(request_id=request.request_id, request_generation=request.request_generation)
        with _counting_stale():
            fence = await self.store.end_request(
                request.request_id, request.request_generation, self.config.end_retention_ms, _owner()
            )
        return policy_pb2.EndRequestResponse(fence=wire.fence_to_proto(fence))


# Who publishes which phase (services.security.access: request-level rules). BEGUN and ENDED
# are not published (BeginRequest and EndRequest set them): wire validation refuses them.
PUBLISHERS: dict[int, Role] = {Phase.PREFILLED: Role.PREFILL, Phase.DECODING: Role.DECODE, Phase.RECALLED: Role.DECODE}


def _owner() -> str:
    """The identity a request id is bound to ('' on an unauthenticated development stack)."""
    identity = caller()
    return identity.name if identity is not None else ""


@contextlib.contextmanager
def _counting_stale() -> Iterator[None]:
    """Count a StaleGeneration (the fence refused older work) on its way to the edge."""
    try:
        yield
    except StaleGeneration:
        STALE_REJECTIONS.labels("policy").inc()
        raise
