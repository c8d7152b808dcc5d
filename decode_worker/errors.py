"""Typed errors of the decode worker. Each is a `services.rpc.errors.ServiceError`, so the
one mapping in `services.rpc.errors` turns it into a status code at the RPC edge.

| error                | status              | when                                                  |
| -------------------- | ------------------- | ----------------------------------------------------- |
| `TransferInvalid`    | INVALID_ARGUMENT    | a descriptor field is malformed or out of range       |
| `UnknownTransfer`    | NOT_FOUND           | StreamTokens names no accepted transfer               |
| `DuplicateTransfer`  | ALREADY_EXISTS      | a transfer id is accepted twice                       |
| `StaleTransfer`      | FAILED_PRECONDITION | the fence says the received state is not current      |
| `ViewRejected`       | FAILED_PRECONDITION | payload or receipt does not match what was promised   |
| `TransferFailed`     | UNAVAILABLE         | receive failed, timed out, or verification could not run |
| `RecallAborted`      | UNAVAILABLE         | a recall's rows did not come back and the manifest says `fail_request` |
| `CapacityExhausted`  | RESOURCE_EXHAUSTED  | KV byte budget or pair-group slots are used up        |
| `NonFiniteDecode`    | INTERNAL            | the request's own logits were not finite; it failed alone, its batch went on |
"""

from __future__ import annotations

from services.policy.types import Fence
from services.rpc import errors as rpc_errors
from services.rpc.kvrelay.v1 import common_pb2


class DecodeWorkerError(rpc_errors.ServiceError):
    """Base of every decode worker error."""


class TransferInvalid(rpc_errors.InvalidArgument, DecodeWorkerError):
    """A field of the transfer descriptor is malformed; `field` names it (dotted)."""


class UnknownTransfer(rpc_errors.NotFound, DecodeWorkerError):
    """No accepted transfer has this id (never accepted, finished, or its lease expired)."""


class DuplicateTransfer(rpc_errors.AlreadyExists, DecodeWorkerError):
    """This transfer id is already accepted, or its stream is already open."""

    reason = common_pb2.ERROR_REASON_REQUEST_INVALID


class ViewRejected(rpc_errors.FailedPrecondition, DecodeWorkerError):
    """The received view or its receipt does not match the descriptor; nothing is decoded."""

    reason = common_pb2.ERROR_REASON_TRANSFER_FAILED


class StaleTransfer(rpc_errors.FailedPrecondition, DecodeWorkerError):
    """The policy service's fence does not admit the received state; `current` is the fence
    (None when the request is unknown to the policy service)."""

    def __init__(self, message: str, *, field: str = "", current: Fence | None = None) -> None:
        super().__init__(message, field=field)
        self.current = current

    def detail(self) -> common_pb2.ErrorDetail:
        # Imported here, like services.policy.errors: wire imports the policy types.
        from services.policy.wire import fence_to_proto

        detail = super().detail()
        if self.current is not None:
            detail.current.CopyFrom(fence_to_proto(self.current))
        return detail


class TransferFailed(rpc_errors.Unavailable, DecodeWorkerError):
    """The KV state did not arrive or could not be verified in time; retry elsewhere."""

    reason = common_pb2.ERROR_REASON_TRANSFER_FAILED


class RecallAborted(rpc_errors.Unavailable, DecodeWorkerError):
    """A recall's rows did not come back (in time, or at all) and the manifest's
    `timeout_fallback` is `fail_request`: the request ends; tokens already streamed stay valid."""

    reason = common_pb2.ERROR_REASON_RECALL_TIMEOUT


class CapacityExhausted(rpc_errors.ResourceExhausted, DecodeWorkerError):
    """The KV byte budget (or the pair-group slots) cannot hold another transfer now."""


class NonFiniteDecode(rpc_errors.Internal, DecodeWorkerError):
    """The request's own logits came out NaN or +inf (its KV or its computation went wrong, never
    its sampling values: every admitted one is safe). It ends alone, naming itself, and its
    batch goes on; tokens already streamed stay valid. Retrying elsewhere would compute the same."""
