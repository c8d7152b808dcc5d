"""The one place the HTTP front turns an error into an HTTP status and OpenAI's error JSON:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "..."}}

Every error first goes through `services.rpc.errors.status_for` — the same typed-error to
gRPC-code mapping the gRPC front uses — and the gRPC code picks the HTTP status here, so
both fronts agree on what an error is. `param` is the OpenAI parameter the error names (the
gateway's field paths translated by the caller, `services.gateway.openai_api.convert`);
messages are bounded as on the gRPC edge. An error the table does not know is a 500 that
says no more than its type.

| gRPC code (typed error)                               | HTTP | type                     |
| ----------------------------------------------------- | ---- | ------------------------ |
| INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE   | 400  | invalid_request_error    |
| UNAUTHENTICATED                                       | 401  | authentication_error     |
| PERMISSION_DENIED                                     | 403  | permission_error         |
| NOT_FOUND (an unknown model)                          | 404  | not_found_error          |
| ALREADY_EXISTS                                        | 409  | conflict_error           |
| RESOURCE_EXHAUSTED (workers busy, queues full)        | 429  | rate_limit_error         |
| UNAVAILABLE (no healthy worker, policy service down)  | 503  | service_unavailable_error |
| DEADLINE_EXCEEDED (the request timeout)               | 504  | timeout_error            |
| anything else                                         | 500  | internal_error           |
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from services.rpc.errors import RpcStatus, bounded, status_for
from services.rpc.kvrelay.v1 import common_pb2

log = logging.getLogger(__name__)

_C = grpc.StatusCode
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    _C.INVALID_ARGUMENT: (400, "invalid_request_error"),
    _C.FAILED_PRECONDITION: (400, "invalid_request_error"),
    _C.OUT_OF_RANGE: (400, "invalid_request_error"),
    _C.UNAUTHENTICATED: (401, "authentication_error"),
    _C.PERMISSION_DENIED: (403, "permission_error"),
    _C.NOT_FOUND: (404, "not_found_error"),
    _C.ALREADY_EXISTS: (409, "conflict_error"),
    _C.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    _C.UNAVAILABLE: (503, "service_unavailable_error"),
    _C.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_INTERNAL = (500, "internal_error")


@dataclass(frozen=True)
class HttpError:
    """What the front answers for one error."""

    status: int
    body: dict[str, Any]


def http_error(exc: BaseException, param: Callable[[str], str] = lambda field: field) -> HttpError:
    """The HTTP status and OpenAI error body for `exc`; `param` translates the field the
    error names into the request's parameter name."""
    rpc = status_for(exc)
    if rpc is None:
        log.exception("HTTP front: unexpected error", exc_info=exc)
        return HttpError(_INTERNAL[0], _body(f"internal error ({type(exc).__name__})", _INTERNAL[1], None, None))
    rpc = bounded(rpc)
    status, kind = HTTP_STATUS.get(rpc.code, _INTERNAL)
    field = rpc.detail.field
    return HttpError(status, _body(rpc.detail.message, kind, param(field) if field else None, _code(rpc)))


def _code(rpc: RpcStatus) -> str:
    """kvrelay's reason (`request_invalid`, `capacity`, ...), else the gRPC code's name."""
    if rpc.detail.reason != common_pb2.ERROR_REASON_UNSPECIFIED:
        name: str = common_pb2.ErrorReason.Name(rpc.detail.reason)
        return name.removeprefix("ERROR_REASON_").lower()
    return str(rpc.code.name).lower()


def _body(message: str, kind: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
