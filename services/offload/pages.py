"""Pages of omitted KV rows: their summaries (for the decode worker) and their rows (for the store).

For every (layer, owner) the omitted positions are the complement of the retained set in
the prompt `[0, T)`. They are cut into pages: each run of contiguous omitted positions is
split, from its start, into chunks of at most `page_size` positions. A page is summarized
by the elementwise min and max of its keys (Quest's page metadata), its first position and
its row count; optionally (`code_bits` 1, 2 or 4) every omitted row also gets a few-bit code
of each key coordinate inside its page's min/max box, so the decode worker can estimate
each omitted row's logit (`row_estimates`) instead of only bounding a page's; and, with
the codes, every page may carry its mean value row (`page_value_mean`), so the decode worker
can add what the omitted rows would bring to attention without fetching them
(services/offload/bound.py, `omitted_value_term`). `PageSummaries` travels with the packed
view as metadata; `OmittedRows` holds the omitted K/V rows page after page in the same order
and goes to the offload store, so that a `PageRef` finds both a page's bound and its rows.

Owners are K/V heads, or query heads under the GQA reduction `expand` (then each owner's
rows come from the K/V head `owner_to_kv_head[owner]`), exactly as in packing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import torch

from services.offload import codes_kernel
from services.offload.errors import PageRefInvalid, SummaryInvalid

# Integer metadata dtype of pages (first position, count, offsets, row starts): part of the
# wire contract and of the byte ledger, like the packed view's position map.
PAGE_INDEX_DTYPE = torch.int32

Selection = Sequence[Sequence[Sequence[int]]]  # [L][H_owner] -> ascending retained positions


@dataclass(frozen=True)
class PageRef:
    """One page of one (layer, owner); `page_index` counts that owner's pages from 0."""

    layer: int
    owner: int
    page_index: int


