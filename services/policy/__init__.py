"""Client side of the policy service: typed values, typed errors and the async client."""

from services.policy.client import PolicyClient, PolicyClientConfig
from services.policy.errors import (
    ManifestConflict,
    ManifestDoesNotFit,
    ManifestInvalid,
    NotFound,
    PolicyCallFailed,
    PolicyError,
    PolicyUnavailable,
    RequestEnded,
    RequestInvalid,
    StaleGeneration,
)
from services.policy.types import (
    Fence,
    ManifestRef,
    Phase,
    PublishResult,
    Registration,
    StatePublication,
    StoredManifest,
)

__all__ = [
    "Fence",
    "ManifestConflict",
    "ManifestDoesNotFit",
    "ManifestInvalid",
    "ManifestRef",
    "NotFound",
    "Phase",
    "PolicyCallFailed",
    "PolicyClient",
    "PolicyClientConfig",
    "PolicyError",
    "PolicyUnavailable",
    "PublishResult",
    "Registration",
    "RequestEnded",
    "RequestInvalid",
    "StatePublication",
    "StaleGeneration",
    "StoredManifest",
]
