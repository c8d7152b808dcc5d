"""Bearer tokens and API keys: what a server accepts where a client has no certificate.

A token file holds one token per line as `<sha256 hex of the token> <name> <role>[,<role>...]`
(`#` starts a comment), so the server never stores a usable secret. `kvrelay token` prints a
fresh token and its line. An API key for `Generate` is a token with the `client` role.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.security.roles import Identity, Role

MAX_TOKEN_BYTES = 512


class TokenFileError(ValueError):
    """A token file that cannot be read; names the file and the line."""

    def __init__(self, message: str, *, field: str = "auth_tokens") -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token(name: str, roles: frozenset[Role]) -> tuple[str, str]:
    """A fresh 256-bit token and the token-file line that accepts it."""
    token = secrets.token_urlsafe(32)
    return token, token_line(token, name, roles)


def token_line(token: str, name: str, roles: frozenset[Role]) -> str:
    _check_name(name, "name")
    return f"{token_digest(token)} {name} {','.join(sorted(r.value for r in roles))}"


@dataclass(frozen=True)
class TokenTable:
    """The tokens a server accepts, by digest."""

    identities: Mapping[str, Identity] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.identities)

    def identify(self, token: str) -> Identity | None:
        """The identity a presented token stands for, or None."""
        if not token or len(token) > MAX_TOKEN_BYTES:
            return None
        # A lookup by digest: what its timing could reveal is the digest of the presented
        # token, not a stored secret, so no constant-time scan over every entry is needed.
        return self.identities.get(token_digest(token))

    @classmethod
    def from_text(cls, text: str, source: str = "auth_tokens") -> TokenTable:
        identities: dict[str, Identity] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{source}:{number}"
            parts = line.split()
            if len(parts) != 3:
                raise TokenFileError("expected '<sha256 hex> <name> <role>[,<role>...]'", field=where)
            digest, name, role_list = parts
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise TokenFileError("the first column must be a lowercase sha256 hex digest", field=where)
            _check_name(name, where)
            try:
                roles = frozenset(Role(r) for r in role_list.split(","))
            except ValueError:
                known = ", ".join(r.value for r in Role)
                raise TokenFileError(f"unknown role in {role_list!r} (known: {known})", field=where) from None
            identities[digest] = Identity(name, roles, "token")
        return cls(identities)

    @classmethod
    def from_file(cls, path: Path) -> TokenTable:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"cannot read {path}: {exc}") from None
        return cls.from_text(text, str(path))


def _check_name(name: str, where: str) -> None:
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name):
        raise TokenFileError(f"name {name[:64]!r} must be 1-128 of [A-Za-z0-9-_.]", field=where)
