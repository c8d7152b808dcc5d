"""Byte ledger of a packed view: what is stored, what travels, what peaks, what is read.

Bytes per row are `d_h (b_K + b_V)`. Rows are charged per owner: per K/V head by default,
per query head when the GQA reduction is `expand` (`owners_are_query_heads`). The
transfer of a view moves exactly `traffic_bytes`. Every byte figure is a property of the
counted rows and the counted workspace terms, here and nowhere else (the wire carries the
counts; `services.transfer.codec`).

The transaction peak is the most the compression of one prompt holds at once: the source
cache (the parent image) and the observation's vote throughout, plus the largest of its
stages in order — scoring, allocation, selection, compaction (source and packed view, the
successor, together) and the offload hand-off. The workspace terms are formulas of the
manifest and the prompt length (`services.kvpolicy.workspace`, which documents each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from services.kvpolicy.errors import PackingError, StateInvalid
from services.kvpolicy.manifest import KVVisibilityPolicyManifest, TensorContract
from services.kvpolicy.packing import OFFSET_DTYPE, POSITION_DTYPE
from services.kvpolicy.state import PositionGrid
from services.kvpolicy.workspace import Workspace, transaction_workspace

_GRID_INT_BYTES = 8  # PositionGrid's int64 positions and counts
_POSITION_BYTES = POSITION_DTYPE.itemsize
_OFFSET_BYTES = OFFSET_DTYPE.itemsize


@dataclass(frozen=True)
class Ledger:
    """Row and byte accounting of one request's retained KV view.

    visible_rows: retained rows, one per (layer, owner, position) — the packed R_total.
    unique_kv_rows: distinct (layer, K/V head, position) rows among them; smaller than
        visible_rows only when query-head owners of one K/V head retain the same position.
    query_expanded_rows: rows the query heads read if each K/V row is expanded per reader.
    page_summary_bytes: key summaries of the omitted pages (recallable manifests only),
        which travel with the view as metadata; 0 when omitted rows are irrecoverable.
    host_tier_bytes: omitted rows that travel with the view to the decode worker's host
        tier (`recallable_local`: K, V, positions and page row starts); 0 otherwise.
    code_table_bytes: what the decode worker's codes ranking holds in host memory for the
        request's life when the summaries carry row codes (`PageSummaries.code_table_bytes`:
        an estimated key per omitted row in page slots); not traffic, reserved there beside
        the view; 0 without codes.
    source_rows: rows of the source cache the view is gathered from, L * H_kv * T (the
        parent image; fewer than `full_rows` when owners are query heads).

    Workspace of the compression transaction (bytes; `services.kvpolicy.workspace`; 0 in a
    ledger built without a manifest, `build_ledger`):

    observation_bytes: the observation window's evidence the transaction holds, the runtime's
        vote `[L, H_q, T - W]` fp32 and per-layer extremes, 4 L H_q (T - W) + 8 L with
        W = min(W_obs, T) (the window's rows are not kept); 0 for static policies.
    score_bytes: SnapKV owner scores `[L, H_owner, T - W]` fp32, 4 L H_owner (T - W).
    score_workspace_bytes: the most scoring holds at once besides the vote: the divided
        vote (`mean`), the pooling buffers, the GQA reduction.
    allocator_workspace_bytes: the allocator's tensors besides the scores (Ada-KV,
        ZigZagKV; 0 for the exact-fraction allocators and a prompt within capacity).
    selection_workspace_bytes: the selector's tensors besides the scores: its NaN mask, or
        one owner's k-th-value selection beside the positions chosen before it, or the
        finished position grid beside its parts (`position_grid_bytes` is part of it).
    compaction_workspace_bytes: packing's int64 gather index and its view check,
        17 R + 16 L H_owner.
    """

    bytes_per_row: int
    num_layers: int
    num_owners: int
    owners_are_query_heads: bool
    prompt_rows: int
    visible_rows: int
    unique_kv_rows: int
    query_expanded_rows: int
    source_rows: int
    page_summary_bytes: int = 0
    host_tier_bytes: int = 0
    code_table_bytes: int = 0
    observation_bytes: int = 0
    score_bytes: int = 0
    score_workspace_bytes: int = 0
    allocator_workspace_bytes: int = 0
    selection_workspace_bytes: int = 0
    compaction_workspace_bytes: int = 0

    @property
    def full_rows(self) -> int:
        """L * owners * prompt rows: what a full cache at owner width would hold."""
        return self.num_layers * self.num_owners * self.prompt_rows

    @property
    def full_payload_bytes(self) -> int:
        return self.full_rows * self.bytes_per_row

    @property
    def visible_payload_bytes(self) -> int:
        return self.visible_rows * self.bytes_per_row

    @property
    def omitted_rows(self) -> int:
        return self.full_rows - self.visible_rows

    @property
    def omitted_payload_bytes(self) -> int:
        return self.omitted_rows * self.bytes_per_row

    @property
    def unique_demand_bytes(self) -> int:
        """Bytes of the distinct K/V rows among the retained ones."""
        return self.unique_kv_rows * self.bytes_per_row

    @property
    def query_expanded_demand_bytes(self) -> int:
        """Bytes the query heads read when each K/V row is expanded per reader."""
        return self.query_expanded_rows * self.bytes_per_row

    @property
    def position_map_bytes(self) -> int:
        return self.visible_rows * _POSITION_BYTES

    @property
    def position_grid_bytes(self) -> int:
        """The retained positions as the state holds them (`PositionGrid`: int64 positions
        and int64 counts per owner), 8 R + 8 L H_owner, from selection on."""
        return _GRID_INT_BYTES * (self.visible_rows + self.num_layers * self.num_owners)

    @property
    def offsets_bytes(self) -> int:
        return self.num_layers * (self.num_owners + 1) * _OFFSET_BYTES

    @property
    def metadata_bytes(self) -> int:
        return self.position_map_bytes + self.offsets_bytes + self.page_summary_bytes

    @property
    def traffic_bytes(self) -> int:
        """Bytes a transfer of the view moves: packed K/V plus its metadata (position map,
        offsets and, for recallable manifests, page summaries), plus the omitted rows bound
        for the decode worker's host tier (`recallable_local`)."""
        return self.visible_payload_bytes + self.metadata_bytes + self.host_tier_bytes

    @property
    def source_payload_bytes(self) -> int:
        """The source cache (parent image) K and V, `[L, H_kv, T, d_h]` each."""
        return self.source_rows * self.bytes_per_row

    @property
    def transaction_phases(self) -> dict[str, int]:
        """Bytes held at the peak of each stage of the compression transaction, in order.
        Source cache and the observation's vote are held throughout; the scores from scoring
        until packing ends; the position grid from selection on; the packed view (the
        successor) from compaction on.

            score     S_src + O + score workspace
            allocate  S_src + O + scores + allocator workspace
            select    S_src + O + scores + selection workspace (the grid included)
            pack      S_src + O + scores + grid + view (payload, position map, offsets)
                      + compaction workspace
            offload   S_src + O + grid + view + page summaries + host-tier rows
        """
        held = self.source_payload_bytes + self.observation_bytes
        view = (
            self.visible_payload_bytes + self.position_map_bytes + self.offsets_bytes
            + self.position_grid_bytes
        )
        scored = held + self.score_bytes
        return {
            "score": held + self.score_workspace_bytes,
            "allocate": scored + self.allocator_workspace_bytes,
            "select": scored + self.selection_workspace_bytes,
            "pack": scored + view + self.compaction_workspace_bytes,
            "offload": held + view + self.page_summary_bytes + self.host_tier_bytes,
        }

    @property
    def transaction_peak_bytes(self) -> int:
        """The most any stage of the transaction holds at once (`transaction_phases`)."""
        return max(self.transaction_phases.values())


