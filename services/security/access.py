"""Who may call what: the authorization matrix of every kvrelay RPC, and the server
interceptor that enforces it.

A call's identity comes from the peer's certificate (mTLS: the `spiffe://kvrelay/<role>/<name>`
URIs it carries) or, without one, from a bearer token in `authorization` metadata that the
server's token table knows. No identity is UNAUTHENTICATED; an identity without a role the
method admits is PERMISSION_DENIED; a method missing from the matrix is denied to everyone
(fail closed). Health checks stay open so that probes work; reflection needs any identity.
The identity is available to the servicer as `caller()` (the policy service binds a request id
to the identity that began it). On a plaintext server without tokens (the loopback development
stack) nobody is authenticated and every call is let through: `caller()` is None.

Request-level rules that the matrix cannot express live with the servicer and use `caller()`:
only prefill workers publish PREFILLED states and only decode workers DECODING/RECALLED ones;
only the identity that began a request id ends it.
"""

from __future__ import annotations

import contextlib
import contextvars
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from services.rpc.errors import (
    PermissionDenied,
    ServiceError,
    Unauthenticated,
    abort_with,
    status_for,
)
from services.rpc.handlers import HandlerInterceptor, rewrap
from services.security.certs import peer_identity_from_pem
from services.security.roles import Identity, Role
from services.security.tokens import TokenTable

G, P, D, OP, C = Role.GATEWAY, Role.PREFILL, Role.DECODE, Role.OPERATOR, Role.CLIENT
ANY_ROLE = frozenset(Role)


@dataclass(frozen=True)
class Rule:
    """The roles a method admits. `open_without_keys`: anyone may call while the server has
    no token table (Generate: an API key is asked for only when some are configured)."""

    roles: frozenset[Role]
    open_without_keys: bool = False


def _rule(*roles: Role, open_without_keys: bool = False) -> Rule:
    return Rule(frozenset(roles), open_without_keys)


GENERATE = "/kvrelay.v1.Gateway/Generate"
ACCESS: Mapping[str, Rule] = {
    "/kvrelay.v1.PolicyService/RegisterManifest": _rule(OP),
    "/kvrelay.v1.PolicyService/GetManifest": _rule(G, P, D, OP),
    "/kvrelay.v1.PolicyService/ListManifests": _rule(G, P, D, OP),
    "/kvrelay.v1.PolicyService/BeginRequest": _rule(G),
    "/kvrelay.v1.PolicyService/PublishState": _rule(P, D),
    "/kvrelay.v1.PolicyService/GetFence": _rule(G, P, D, OP),
    "/kvrelay.v1.PolicyService/EndRequest": _rule(G),
    # Opens to anyone who may make one of its calls; each call is then held to its own rule
    # (`authorize_within`).
    "/kvrelay.v1.PolicyService/Session": _rule(G, P, D, OP),
    "/kvrelay.v1.PrefillWorker/Prefill": _rule(G),
    "/kvrelay.v1.DecodeWorker/GetTransferEndpoint": _rule(P),
    "/kvrelay.v1.DecodeWorker/AcceptTransfer": _rule(P),
    "/kvrelay.v1.DecodeWorker/StreamTokens": _rule(G),
    "/kvrelay.v1.OffloadService/Recall": _rule(D),
    "/kvrelay.v1.OffloadService/RenewLease": _rule(D),
    "/kvrelay.v1.OffloadService/Release": _rule(D),
    GENERATE: _rule(C, open_without_keys=True),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": Rule(ANY_ROLE),
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": Rule(ANY_ROLE),
}
PUBLIC = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})

_CALLER: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvrelay_caller", default=None)


def caller() -> Identity | None:
    """The identity of the call being served (None on an unauthenticated development server)."""
    return _CALLER.get()


def identify(auth_context: Mapping[str, list[bytes]], metadata: Any, tokens: TokenTable) -> Identity | None:
    """The caller's identity: its certificate's kvrelay URIs, else its bearer token."""
    pems = auth_context.get("x509_pem_cert") or []
    if pems:
        found = peer_identity_from_pem(bytes(pems[0]))
        if found is not None:
            name, roles = found
            return Identity(name, roles, "mtls")
    token = _bearer(metadata)
    return tokens.identify(token) if token else None


