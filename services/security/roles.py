"""Who a peer is: an identity (a name) and the roles it holds.

A kvrelay certificate names its holder in URI subject-alternative names of the form
`spiffe://kvrelay/<role>/<name>`, one per role it holds (SPIFFE-shaped, so a mesh's
workload identities map onto them). A bearer token (where mTLS is not available) maps to the
same `Identity` through the server's token table (`services.security.tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Role(StrEnum):
    """What a caller may do; each RPC names the roles it admits (`services.security.access`)."""

    GATEWAY = "gateway"  # begins and ends requests; calls prefill and decode workers
    PREFILL = "prefill"  # publishes compression states; serves offload; hands off to decode
    DECODE = "decode"  # publishes recall successors; accepts transfers; recalls from offload
    POLICY = "policy"  # the policy service's own certificate (a server; calls nobody)
    OPERATOR = "operator"  # registers manifests
    CLIENT = "client"  # calls Generate (an API key, or a client certificate)


SPIFFE_PREFIX = "spiffe://kvrelay/"


def spiffe_uri(role: Role, name: str) -> str:
    """The URI SAN that gives `name` the role `role`."""
    return f"{SPIFFE_PREFIX}{role.value}/{name}"


@dataclass(frozen=True)
class Identity:
    """An authenticated caller. `name` owns the request ids it begins; `how` says what
    proved it ("mtls", "token", or "plaintext" on a loopback development stack)."""

    name: str
    roles: frozenset[Role]
    how: str

    def holds(self, allowed: frozenset[Role]) -> bool:
        return not self.roles.isdisjoint(allowed)


def roles_from_uris(uris: list[str]) -> tuple[str, frozenset[Role]] | None:
    """The identity a certificate's URI SANs name, or None when none is a kvrelay URI or
    they name different holders (a certificate speaks for one name)."""
    names: set[str] = set()
    roles: set[Role] = set()
    for uri in uris:
        if not uri.startswith(SPIFFE_PREFIX):
            continue
        role_name, _, name = uri[len(SPIFFE_PREFIX):].partition("/")
        try:
            role = Role(role_name)
        except ValueError:
            continue
        if not name or "/" in name:
            continue
        names.add(name)
        roles.add(role)
    if len(names) != 1:
        return None
    return names.pop(), frozenset(roles)