def build_ledger(
    tensor: TensorContract,
    prompt_len: int,
    selected: Sequence[Sequence[Sequence[int]]],
    owner_to_kv_head: Sequence[int] | None = None,
) -> Ledger:
    """Ledger of `selected[l][h]` over a prompt of `prompt_len` rows.

    Owners are K/V heads unless `owner_to_kv_head` is given (query-head owners, `expand`).
    """
    query_owners = owner_to_kv_head is not None
    num_owners = tensor.num_q_heads if query_owners else tensor.num_kv_heads
    grid = _check_grid(selected, tensor.num_layers, num_owners)
    head_map = tensor.resolved_q_to_kv_head_map()
    readers = torch.tensor([head_map.count(kv) for kv in range(tensor.num_kv_heads)])
    visible = grid.total
    if owner_to_kv_head is not None:
        unique = _unique_kv_rows(grid, owner_to_kv_head)
        expanded = visible
    else:
        unique = visible
        expanded = int((grid.counts * readers[None, :]).sum())
    return Ledger(
        bytes_per_row=tensor.bytes_per_row,
        num_layers=tensor.num_layers,
        num_owners=num_owners,
        owners_are_query_heads=query_owners,
        prompt_rows=prompt_len,
        visible_rows=visible,
        unique_kv_rows=unique,
        query_expanded_rows=expanded,
        source_rows=tensor.num_layers * tensor.num_kv_heads * prompt_len,
    )


