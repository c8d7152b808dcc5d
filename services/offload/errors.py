"""Typed errors of the offload core (page summaries, recall bounds, the store, merges).

They extend `KVPolicyError`, so each names the offending field and the RPC edge maps it
to INVALID_ARGUMENT once. A full store is not an error: `OffloadStore.put` returns a
typed refusal and the caller degrades as the manifest declares.
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
