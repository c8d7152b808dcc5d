"""How worker failures reach the client.

A worker's own typed failure (INVALID_ARGUMENT, FAILED_PRECONDITION with the current fence,
RESOURCE_EXHAUSTED, ...) is relayed with its status code and `ErrorDetail` unchanged; the
message gains the worker that said it. A failure before the first token reaches the client
is a `WorkerFailed`: the orchestrator may retry it on other workers, or relay its error.
A request id already streaming through this gateway is refused (`RequestInFlight`).
"""

from __future__ import annotations

import grpc

from services.rpc.errors import (  # re-exported: the HTTP front's authentication hook raises them
    AlreadyExists,
    Internal,
    PermissionDenied,
    ServiceError,
    Unauthenticated,
    Unavailable,
    error_detail,
)

__all__ = ["DeadlineExceeded", "PermissionDenied", "RelayedError", "RequestInFlight", "Unauthenticated",
           "WorkerFailed", "relay"]
from services.rpc.kvrelay.v1 import common_pb2


class RelayedError(ServiceError):
    """A downstream kvrelay service's error, passed on with its code and detail."""

    def __init__(self, code: grpc.StatusCode, upstream: common_pb2.ErrorDetail, where: str) -> None:
        super().__init__(f"{where}: {upstream.message}", field=upstream.field)
        self.code = code  # type: ignore[misc]  # per instance: whatever the worker answered
        self._upstream = upstream

    def detail(self) -> common_pb2.ErrorDetail:
        detail = common_pb2.ErrorDetail()
        detail.CopyFrom(self._upstream)
        detail.message = self.message
        return detail


def relay(error: grpc.aio.AioRpcError, where: str) -> ServiceError:
    """The error to send the client for a failed call to `where` (e.g. "decode worker 1.2.3.4:50063").
    Transport failures without a kvrelay detail become UNAVAILABLE naming `where`."""
    detail = error_detail(error)
    if error.code() in _REFUSED_US:
        # The worker refused the gateway's own identity, not the client's: a deployment
        # misconfiguration (certificates, roles) that the client can neither fix nor retry.
        message = detail.message if detail is not None else (error.details() or "")
        return Internal(f"{where} refused this gateway ({error.code().name}): {message}")
    if detail is None:
        return Unavailable(f"{where}: {error.code().name}: {error.details() or 'no details'}")
    return RelayedError(error.code(), detail, where)


_REFUSED_US = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class WorkerFailed(Exception):
    """A worker failed before the first token reached the client.

    `prefill` / `decode` name the worker to avoid on a retry (empty when not to blame);
    `error` is what the client gets when no retry is left. `busy`: the worker refused for
    lack of room (RESOURCE_EXHAUSTED) and did nothing, so trying again later costs no retry.
    """

    def __init__(
        self, error: ServiceError, *, prefill: str = "", decode: str = "", busy: bool = False
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.prefill = prefill
        self.decode = decode
        self.busy = busy


class DeadlineExceeded(ServiceError):
    """The request outlived the deadline its front gave it (the HTTP front's request timeout;
    gRPC clients' own deadlines are grpc's to enforce)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = common_pb2.ERROR_REASON_UNSPECIFIED


class RequestInFlight(AlreadyExists):
    """A Generate named a request id whose stream is still open on this gateway; beginning it
    again would fence that stream out, so the newcomer is refused instead."""

    reason = common_pb2.ERROR_REASON_REQUEST_INVALID