def identify_connection(peer_cert_der: bytes | None, authorization: str, tokens: TokenTable) -> Identity | None:
    """`identify` for a connection that is not gRPC: the peer certificate its TLS handshake
    verified (DER), else the `Bearer <token>` it sent."""
    pems = [ssl.DER_cert_to_PEM_cert(peer_cert_der).encode()] if peer_cert_der else []
    return identify({"x509_pem_cert": pems}, [("authorization", authorization)], tokens)


def act_as(identity: Identity | None) -> None:
    """Make `identity` what `caller()` returns in this task and in the tasks it starts (a
    connection's own task, which ends with the connection)."""
    _CALLER.set(identity)


def _bearer(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            scheme, _, credential = text.partition(" ")
            if scheme.lower() == "bearer":
                return credential.strip()
    return ""


def api_key_check(tokens: TokenTable) -> Callable[[Mapping[str, str]], None]:
    """The HTTP front's authentication: the same rule as gRPC `Generate`, from the request's
    `Authorization: Bearer <key>` header (raises Unauthenticated or PermissionDenied)."""

    def check(headers: Mapping[str, str]) -> None:
        header = headers.get("authorization", "")
        authorize(GENERATE, tokens.identify(_bearer([("authorization", header)])), tokens)

    return check


def authorize(method: str, identity: Identity | None, tokens: TokenTable) -> None:
    """Raise Unauthenticated or PermissionDenied unless `identity` may call `method`."""
    if method in PUBLIC:
        return
    rule = ACCESS.get(method)
    if rule is not None and rule.open_without_keys and not tokens:
        return
    if identity is None:
        raise Unauthenticated("no identity: present a client certificate from this deployment's "
                              "CA, or an `authorization: Bearer` token this server knows",
                              field="authorization")
    authorize_within(method, identity)


def authorize_within(method: str, identity: Identity | None) -> None:
    """PermissionDenied unless `identity`, admitted to a stream, may make the call `method`
    inside it (`ACCESS`'s rule for that method). None is the unauthenticated development
    server, which admits everything; an authenticating server admitted nobody without one."""
    if identity is None:
        return
    rule = ACCESS.get(method)
    if rule is None:
        raise PermissionDenied(f"{method} is not open to any caller", field="method")
    if not identity.holds(rule.roles):
        needed = ", ".join(sorted(r.value for r in rule.roles))
        held = ", ".join(sorted(r.value for r in identity.roles)) or "none"
        raise PermissionDenied(f"{identity.name!r} holds roles {held}; {method} needs one of {needed}",
                               field="authorization")


def require_role(identity: Identity | None, role: Role, what: str) -> None:
    """A request-level rule: `what` is done only by identities holding `role` (skipped on an
    unauthenticated development server, where `identity` is None)."""
    if identity is not None and role not in identity.roles:
        raise PermissionDenied(f"{what} is done by {role.value} identities, not {identity.name!r}",
                               field="authorization")


class Authorization(HandlerInterceptor):
    """Checks every call against `ACCESS` before its handler runs and makes the caller's
    identity available as `caller()` inside it."""

    def __init__(self, tokens: TokenTable) -> None:
        self.tokens = tokens

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if method in PUBLIC:
            return handler
        check = _Check(method, self.tokens)
        checked = rewrap(handler, unary=check.unary, stream=check.stream, bidi=check.bidi)
        return checked if checked is not None else _refusing(handler, method)


@dataclass(frozen=True)
class _Check:
    method: str
    tokens: TokenTable

    async def admit(self, context: grpc.aio.ServicerContext) -> Identity | None:
        identity = identify(context.auth_context(), context.invocation_metadata(), self.tokens)
        try:
            authorize(self.method, identity, self.tokens)
        except ServiceError as exc:
            status = status_for(exc)
            assert status is not None
            await abort_with(context, status)
        return identity

    def unary(self, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            token = _CALLER.set(await self.admit(context))
            try:
                return await behavior(request, context)
            finally:
                _CALLER.reset(token)

        return unary

    def stream(self, behavior: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _CALLER.set(await self.admit(context))  # the call's own task: its context ends with it
            async with contextlib.aclosing(behavior(request, context)) as items:
                async for item in items:
                    yield item

        return stream

    def bidi(self, behavior: Callable[..., AsyncGenerator[Any, None]]) -> Callable[..., AsyncIterator[Any]]:
        async def bidi(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _CALLER.set(await self.admit(context))
            async with contextlib.aclosing(behavior(requests, context)) as items:
                async for item in items:
                    yield item

        return bidi


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler shape this interceptor cannot wrap is refused rather than let through."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: not authorized")

    return grpc.unary_unary_rpc_method_handler(refuse)
