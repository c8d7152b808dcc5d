"""Typed errors of the prefill worker. Each is a `services.rpc.errors.ServiceError`, so the one
mapping in `services.rpc.errors` turns it into a status code at the edge."""

from __future__ import annotations

from services.rpc import errors as rpc_errors
from services.rpc.kvrelay.v1 import common_pb2


class DecodeWorkerUnavailable(rpc_errors.Unavailable):
    """The handoff to the decode worker failed: unreachable, refused the descriptor, or the
    transfer broke or timed out. The pair group is torn down; the message names the worker,
    so the gateway can retry on another one."""

    reason = common_pb2.ERROR_REASON_TRANSFER_FAILED


class ManifestUnsupported(rpc_errors.InvalidArgument):
    """The manifest is valid but this worker cannot serve it (another tensor contract, or a
    recoverability mode that needs an offload tier). `field` names the manifest field."""

    reason = common_pb2.ERROR_REASON_MANIFEST_INVALID
