"""In-process page fetchers for `RecallSession` (the `PageFetcher` protocol).

    LocalPageFetcher   recallable_local: pages of the omitted rows that travelled with the view
                       and sit in the decode side's host tier
    StoreFetcher       pages of one request read straight from an `OffloadStore` in this
                       process (evaluation and tests; a served recallable_remote request reads
                       the prefill worker's store over gRPC instead, `decode_worker.recall`)

Both raise `RecallUnavailable` when a page is not there, which makes the session take the
manifest's fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.offload.errors import PageRefInvalid, RecallUnavailable
from services.offload.pages import OmittedRows, PageRef, RecalledPage
from services.offload.store import OffloadStore, StoreKey


class LocalPageFetcher:
    """Pages of the omitted rows that travelled with the view (`recallable_local`)."""

    def __init__(self, rows: OmittedRows) -> None:
        self._rows = rows

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        try:
            return [self._rows.page(ref, f"pages[{i}]") for i, ref in enumerate(refs)]
        except PageRefInvalid as exc:
            raise RecallUnavailable(f"the host tier holds no such page: {exc}") from None


class StoreFetcher:
    """The in-process offload tier: pages of one request from an `OffloadStore`."""

    def __init__(self, store: OffloadStore, key: StoreKey) -> None:
        self.store, self.key = store, key

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        fetched = self.store.fetch(self.key, refs)
        if fetched.missing:
            raise RecallUnavailable(f"the store no longer holds {len(fetched.missing)} pages")
        return fetched.pages
