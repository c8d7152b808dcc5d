"""Typed errors of the KV policy core.

Every validation failure names the offending field (a dotted path such as
`selection.unit` or `tensor.q_to_kv_head_map`) so that the RPC edge can map it to
INVALID_ARGUMENT with a precise message, once.
"""

from __future__ import annotations


class KVPolicyError(ValueError):
    """Base class: a value violates the KV policy contract. `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.reason = message
        super().__init__(f"{field}: {message}")


class ManifestInvalid(KVPolicyError):
    """A policy manifest is malformed or describes an impossible combination."""


class StateInvalid(KVPolicyError):
    """A KVPolicyState snapshot (or a successor transition) violates its invariants."""


class PackingError(KVPolicyError):
    """A packed KV view or its inputs (source tensors, selections) are inconsistent."""


class AllocationError(KVPolicyError):
    """Budgets cannot be allocated as requested (e.g. floors/caps make conservation impossible)."""


class SelectionError(KVPolicyError):
    """Selection inputs (scores, budgets, windows) are inconsistent."""


class ReceiptMismatch(KVPolicyError):
    """A receipt does not match its digest, its manifest, its state or the view it describes."""


# Where a HeadKV manifest names its importance profile.
PROFILE_FIELD = "selection.allocation.headkv_profile_sha256"


class HeadProfileUnavailable(KVPolicyError):
    """A HeadKV manifest names an importance profile (`selection.allocation.headkv_profile_sha256`)
    that the served checkpoint does not carry: no profile beside it, or one with other values.
    The edge maps it to FAILED_PRECONDITION, not INVALID_ARGUMENT: the manifest and the request
    are valid and stay valid; what is missing is the worker's state (the deployed profile), and
    the same request succeeds on a worker that serves the matching profile."""

    def __init__(self, message: str) -> None:
        super().__init__(PROFILE_FIELD, message)
