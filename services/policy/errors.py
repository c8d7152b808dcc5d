"""Typed errors of the policy service, raised by the server and re-raised by the client.

Each is a `services.rpc.errors.ServiceError`, so the one mapping in `services.rpc.errors`
turns it into a status code; the client turns the status code and its `ErrorDetail`
back into the same type. `except PolicyError` catches every one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.rpc import errors as rpc_errors
from services.rpc.kvrelay.v1 import common_pb2

if TYPE_CHECKING:
    from services.policy.types import Fence


class PolicyError(rpc_errors.ServiceError):
    """Base of every policy service error."""


class ManifestInvalid(rpc_errors.InvalidArgument, PolicyError):
    """The manifest failed validation; `field` names the offending manifest field."""

    reason = common_pb2.ERROR_REASON_MANIFEST_INVALID


class ManifestDoesNotFit(rpc_errors.FailedPrecondition, PolicyError):
    """A valid manifest that fits none of the deployments this policy service serves
    (`services.kvpolicy.fit.check_fits`); `field` names the manifest field that differs."""

    reason = common_pb2.ERROR_REASON_MANIFEST_INVALID


class RequestInvalid(rpc_errors.InvalidArgument, PolicyError):
    """A request argument is malformed or out of range; `field` names it."""


class NotFound(rpc_errors.NotFound, PolicyError):
    """No such manifest, or no such (live) request."""


class ManifestConflict(rpc_errors.AlreadyExists, PolicyError):
    """A different manifest is already registered under this (name, policy_generation)."""


class StaleGeneration(rpc_errors.FailedPrecondition, PolicyError):
    """The caller's generations no longer match; `current` is the fence as it stands."""

    def __init__(self, message: str, *, current: Fence, field: str = "") -> None:
        super().__init__(message, field=field)
        self.current = current

    def detail(self) -> common_pb2.ErrorDetail:
        # Imported here: wire.py imports types.py, which raises errors from this module.
        from services.policy.wire import fence_to_proto

        detail = super().detail()
        detail.current.CopyFrom(fence_to_proto(self.current))
        return detail


class RequestEnded(StaleGeneration):
    """The request was ended; nothing more can be published for it."""

    reason = common_pb2.ERROR_REASON_REQUEST_ENDED


class PolicyUnauthenticated(rpc_errors.Unauthenticated, PolicyError):
    """The policy service did not know who called (no certificate from its CA, no token)."""


class PolicyPermissionDenied(rpc_errors.PermissionDenied, PolicyError):
    """The caller lacks the role for the call, or the request id belongs to another identity."""


class PolicyUnavailable(rpc_errors.Unavailable, PolicyError):
    """The policy service or its Redis could not be reached within the deadline."""


class PolicyCallFailed(PolicyError):
    """Any other failed call (e.g. an internal server error); `status` is the gRPC code."""

    def __init__(self, message: str, *, status: object, field: str = "") -> None:
        super().__init__(message, field=field)
        self.status = status
