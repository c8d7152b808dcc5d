"""The pure half of the offload stage: a request's omitted rows, paged.

    plan = offload_plan(manifest, source_k, source_v, positions)

The prefill worker hands the plan to its offload tier (`prefill_worker.offload`); the
evaluations page omitted rows the same way in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kvpolicy.manifest import KVVisibilityPolicyManifest, RecoverabilityMode
from services.offload.pages import (
    OmittedRows,
    PageSummaries,
    gather_omitted,
    summarize_pages,
    with_value_means,
)


@dataclass(frozen=True)
class OffloadPlan:
    """The omitted rows of one request, paged: their summaries and the rows themselves."""

    mode: RecoverabilityMode
    summaries: PageSummaries
    rows: OmittedRows


def offload_plan(
    manifest: KVVisibilityPolicyManifest,
    source_k: torch.Tensor,
    source_v: torch.Tensor,
    positions: Sequence[Sequence[Sequence[int]]],
) -> OffloadPlan | None:
    """Page the rows `positions` omits from `source_k`/`source_v` `[L, H_kv, T, d_h]`:
    summaries (page size from the manifest) and the rows in host memory. None when the
    manifest declares omitted rows irrecoverable."""
    contract = manifest.recoverability
    if not contract.recallable or contract.page_size is None:
        return None
    owner_map = manifest.expanded_owner_map
    summaries = summarize_pages(source_k, positions, contract.page_size, owner_map,
                                code_bits=contract.key_code_bits or 0)
    rows = gather_omitted(source_k, source_v, summaries, owner_map)
    if contract.omitted_value_term:
        summaries = with_value_means(summaries, rows)
    return OffloadPlan(contract.mode, summaries, rows)
