"""The values that cross the policy service boundary, validated on construction.

Shared by the server (`policy_service`) and the typed client; protobuf conversion lives
in `services.policy.wire`, once.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from services.echo import echo
from services.kvpolicy.manifest import MAX_GENERATION, is_policy_name
from services.policy.errors import RequestInvalid

MAX_REQUEST_ID_CHARS = 128
MAX_WORKER_ID_CHARS = 128
MAX_LEASE_MS = 7 * 24 * 3600 * 1000
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]*")
_WORKER_ID = re.compile(r"[!-~]*")  # printable ASCII, no whitespace
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class Phase(enum.IntEnum):
    """Lifecycle of a request's visible KV state; values equal the proto enum's."""

    BEGUN = 1
    PREFILLED = 2
    DECODING = 3
    RECALLED = 4
    ENDED = 5

    @property
    def label(self) -> str:
        """The lowercase name stored in Redis."""
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> Phase:
        return cls[label.upper()]


PUBLISHABLE_PHASES = frozenset({Phase.PREFILLED, Phase.DECODING, Phase.RECALLED})


def check_request_id(value: str, field: str = "request_id") -> None:
    """1..128 characters: letters, digits and `._:@/-`, starting with a letter or digit."""
    if not value:
        raise RequestInvalid("must not be empty", field=field)
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise RequestInvalid(f"{len(value)} characters exceeds the limit of {MAX_REQUEST_ID_CHARS}", field=field)
    if not _REQUEST_ID.fullmatch(value):
        raise RequestInvalid(f"{echo(value)} must match {_REQUEST_ID.pattern}", field=field)


def check_generation(value: int, field: str, minimum: int = 0) -> None:
    """An integer in [minimum, 2**53)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestInvalid(f"expected an integer, got {echo(value)}", field=field)
    if not minimum <= value <= MAX_GENERATION:
        raise RequestInvalid(f"{echo(value)} is not in [{minimum}, {MAX_GENERATION}]", field=field)


def check_sha256(value: str, field: str) -> None:
    if not _SHA256_HEX.fullmatch(value):
        raise RequestInvalid(f"{echo(value)} is not a lowercase hex SHA-256", field=field)


def check_lease_ms(value: int, field: str = "lease_ms") -> None:
    """0 (use the server default) or a lease in (0, 7 days]."""
    if not 0 <= value <= MAX_LEASE_MS:
        raise RequestInvalid(f"{value} is not in [0, {MAX_LEASE_MS}]", field=field)


def _check_worker_id(value: str, field: str) -> None:
    if len(value) > MAX_WORKER_ID_CHARS or not _WORKER_ID.fullmatch(value):
        raise RequestInvalid(
            f"must be at most {MAX_WORKER_ID_CHARS} printable ASCII characters without spaces", field=field
        )


@dataclass(frozen=True)
class ManifestRef:
    """Identity of a stored manifest."""

    sha256: str
    name: str
    policy_generation: int


def check_manifest_ref(ref: ManifestRef) -> None:
    """What a stored ref must be to cross the wire: a SHA-256, a policy name (the manifest
    rule) and a generation in [1, 2**53)."""
    check_sha256(ref.sha256, "sha256")
    if not is_policy_name(ref.name):
        raise RequestInvalid(f"{echo(ref.name)} is not a policy name", field="name")
    check_generation(ref.policy_generation, "policy_generation", minimum=1)


@dataclass(frozen=True)
class StoredManifest:
    ref: ManifestRef
    canonical_json: bytes


@dataclass(frozen=True)
class Registration:
    """Result of RegisterManifest: `created` is False for an identical re-registration."""

    ref: ManifestRef
    created: bool


@dataclass(frozen=True)
class Fence:
    """The policy service's current values for one request."""

    request_id: str
    request_generation: int
    state_generation: int
    cache_generation: int
    receipt_digest: str
    manifest_sha256: str
    phase: Phase
    prefill_worker: str
    decode_worker: str
    updated_at_unix_ms: int
    lease_remaining_ms: int

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    def admits(self, request_generation: int, state_generation: int, receipt_digest: str) -> bool:
        """True when a receipt with these values is the current, usable state."""
        return (
            not self.ended
            and self.request_generation == request_generation
            and self.state_generation == state_generation
            and self.receipt_digest == receipt_digest
        )


@dataclass(frozen=True)
class StatePublication:
    """A successor state: valid only if `state_generation == parent_state_generation + 1`."""

    request_id: str
    request_generation: int
    parent_state_generation: int
    state_generation: int
    cache_generation: int
    receipt_digest: str
    manifest_sha256: str
    phase: Phase
    prefill_worker: str = ""
    decode_worker: str = ""

    def __post_init__(self) -> None:
        check_request_id(self.request_id)
        check_generation(self.request_generation, "request_generation", minimum=1)
        check_generation(self.parent_state_generation, "parent_state_generation")
        check_generation(self.state_generation, "state_generation", minimum=1)
        check_generation(self.cache_generation, "cache_generation")
        if self.state_generation != self.parent_state_generation + 1:
            raise RequestInvalid(
                f"{self.state_generation} is not parent_state_generation + 1 "
                f"({self.parent_state_generation + 1})",
                field="state_generation",
            )
        check_sha256(self.receipt_digest, "receipt_digest")
        check_sha256(self.manifest_sha256, "manifest_sha256")
        if self.phase not in PUBLISHABLE_PHASES:
            allowed = sorted(p.name for p in PUBLISHABLE_PHASES)
            raise RequestInvalid(f"{self.phase!r} cannot be published; expected one of {allowed}", field="phase")
        _check_worker_id(self.prefill_worker, "prefill_worker")
        _check_worker_id(self.decode_worker, "decode_worker")


@dataclass(frozen=True)
class PublishResult:
    """Result of PublishState: the fence after the publish; `already_published` marks an
    idempotent re-publish of the current state."""

    fence: Fence
    already_published: bool