@dataclass(frozen=True)
class PageSummaries:
    """Key summaries of every omitted page, flat over all (layer, owner) segments.

    Pages of owner h in layer l are the global indices `page_offsets[l, h]` to
    `page_offsets[l, h + 1]`, ascending by position and never overlapping. Page p covers
    the positions `page_first[p] .. page_first[p] + page_count[p] - 1`, all omitted.
    Summaries are metadata and live in host memory. Construction validates the whole
    object (see `validate_summaries`).
    """

    page_size: int
    page_min: torch.Tensor  # [P_total, d_h] key dtype, elementwise min of the page's keys
    page_max: torch.Tensor  # [P_total, d_h] key dtype, elementwise max
    page_first: torch.Tensor  # [P_total] int32, first position of the page
    page_count: torch.Tensor  # [P_total] int32, rows in the page, 1..page_size
    page_offsets: torch.Tensor  # [L, H_owner + 1] int32, global, monotonic, last == P_total
    # Row codes (0: none). Row n of page p (rows page after page, as `rows()`), coordinate i:
    # c = round((k_i - min_i) / (max_i - min_i) * (2^b - 1)) (0 where min_i == max_i), packed
    # little-endian, 8 / b coordinates a byte: [N, d_h * b / 8] uint8.
    code_bits: int = 0
    row_codes: torch.Tensor | None = None
    # Mean value row of every page, taken in float32 and stored in the value dtype (None: not
    # carried; only with row codes, which estimate how much attention the page would take).
    page_value_mean: torch.Tensor | None = None  # [P_total, d_h]

    def __post_init__(self) -> None:
        validate_summaries(self)

    @property
    def num_pages(self) -> int:
        return int(self.page_first.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.page_offsets.shape[0])

    @property
    def num_owners(self) -> int:
        return int(self.page_offsets.shape[1]) - 1

    @property
    def head_dim(self) -> int:
        return int(self.page_min.shape[1])

    @property
    def omitted_rows(self) -> int:
        return int(self.page_count.sum())

    @property
    def nbytes(self) -> int:
        """Bytes of the summaries as they travel: min, max, first, count and offsets, and
        the row codes and page value means when carried."""
        tensors = (self.page_min, self.page_max, self.page_first, self.page_count, self.page_offsets)
        extra = tuple(t for t in (self.row_codes, self.page_value_mean) if t is not None)
        return sum(_nbytes(t) for t in (*tensors, *extra))

    @cached_property
    def code_table(self) -> CodeTable:
        """The row codes laid out for scoring (`CodeTable`), built once per summaries
        object, for ranking only (never a bound)."""
        if self.row_codes is None:
            raise SummaryInvalid("row_codes", "these summaries carry no row codes (code_bits 0)")
        return _code_table(self)

    @cached_property
    def page_sketch(self) -> PageSketch:
        """The codes table's page sketch (`PageSketch`), built once per summaries object on
        first use, for ranking only."""
        return _page_sketch(self)

    @property
    def code_table_bytes(self) -> int:
        """Bytes `code_table` (and `value_grid`, with value means) hold (0 without row
        codes), from the page layout alone, so the ledger can charge them before any table is
        built: a bfloat16 coordinate and a float32 mask per slot, page_size slots a page, and
        d_h bfloat16 values a page with value means, every (layer, owner) as long as the
        longest. Not the page sketch (`page_sketch`): no served strategy builds it."""
        if self.row_codes is None:
            return 0
        per_segment = self.page_offsets[:, 1:] - self.page_offsets[:, :-1]  # [L, H_owner]
        longest = int(per_segment.max()) if per_segment.numel() else 0
        pages = per_segment.numel() * longest
        values = pages * self.head_dim * 2 if self.page_value_mean is not None else 0
        return pages * self.page_size * (self.head_dim * 2 + 4) + values

    @cached_property
    def value_grid(self) -> torch.Tensor:
        """The page value means laid out like `code_table`'s pages: owner segment s's pages
        in order, every segment padded to the longest (zeros), so one batched product weighs
        them with the pages' estimated masses.  # [S, longest, d_h] bfloat16"""
        means = self.page_value_mean
        if means is None:
            raise SummaryInvalid("page_value_mean", "these summaries carry no page value means")
        return _page_grid(self, means)

    @property
    def row_estimates(self) -> torch.Tensor:
        """Every paged row's key as its code places it in its page's box, page after page (as
        `rows()`): the rows of `code_table`, gathered (a copy).  # [N, d_h] bfloat16"""
        table = self.code_table
        rows = table.coordinates_first().mT.reshape(-1, self.head_dim)  # [S * slots, d_h]
        return rows.index_select(0, table.row_slot)

    @cached_property
    def row_page(self) -> torch.Tensor:
        """Flat page index of every paged row, page after page.  # [N] int64"""
        return torch.repeat_interleave(torch.arange(self.num_pages), self.page_count.long())

    @cached_property
    def page_segment(self) -> torch.Tensor:
        """Flat owner index `layer * H_owner + owner` of every page.  # [P_total] int64"""
        return _segment_of_pages(self.page_offsets)

    @cached_property
    def bound_extents(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 min, max and max(|min|, |max|) of every page, what the recall bound
        reads (min and max are the summaries' own tensors when keys are float32: only the
        reach is new, computed once).  # 3 x [P_total, d_h]"""
        low, high = self.page_min.float(), self.page_max.float()
        return low, high, torch.maximum(low.abs(), high.abs())

    @cached_property
    def layer_ranges(self) -> list[tuple[int, int]]:
        """Per layer, the `[start, end)` of its pages in the flat order."""
        return [(row[0], row[-1]) for row in self._offsets]

    @cached_property
    def _offsets(self) -> list[list[int]]:
        return [[int(x) for x in row] for row in self.page_offsets.tolist()]

    def global_index(self, ref: PageRef, field: str = "page") -> int:
        """The flat page index of `ref`; PageRefInvalid if it names no page."""
        return _global_index(self._offsets, ref, field)

    def page_ref(self, index: int) -> PageRef:
        """The (layer, owner, page_index) of flat page `index`."""
        if not 0 <= index < self.num_pages:
            raise PageRefInvalid("page", f"index {index} outside [0, {self.num_pages})")
        segment = int(self.page_segment[index])
        layer, owner = divmod(segment, self.num_owners)
        return PageRef(layer, owner, index - self._offsets[layer][owner])

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat owner index and position of every paged row, page after page.  # [N], [N]"""
        count = self.page_count.long()  # [P_total]
        segment = torch.repeat_interleave(self.page_segment, count)
        return segment, _expand_runs(self.page_first.long(), count)


@dataclass(frozen=True)
class CodeTable:
    """The row codes of one summaries object as the codes ranking reads them each evaluated
    step: owner segment s's pages in order, page after page, each in `page_size` slots, every
    segment padded to the longest one, so one batched product scores every row and a page is
    a contiguous run of slots (its log-sum-exp a dense reduction, not a scatter). Stored in
    blocks of `block` slots (whole pages), each block coordinates-first `[d_h, block]` and
    contiguous, `[S, d_h * slots]` in all: `codes_kernel` scores a block's slots for every
    reading head in one pass (4.9 ms for a 44 MB table against 8-14 ms for torch's bfloat16
    product over `[S, d_h, slots]` and its reductions), and a page's coordinate is still a run of
    `page_size` slots.

    Keys as their codes place them: k^ = min + c (max - min) / (2^b - 1) per coordinate, in
    bfloat16, because scoring reads the whole table and is bound by memory (a float32 table
    took 3.6x as long at 4K). Host memory: 2 d_h + 4 bytes a slot (`nbytes`, equal to
    `PageSummaries.code_table_bytes`, which the ledger charges and the decode worker
    reserves); padding is the partial pages and the segments shorter than the longest (7%
    at 4K and 10%, 21% at 25%, SmolLM2).
    """

    estimates: torch.Tensor  # [S, d_h * slots] bfloat16 in blocks (`block`), zeros in unused slots
    slot_bias: torch.Tensor  # [S, slots] float32, 0 for a row, -inf for an unused slot
    page_slot: torch.Tensor  # [P_total] int64, page p's index in the [S * slots / page_size] grid
    row_slot: torch.Tensor  # [N] int64, row n's index in the flat [S * slots] slots
    block: int  # slots a block holds (whole pages; the last block of a segment may be shorter)
    # (`codes_kernel.table_block`: one block of every slot where the kernel is not built)

    @property
    def nbytes(self) -> int:
        """Host bytes the table holds for the session's life (estimates and slot bias)."""
        return _nbytes(self.estimates) + _nbytes(self.slot_bias)

    @property
    def head_dim(self) -> int:
        slots = self.slot_bias.shape[1]
        return self.estimates.shape[1] // slots if slots else 0

    def coordinates_first(self) -> torch.Tensor:
        """The estimates as `[S, d_h, slots]` (a copy).  # bfloat16"""
        return codes_kernel.from_blocks(self.estimates, self.head_dim, self.block)


@dataclass(frozen=True)
class PageSketch:
    """The page sketch of a codes table: per page (the table's page grid), the mean of its
    rows' estimates and their variance per coordinate, what `bound.sketch_page_scores` scores
    every page by at an eighth of a slot's reads, so only the best-sketched pages are scored
    row by row (`RecallStrategy.sketch_candidates`). 4 d_h bytes a page of the grid (+27% on
    the table at 4K and 10%); built only by a session whose strategy reads it, never by the
    served strategies, and so not in `PageSummaries.code_table_bytes`."""

    mean: torch.Tensor  # [S, d_h, slots / page_size] bfloat16, zeros for unused pages
    variance: torch.Tensor  # [S, d_h, slots / page_size] bfloat16, zeros for unused pages

    @property
    def nbytes(self) -> int:
        return _nbytes(self.mean) + _nbytes(self.variance)


@dataclass(frozen=True)
class RecalledPage:
    """The omitted rows of one page, as the store hands them back."""

    ref: PageRef
    positions: torch.Tensor  # [n] int32, ascending
    k: torch.Tensor  # [n, d_h]
    v: torch.Tensor  # [n, d_h]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.k) + _nbytes(self.v) + _nbytes(self.positions)


@dataclass(frozen=True)
class OmittedRows:
    """The omitted K/V rows of one request in host memory, page after page in summary order.

    Rows of flat page p are `page_rows[p]` to `page_rows[p + 1]`; `page_offsets` is the
    summaries' `[L, H_owner + 1]` so a `PageRef` resolves without them.
    """

    k: torch.Tensor  # [N_omitted, d_h]
    v: torch.Tensor  # [N_omitted, d_h]
    positions: torch.Tensor  # [N_omitted] int32
    page_rows: torch.Tensor  # [P_total + 1] int32, 0 first, N_omitted last
    page_offsets: torch.Tensor  # [L, H_owner + 1] int32

    def __post_init__(self) -> None:
        _check_omitted_rows(self)

    @property
    def num_rows(self) -> int:
        return int(self.k.shape[0])

    @property
    def nbytes(self) -> int:
        """Host bytes the store charges for these rows: K, V, positions and both layouts."""
        tensors = (self.k, self.v, self.positions, self.page_rows, self.page_offsets)
        return sum(_nbytes(t) for t in tensors)

    @cached_property
    def _offsets(self) -> list[list[int]]:
        return [[int(x) for x in row] for row in self.page_offsets.tolist()]

    def page(self, ref: PageRef, field: str = "page") -> RecalledPage:
        """A copy of the rows of page `ref` (copies, so no caller can edit stored rows)."""
        index = _global_index(self._offsets, ref, field)
        rows = slice(int(self.page_rows[index]), int(self.page_rows[index + 1]))
        return RecalledPage(
            ref=ref,
            positions=self.positions[rows].clone(),
            k=self.k[rows].clone(),
            v=self.v[rows].clone(),
        )


def summarize_pages(
    source_k: torch.Tensor,
    selected: Selection,
    page_size: int,
    owner_to_kv_head: Sequence[int] | None = None,
    code_bits: int = 0,
) -> PageSummaries:
    """Summaries of the pages `selected` omits from `source_k` `[L, H_kv, T, d_h]`.

    `selected[l][h]` lists owner h's retained positions in layer l, strictly ascending in
    `[0, T)`. Min and max are exact (taken in float32, stored back in the key dtype); with
    `code_bits`, each row's codes are taken against the stored (rounded) min and max.
    """
    num_layers, num_kv_heads, seq_len, head_dim = _check_source(source_k, "source_k")
    owners = _owner_map(owner_to_kv_head, num_kv_heads)
    if page_size < 1:
        raise SummaryInvalid("page_size", f"must be positive, got {page_size}")
    omitted = _omitted_mask(selected, num_layers, len(owners), seq_len)  # [L * H_owner, T]
    segment, position = torch.nonzero(omitted, as_tuple=True)  # [N] each, row-major order
    page_start = _page_starts(segment, position, page_size)  # [N] bool
    page_id = torch.cumsum(page_start.long(), 0) - 1  # [N]
    num_pages = int(page_start.sum())
    index = _source_rows(segment, position, owners, num_kv_heads, seq_len)
    rows = source_k.reshape(-1, head_dim)[index.to(source_k.device)].float().cpu()  # [N, d_h]
    page_index = page_id[:, None].expand(-1, head_dim)
    empty = torch.zeros(num_pages, head_dim, dtype=torch.float32)
    page_min = empty.scatter_reduce(0, page_index, rows, "amin", include_self=False)
    page_max = empty.scatter_reduce(0, page_index, rows, "amax", include_self=False)
    pages_per_owner = torch.bincount(segment[page_start], minlength=num_layers * len(owners))
    page_min, page_max = page_min.to(source_k.dtype), page_max.to(source_k.dtype)
    codes = None
    if code_bits:
        _check_code_bits(code_bits, head_dim)
        codes = encode_codes(rows, page_min.float()[page_id], page_max.float()[page_id], code_bits)
    return PageSummaries(
        page_size=page_size,
        page_min=page_min,
        page_max=page_max,
        page_first=position[page_start].to(PAGE_INDEX_DTYPE),
        page_count=torch.bincount(page_id, minlength=num_pages).to(PAGE_INDEX_DTYPE),
        page_offsets=offsets_from_counts(pages_per_owner, num_layers, len(owners)),
        code_bits=code_bits,
        row_codes=codes,
    )


CODE_BITS = (1, 2, 4)  # coordinates a byte: 8, 4, 2


def encode_codes(rows: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed `bits`-bit codes of `rows` `[N, d_h]` inside their boxes `low`..`high` (each
    `[N, d_h]` float32).  # [N, d_h * bits / 8] uint8"""
    levels = 2**bits - 1
    width = high - low
    scaled = torch.where(width > 0, (rows.float() - low) / torch.where(width > 0, width, 1.0), 0.0)
    codes = torch.round(scaled * levels).clamp_(0, levels).to(torch.uint8)  # [N, d_h]
    per_byte = 8 // bits
    shifts = (torch.arange(per_byte, dtype=torch.uint8) * bits)  # [per_byte]
    grouped = codes.view(codes.shape[0], -1, per_byte)  # [N, d_h / per_byte, per_byte]
    return (grouped << shifts).sum(dim=2, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """The codes `encode_codes` packed.  # [N, d_h] uint8"""
    per_byte = 8 // bits
    shifts = (torch.arange(per_byte, dtype=torch.uint8) * bits)
    mask = 2**bits - 1
    return ((packed[:, :, None] >> shifts) & mask).reshape(packed.shape[0], head_dim)


def _check_code_bits(bits: int, head_dim: int) -> None:
    if isinstance(bits, bool) or bits not in CODE_BITS:
        raise SummaryInvalid("code_bits", f"must be one of {CODE_BITS} (or 0: no codes), got {bits!r}")
    if head_dim * bits % 8:
        raise SummaryInvalid("code_bits", f"{bits}-bit codes of d_h = {head_dim} do not fill whole bytes")


def gather_omitted(
    source_k: torch.Tensor,
    source_v: torch.Tensor,
    summaries: PageSummaries,
    owner_to_kv_head: Sequence[int] | None = None,
) -> OmittedRows:
    """The omitted rows of `source_k`/`source_v` `[L, H_kv, T, d_h]`, paged like `summaries`."""
    shape = _check_source(source_k, "source_k")
    if tuple(source_v.shape) != tuple(source_k.shape):
        raise SummaryInvalid("source_v", f"shape {tuple(source_v.shape)} != source_k {shape}")
    num_layers, num_kv_heads, seq_len, head_dim = shape
    owners = _owner_map(owner_to_kv_head, num_kv_heads)
    expected = (num_layers, len(owners), head_dim)
    actual = (summaries.num_layers, summaries.num_owners, summaries.head_dim)
    if actual != expected:
        raise SummaryInvalid("summaries", f"[L, H_owner, d_h] = {actual}, source has {expected}")
    validate_summaries(summaries, frontier=seq_len)
    segment, position = summaries.rows()  # [N] each
    index = _source_rows(segment, position, owners, num_kv_heads, seq_len).to(source_k.device)
    page_ends = torch.cumsum(summaries.page_count.long(), 0)  # [P_total]
    return OmittedRows(
        k=source_k.reshape(-1, head_dim)[index].cpu(),
        v=source_v.reshape(-1, head_dim)[index].cpu(),
        positions=position.to(PAGE_INDEX_DTYPE),
        page_rows=torch.cat([torch.zeros(1, dtype=torch.long), page_ends]).to(PAGE_INDEX_DTYPE),
        page_offsets=summaries.page_offsets.clone(),
    )


def page_value_means(values: torch.Tensor, page_count: torch.Tensor) -> torch.Tensor:
    """The mean value row of every page from its rows `values` `[N, d_h]` (page after page,
    `page_count[p]` rows of page p), taken in float32, stored in the values' dtype; what the
    prefill worker ships and what verify and recall recompute.  # [P_total, d_h]"""
    count = page_count.long()
    page = torch.repeat_interleave(torch.arange(count.numel()), count)
    sums = torch.zeros(count.numel(), values.shape[1]).index_add_(0, page, values.float())
    return sums.div_(count.clamp(min=1)[:, None].float()).to(values.dtype)


def with_value_means(summaries: PageSummaries, rows: OmittedRows) -> PageSummaries:
    """`summaries` carrying the mean value row of every page of `rows` (paged like them)."""
    return replace(summaries, page_value_mean=page_value_means(rows.v, summaries.page_count))


def value_mean_matches(expected: torch.Tensor, values: torch.Tensor, count: torch.Tensor) -> bool:
    """Whether `expected` `[P, d_h]` is the mean of the pages' rows `values`: equal within
    two units of the value dtype's rounding of the largest row magnitude (the prefill worker
    may sum on another device, in another order), far below what one shifted or edited row
    moves (a row's whole value over the page's count)."""
    got = page_value_means(values, count).float()
    if tuple(got.shape) != tuple(expected.shape):
        return False
    page = torch.repeat_interleave(torch.arange(count.numel()), count.long())
    reach = torch.zeros(count.numel()).scatter_reduce_(0, page, values.float().abs().amax(dim=1),
                                                       "amax", include_self=False)
    allowed = reach * 2 * torch.finfo(values.dtype).eps + torch.finfo(torch.float32).tiny
    return bool(((got - expected.float()).abs().amax(dim=1) <= allowed).all())


def validate_summaries(summaries: PageSummaries, *, frontier: int | None = None) -> None:
    """Check the summaries' internal consistency; raises SummaryInvalid naming the field.

    Every tensor is in host memory. Min and max are 2-D of one shape and dtype with
    min <= max everywhere; first
    and count are int32 with one entry per page; counts lie in `[1, page_size]`; offsets
    are `[L, H + 1]` int32, start at 0, are monotonic, contiguous across layers and end at
    P_total; pages of one owner ascend without overlapping. `frontier`, when given, bounds
    every covered position from above (exclusive).
    """
    if isinstance(summaries.page_size, bool) or summaries.page_size < 1:
        raise SummaryInvalid("page_size", f"must be a positive int, got {summaries.page_size!r}")
    _check_host(summaries, ("page_min", "page_max", "page_first", "page_count", "page_offsets"))
    num_pages = _check_min_max(summaries.page_min, summaries.page_max)
    for name in ("page_first", "page_count"):
        _check_index_vector(getattr(summaries, name), name, num_pages)
    _check_offsets(summaries.page_offsets, num_pages, "page_offsets")
    count = summaries.page_count.long()
    if num_pages and (int(count.min()) < 1 or int(count.max()) > summaries.page_size):
        raise SummaryInvalid(
            "page_count", f"counts must lie in [1, page_size = {summaries.page_size}]"
        )
    first = summaries.page_first.long()
    if num_pages and int(first.min()) < 0:
        raise SummaryInvalid("page_first", f"negative position {int(first.min())}")
    _check_pages_ascending(first, count, summaries.page_offsets)
    _check_row_codes(summaries, int(count.sum()) if num_pages else 0)
    _check_value_means(summaries, num_pages)
    if frontier is not None and num_pages and int((first + count).max()) > frontier:
        raise SummaryInvalid(
            "page_first", f"a page reaches position {int((first + count).max()) - 1} >= {frontier}"
        )


def validate_against_view(
    summaries: PageSummaries, retained_positions: Selection, frontier: int
) -> None:
    """Check that the pages and the retained rows partition `[0, frontier)` for every owner.

    `retained_positions[l][h]` is the packed view's (or the state's) visible set. Every
    position below the frontier must be retained or inside exactly one page, never both.
    """
    validate_summaries(summaries, frontier=frontier)
    owners = summaries.num_owners
    omitted = _omitted_mask(retained_positions, summaries.num_layers, owners, frontier)
    covered = omitted.logical_not().flatten().long()  # [L * H_owner * T], 1 where retained
    segment, position = summaries.rows()
    covered += torch.bincount(segment * frontier + position, minlength=covered.numel())
    if bool((covered != 1).any()):
        flat = int(torch.nonzero(covered != 1)[0, 0])
        layer, owner = divmod(flat // frontier, owners)
        kind = "neither retained nor paged" if int(covered[flat]) == 0 else "retained and paged"
        raise SummaryInvalid(f"pages[{layer}][{owner}]", f"position {flat % frontier} is {kind}")


def _check_row_codes(summaries: PageSummaries, rows: int) -> None:
    bits, codes = summaries.code_bits, summaries.row_codes
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise SummaryInvalid("code_bits", f"must be an int, got {bits!r}")
    if bits == 0:
        if codes is not None:
            raise SummaryInvalid("row_codes", "given with code_bits 0")
        return
    _check_code_bits(bits, summaries.head_dim)
    if codes is None:
        raise SummaryInvalid("row_codes", f"missing: code_bits is {bits}")
    _check_host(summaries, ("row_codes",))
    expected = (rows, summaries.head_dim * bits // 8)
    if codes.dtype != torch.uint8 or tuple(codes.shape) != expected:
        raise SummaryInvalid("row_codes", f"expected {list(expected)} uint8, got "
                             f"{list(codes.shape)} {codes.dtype}")


def _check_value_means(summaries: PageSummaries, num_pages: int) -> None:
    means = summaries.page_value_mean
    if means is None:
        return
    if summaries.row_codes is None:
        raise SummaryInvalid("page_value_mean", "only carried with row codes (code_bits > 0)")
    _check_host(summaries, ("page_value_mean",))
    expected = (num_pages, summaries.head_dim)
    if tuple(means.shape) != expected or not means.dtype.is_floating_point:
        raise SummaryInvalid("page_value_mean", f"expected {list(expected)} float, got "
                             f"{list(means.shape)} {means.dtype}")
    if not bool(torch.isfinite(means).all()):
        raise SummaryInvalid("page_value_mean", "must hold finite values")


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel() * tensor.element_size())


def _check_source(source: torch.Tensor, field: str) -> tuple[int, int, int, int]:
    if source.dim() != 4 or min(source.shape) < 1:
        raise SummaryInvalid(
            field, f"expected [L, H_kv, T, d_h] non-empty, got {tuple(source.shape)}"
        )
    num_layers, num_kv_heads, seq_len, head_dim = (int(x) for x in source.shape)
    return num_layers, num_kv_heads, seq_len, head_dim


def _owner_map(owner_to_kv_head: Sequence[int] | None, num_kv_heads: int) -> list[int]:
    owners = list(range(num_kv_heads)) if owner_to_kv_head is None else list(owner_to_kv_head)
    if not owners:
        raise SummaryInvalid("owner_to_kv_head", "no owners")
    for owner, kv in enumerate(owners):
        if isinstance(kv, bool) or not isinstance(kv, int) or not 0 <= kv < num_kv_heads:
            raise SummaryInvalid(
                "owner_to_kv_head", f"owner {owner} maps to {kv!r}, need [0, {num_kv_heads})"
            )
    return owners


def _omitted_mask(
    selected: Selection, num_layers: int, num_owners: int, seq_len: int
) -> torch.Tensor:
    """True where (layer * H_owner + owner, position) is not retained.  # [L * H_owner, T] bool"""
    if len(selected) != num_layers or any(len(owners) != num_owners for owners in selected):
        raise SummaryInvalid("selected", f"expected [{num_layers}][{num_owners}] position lists")
    mask = torch.ones(num_layers * num_owners, seq_len, dtype=torch.bool)
    for layer, owners in enumerate(selected):
        for owner, positions in enumerate(owners):
            field = f"selected[{layer}][{owner}]"
            kept = _ascending_positions(positions, seq_len, field)
            mask[layer * num_owners + owner, kept] = False
    return mask


def _ascending_positions(positions: Sequence[int], seq_len: int, field: str) -> torch.Tensor:
    values = list(positions)
    if any(isinstance(p, bool) or not isinstance(p, int) for p in values):
        raise SummaryInvalid(field, "positions must be ints")
    kept = torch.tensor(values, dtype=torch.long)  # [R_lh]
    if values and (values[0] < 0 or values[-1] >= seq_len):
        raise SummaryInvalid(field, f"positions must lie in [0, {seq_len})")
    if bool((kept[1:] <= kept[:-1]).any()):
        raise SummaryInvalid(field, "positions must be strictly ascending")
    return kept


def _page_starts(segment: torch.Tensor, position: torch.Tensor, page_size: int) -> torch.Tensor:
    """True at the first omitted row of every page.  # [N] bool

    A run starts where the owner changes or the position is not the previous one + 1;
    inside a run a page starts every `page_size` rows.
    """
    if segment.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    run_start = torch.ones_like(segment, dtype=torch.bool)
    run_start[1:] = (segment[1:] != segment[:-1]) | (position[1:] != position[:-1] + 1)
    run_first_row = torch.nonzero(run_start)[:, 0][torch.cumsum(run_start.long(), 0) - 1]
    row_in_run = torch.arange(segment.numel()) - run_first_row  # [N]
    return row_in_run % page_size == 0


def _source_rows(
    segment: torch.Tensor,
    position: torch.Tensor,
    owners: list[int],
    num_kv_heads: int,
    seq_len: int,
) -> torch.Tensor:
    """Row of `(layer, owner, position)` in the source reshaped to `[L * H_kv * T, d_h]`.  # [N]"""
    layer, owner = segment // len(owners), segment % len(owners)
    kv_head = torch.tensor(owners, dtype=torch.long)[owner]
    return (layer * num_kv_heads + kv_head) * seq_len + position


def _code_table(summaries: PageSummaries) -> CodeTable:
    segments = summaries.num_layers * summaries.num_owners
    size, dim = summaries.page_size, summaries.head_dim
    count = summaries.page_count.long()  # [P]
    page = summaries.row_page  # [N]
    first_page = summaries.page_offsets[:, :-1].flatten().long()  # [S]
    per_segment = torch.bincount(summaries.page_segment, minlength=segments)  # [S]
    longest = int(per_segment.max()) if per_segment.numel() else 0
    segment = summaries.page_segment  # [P]
    page_slot = segment * longest + torch.arange(summaries.num_pages) - first_page[segment]
    within = torch.arange(page.numel()) - (torch.cumsum(count, 0) - count)[page]  # [N]
    row_slot = page_slot[page] * size + within
    low, high = (t.float().index_select(0, page) for t in (summaries.page_min, summaries.page_max))
    assert summaries.row_codes is not None
    levels = float(2**summaries.code_bits - 1)
    codes = unpack_codes(summaries.row_codes, summaries.code_bits, dim).float()
    rows = low.add_(codes.mul_(high.sub_(low).div_(levels))).to(torch.bfloat16)  # [N, d_h]
    slots = longest * size
    estimates = torch.zeros(segments * slots, dim, dtype=torch.bfloat16)
    estimates.index_copy_(0, row_slot, rows)
    bias = torch.full((segments * slots,), -math.inf).index_fill_(0, row_slot, 0.0)
    block = codes_kernel.table_block(size, slots)
    blocked = codes_kernel.to_blocks(estimates.view(segments, slots, dim).mT, block)
    return CodeTable(blocked, bias.view(segments, slots), page_slot, row_slot, block)


def _page_sketch(summaries: PageSummaries) -> PageSketch:
    mean, variance = _page_moments(summaries.row_estimates.float(), summaries.row_page,
                                   summaries.page_count.long())
    return PageSketch(*(_page_grid(summaries, t).mT.contiguous() for t in (mean, variance)))


def _page_grid(summaries: PageSummaries, per_page: torch.Tensor) -> torch.Tensor:
    """One row a page `[P, d_h]` laid out like `code_table`'s pages: owner segment s's pages
    in order, every segment padded to the longest (zeros).  # [S, longest, d_h] bfloat16"""
    table = summaries.code_table
    segments = summaries.num_layers * summaries.num_owners
    longest = int(table.slot_bias.shape[1]) // summaries.page_size
    grid = torch.zeros(segments * longest, summaries.head_dim, dtype=torch.bfloat16)
    grid.index_copy_(0, table.page_slot, per_page.to(torch.bfloat16))
    return grid.view(segments, longest, summaries.head_dim)


def _page_moments(rows: torch.Tensor, page: torch.Tensor,
                  count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and per-coordinate (population) variance of each page's rows `[N, d_h]` (`page`:
    each row's page, `count`: rows a page).  # [P, d_h], [P, d_h] float32"""
    n = count.clamp(min=1).to(rows.dtype)[:, None]
    mean = torch.zeros(count.numel(), rows.shape[1]).index_add_(0, page, rows) / n
    spread = (rows - mean.index_select(0, page)).square_()
    return mean, torch.zeros_like(mean).index_add_(0, page, spread) / n


def _expand_runs(first: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """`first[i], ..., first[i] + count[i] - 1` for every i, concatenated.  # [sum(count)]"""
    starts = torch.repeat_interleave(first, count)
    row_starts = torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
    return starts + torch.arange(starts.numel()) - row_starts


def offsets_from_counts(counts: torch.Tensor, num_layers: int, num_owners: int) -> torch.Tensor:
    """Global `[L, H + 1]` offsets from per-owner counts `[L * H]`."""
    ends = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(counts.long(), 0)])
    index = torch.arange(num_layers)[:, None] * num_owners + torch.arange(num_owners + 1)[None, :]
    return ends[index].to(PAGE_INDEX_DTYPE)


def _segment_of_pages(page_offsets: torch.Tensor) -> torch.Tensor:
    counts = (page_offsets[:, 1:] - page_offsets[:, :-1]).flatten().long()  # [L * H]
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)


def _global_index(offsets: list[list[int]], ref: PageRef, field: str) -> int:
    if not 0 <= ref.layer < len(offsets):
        raise PageRefInvalid(f"{field}.layer", f"{ref.layer} outside [0, {len(offsets)})")
    row = offsets[ref.layer]
    if not 0 <= ref.owner < len(row) - 1:
        raise PageRefInvalid(f"{field}.owner", f"{ref.owner} outside [0, {len(row) - 1})")
    pages = row[ref.owner + 1] - row[ref.owner]
    if not 0 <= ref.page_index < pages:
        raise PageRefInvalid(
            f"{field}.page_index",
            f"{ref.page_index} outside [0, {pages}) for layer {ref.layer} owner {ref.owner}",
        )
    return row[ref.owner] + ref.page_index


def _check_min_max(page_min: torch.Tensor, page_max: torch.Tensor) -> int:
    if page_min.dim() != 2 or page_min.shape[1] < 1:
        raise SummaryInvalid("page_min", f"expected [P_total, d_h], got {tuple(page_min.shape)}")
    if not page_min.dtype.is_floating_point:
        raise SummaryInvalid("page_min", f"dtype {page_min.dtype} is not a float dtype")
    if page_max.shape != page_min.shape or page_max.dtype != page_min.dtype:
        raise SummaryInvalid(
            "page_max", f"{tuple(page_max.shape)} {page_max.dtype} differs from page_min"
        )
    if not bool((page_min.float() <= page_max.float()).all()):
        raise SummaryInvalid("page_max", "page_min exceeds page_max (or either is NaN)")
    return int(page_min.shape[0])


def _check_index_vector(values: torch.Tensor, field: str, num_pages: int) -> None:
    if values.dtype != PAGE_INDEX_DTYPE or values.dim() != 1 or values.shape[0] != num_pages:
        raise SummaryInvalid(
            field,
            f"expected [{num_pages}] {PAGE_INDEX_DTYPE}, got {tuple(values.shape)} {values.dtype}",
        )


def _check_offsets(offsets: torch.Tensor, total: int, field: str) -> None:
    if offsets.dtype != PAGE_INDEX_DTYPE or offsets.dim() != 2 or offsets.shape[1] < 2:
        raise SummaryInvalid(
            field, f"expected [L, H + 1 >= 2] {PAGE_INDEX_DTYPE}, got {tuple(offsets.shape)}"
        )
    if offsets.shape[0] < 1:
        raise SummaryInvalid(field, "needs at least one layer")
    flat = offsets.long()
    starts_ok = bool((flat[1:, 0] == flat[:-1, -1]).all()) and int(flat[0, 0]) == 0
    if not starts_ok or bool((flat[:, 1:] < flat[:, :-1]).any()):
        raise SummaryInvalid(field, "offsets must start at 0, be monotonic and contiguous")
    if int(flat[-1, -1]) != total:
        raise SummaryInvalid(field, f"last offset {int(flat[-1, -1])} != {total}")


def _check_pages_ascending(
    first: torch.Tensor, count: torch.Tensor, page_offsets: torch.Tensor
) -> None:
    if first.numel() < 2:
        return
    ordered = first[1:] >= first[:-1] + count[:-1]  # [P - 1] page p+1 starts after page p ends
    starts = page_offsets[:, :-1].flatten().long()
    starts = starts[(starts > 0) & (starts < first.numel())]
    ordered[starts - 1] = True  # a new owner may start anywhere
    if not bool(ordered.all()):
        page = int(torch.nonzero(~ordered)[0, 0]) + 1
        raise SummaryInvalid("page_first", f"page {page} overlaps or precedes the page before it")


def _check_host(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        device = getattr(obj, name).device
        if device.type != "cpu":
            raise SummaryInvalid(name, f"must be in host memory, got {device}")


def _check_omitted_rows(rows: OmittedRows) -> None:
    _check_host(rows, ("k", "v", "positions", "page_rows", "page_offsets"))
    if rows.k.dim() != 2 or rows.v.shape != rows.k.shape:
        raise SummaryInvalid(
            "k", f"K {tuple(rows.k.shape)} and V {tuple(rows.v.shape)} must be [N, d_h]"
        )
    num_rows = int(rows.k.shape[0])
    _check_index_vector(rows.positions, "positions", num_rows)
    if rows.page_rows.dim() != 1 or rows.page_rows.numel() < 1:
        raise SummaryInvalid(
            "page_rows", f"expected [P_total + 1], got {tuple(rows.page_rows.shape)}"
        )
    num_pages = int(rows.page_rows.shape[0]) - 1
    _check_index_vector(rows.page_rows, "page_rows", num_pages + 1)
    page_rows = rows.page_rows.long()
    if int(page_rows[0]) != 0 or int(page_rows[-1]) != num_rows:
        raise SummaryInvalid("page_rows", f"must run from 0 to N = {num_rows}")
    if bool((page_rows[1:] <= page_rows[:-1]).any()):
        raise SummaryInvalid("page_rows", "every page holds at least one row")
    _check_offsets(rows.page_offsets, num_pages, "page_offsets")