def ledger_for(
    manifest: KVVisibilityPolicyManifest,
    prompt_len: int,
    selected: Sequence[Sequence[Sequence[int]]],
) -> Ledger:
    """`build_ledger` with the owner kind the manifest declares, and the workspace of the
    transaction that compressed the prompt into `selected` (`transaction_workspace`)."""
    owner_map = manifest.expanded_owner_map
    ledger = build_ledger(manifest.tensor, prompt_len, selected, owner_map)
    counts = PositionGrid.of(selected).counts.reshape(-1).tolist()
    return with_workspace(ledger, transaction_workspace(manifest, prompt_len, counts))


def with_workspace(ledger: Ledger, workspace: Workspace) -> Ledger:
    """The ledger of a view whose compression held `workspace`."""
    return replace(ledger, **{f.name: getattr(workspace, f.name) for f in fields(workspace)})


def with_page_summaries(
    ledger: Ledger, page_summary_bytes: int, code_table_bytes: int = 0
) -> Ledger:
    """The ledger of a view that also carries `page_summary_bytes` of page summaries, whose
    row codes (if any) the decode worker lays out in `code_table_bytes` of host memory."""
    for name, value in (("page_summary_bytes", page_summary_bytes),
                        ("code_table_bytes", code_table_bytes)):
        if value < 0:
            raise PackingError(name, f"must be non-negative, got {value}")
    return replace(ledger, page_summary_bytes=page_summary_bytes, code_table_bytes=code_table_bytes)


def with_host_tier(ledger: Ledger, host_tier_bytes: int) -> Ledger:
    """The ledger of a view whose omitted rows also travel to the decode worker's host tier."""
    if host_tier_bytes < 0:
        raise PackingError("host_tier_bytes", f"must be non-negative, got {host_tier_bytes}")
    return replace(ledger, host_tier_bytes=host_tier_bytes)


def decode_read_rows(prompt_len: int, decode_steps: int, row_bound: int | None = None) -> int:
    """Cumulative rows read per owner over `decode_steps` steps.

    Step g (0-based) reads the `prompt_len + g` rows cached before it, or at most
    `row_bound` rows when the visible cache is bounded.
    """
    if prompt_len < 0 or decode_steps < 0:
        raise PackingError("decode_steps", "prompt_len and decode_steps must be non-negative")
    if row_bound is None:
        return decode_steps * prompt_len + decode_steps * (decode_steps - 1) // 2
    return sum(min(prompt_len + g, row_bound) for g in range(decode_steps))


def _check_grid(
    selected: PositionGrid | Sequence[Sequence[Sequence[int]]], num_layers: int, num_owners: int
) -> PositionGrid:
    try:
        grid = PositionGrid.of(selected)
    except StateInvalid as error:
        raise PackingError("selected", error.reason) from error
    if (grid.num_layers, grid.num_owners) != (num_layers, num_owners):
        raise PackingError("selected", f"expected [{num_layers}][{num_owners}] owners")
    return grid


def _unique_kv_rows(grid: PositionGrid, owner_to_kv_head: Sequence[int]) -> int:
    """Distinct (layer, K/V head, position) rows among query-head owners' positions: each
    K/V head's readers mark their positions in one mask over the positions (a bool per
    position, reused), instead of a sorted union of their rows."""
    if grid.total == 0:
        return 0
    seen = torch.zeros(int(grid.flat.max()) + 1, dtype=torch.bool)
    readers: dict[int, list[int]] = {}
    for owner, kv_head in enumerate(owner_to_kv_head):
        readers.setdefault(kv_head, []).append(owner)
    total = 0
    for layer in range(grid.num_layers):
        for owners in readers.values():
            seen.zero_()
            for owner in owners:
                seen[grid.owner(layer, owner)] = True
            total += int(seen.count_nonzero())
    return total
