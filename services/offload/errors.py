"""Typed errors of the offload core (page summaries, recall bounds, the store, merges).

They extend `KVPolicyError`, so each names the offending field and the RPC edge maps it
to INVALID_ARGUMENT once. A full store is not an error: `OffloadStore.put` returns a
typed refusal and the caller degrades as the manifest declares.

Two recall outcomes are not contract violations and so are not `OffloadError`s:
`RecallUnavailable` (a fetcher could not bring rows back) and `RecallFailed` (the request
ends because its manifest says `fail_request`); at the RPC edge both mean UNAVAILABLE,
not INVALID_ARGUMENT.
"""

from __future__ import annotations

from services.kvpolicy.errors import KVPolicyError


class OffloadError(KVPolicyError):
    """Base class: a value violates the offload contract. `field` names what is wrong."""


class SummaryInvalid(OffloadError):
    """Page summaries, or the selection and keys they are built from, are inconsistent."""


class PageRefInvalid(OffloadError):
    """A page reference points outside the pages of its (layer, owner)."""


class BoundInputInvalid(OffloadError):
    """Queries, log-sum-exps or thresholds given to the recall bound are malformed."""


class StoreInvalid(OffloadError):
    """The offload store's configuration or a key or payload given to it is malformed."""


class RecallMergeInvalid(OffloadError):
    """Recalled rows cannot be merged: they overlap visible rows or lie outside the frontier."""


class RecallUnavailable(Exception):
    """A page fetcher's answer: the asked rows cannot come back (in time, or at all).

    Not an `OffloadError`: nothing the caller sent is invalid; the offload tier is slow,
    gone, or no longer holds the rows. The recall engine applies the manifest's
    `timeout_fallback`.
    """

    def __init__(self, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


class RecallFailed(Exception):
    """A recall did not complete and the manifest's `timeout_fallback` is `fail_request`."""

    def __init__(self, request_id: str, reason: str, *, timed_out: bool = False) -> None:
        super().__init__(f"recall for request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason
        self.timed_out = timed_out
