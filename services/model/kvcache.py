"""The decode-side KV cache, paged (issue 17): the rows of every (request, layer, owner) live
in fixed-size pages of one `PagePool` (services/model/paged.py), found through a page table
per (request, layer, owner). A request is admitted from a packed view (its retained rows, any
number per owner) or from a dense prefill (every position retained, same code after that), in
one vectorized copy for all its layers. Each decode step appends one row per (request, owner)
into that owner's last page, taking a new page when it is full, so a step never copies the
cache and memory follows the rows each request holds (rounded up to pages, `ledger()`), not the
batch's longest head. Row order inside an owner is irrelevant to attention (keys carry RoPE at
their original position), so recalled rows are appended too.

The pool keeps each owner's pages consecutive (decode steps continue an owner's extent in
place) and each layer's owners in a region of their own, so in the common case every
(request, owner) of a layer is one run at one stride: attention reads the whole layer as one
strided view per chain of equal runs, with no gather and no merge (`PagedPlan.whole`). Plans
and the step's append rows are computed once per page change / step, not per layer call.

Pages are charged to a `PageLease`: the decode worker passes the reservation its admission
control checked (`admit_view(..., lease=)`); without one, the cache takes a lease of its own.
A worker's pool is fixed (a page past its budget is refused, `KVPoolExhausted`); a cache built
without a pool gets a private one that grows.

Recall (services/offload/recall.py) needs two things from a step, both off by default: a
`StepCapture` handed to `begin_step` records every layer's post-RoPE queries and the
log-sum-exp of the rows each query saw; `undo_step` takes the step just committed back, so
the step can run again once recalled rows are in. And, for a request whose manifest asks for
it, an omitted-value term (`set_omitted_term`): an `OmittedTerm` the cache asks, as each
layer attends, for one more attention partial per query head (an estimated mass carrying a
value: what the rows the cache does not hold would add), merged with the paged rows' output
through their log-sum-exp.

Owners are the K/V heads (query head i reads owner i // G), or, for views packed under the
GQA `expand` reduction, the query heads themselves (`owner_to_kv_head` = q_to_kv_head_map):
then every query head has its own rows and each new K/V row is appended to all its owners.

Decode-time retention (issue 18) needs two more things, per request, declared at admission
by its `RowContract` (services/model/row_attention.py) and free for every other request:
each step's attention probabilities over every row of every owner (`step_attention`, read
after the step, before `drop_rows` evicts), and cache-local positions (keys stored pre-RoPE,
rotated to their slot at attention time; the model is handed position 0 for such a request,
where RoPE is the identity, so its query and key arrive unrotated).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.model.attention import (
    Attend,
    PagedPlan,
    paged_decode_attention,
    paged_plan,
    paged_varlen_decode_attention,
    pages_used,
    varlen_decode_available,
)
from services.model.config import ModelConfig
from services.model.errors import InvalidModelInput, KVPoolExhausted
from services.model.layers import RotaryEmbedding, rotate
from services.model.paged import DEFAULT_PAGE_ROWS, POSITION_BYTES, PageLease, PagePool
from services.model.row_attention import (
    RowContract,
    StepAttention,
    attend_rows,
    gather_rows,
    reduce_heads,
)

BACKENDS = ("auto", "torch", "varlen")
LAYOUT_RAGGED = "ragged"  # every owner's rows are packed from its first page on, no holes
LAYOUT_COMPACTED = "compacted"  # rows were evicted (`drop_rows`); the kept ones moved up, no holes


class PackedRows(Protocol):
    """What admission reads from `services.kvpolicy.packing.PackedKVView`."""

    @property
    def packed_k(self) -> torch.Tensor: ...  # [R_total, d_h]

    @property
    def packed_v(self) -> torch.Tensor: ...  # [R_total, d_h]

    @property
    def original_position_map(self) -> torch.Tensor: ...  # [R_total] int

    @property
    def row_offsets(self) -> torch.Tensor: ...  # [L, H_owner + 1]

    def rows(self, layer: int, head: int) -> slice: ...


def check_capacities(backend: str, backends: tuple[str, ...], batch_capacity: int,
                     row_capacity: int) -> None:
    """A decode cache's constructor arguments: a known backend, positive capacities."""
    if backend not in backends:
        raise InvalidModelInput("backend", f"{backend!r} is not one of {backends}")
    if batch_capacity <= 0 or row_capacity <= 0:
        raise InvalidModelInput("capacity", "batch and row capacity must be positive")


def owners_of(config: ModelConfig, owner_to_kv_head: tuple[int, ...] | None,
              device: torch.device) -> tuple[int, torch.Tensor | None]:
    """How many owners a cache holds rows for, and the K/V head of each (None: the owners are
    the K/V heads; else they must be the query heads, in q_to_kv_head_map order)."""
    if owner_to_kv_head is None:
        return config.num_kv_heads, None
    if tuple(owner_to_kv_head) != config.q_to_kv_head_map:
        raise InvalidModelInput(
            "owner_to_kv_head", "owners other than K/V heads must be the query heads "
            f"in q_to_kv_head_map order {list(config.q_to_kv_head_map)}"
        )
    owner_map = torch.tensor(owner_to_kv_head, dtype=torch.long, device=device)
    return len(owner_to_kv_head), owner_map


def check_view(view: PackedRows, config: ModelConfig, num_owners: int, frontier: int) -> None:
    """A packed view a cache of `num_owners` owners can admit with next position `frontier`."""
    d_h = config.head_dim
    if view.packed_k.ndim != 2 or view.packed_k.shape[1] != d_h:
        raise InvalidModelInput("packed_k", f"shape {tuple(view.packed_k.shape)}, need [R, {d_h}]")
    if view.packed_v.shape != view.packed_k.shape:
        raise InvalidModelInput("packed_v", "shape differs from packed_k")
    if view.original_position_map.shape != view.packed_k.shape[:1]:
        raise InvalidModelInput("original_position_map", "needs one position per packed row")
    expected = (config.num_layers, num_owners + 1)
    if tuple(view.row_offsets.shape) != expected:
        raise InvalidModelInput(
            "row_offsets", f"shape {tuple(view.row_offsets.shape)}, this cache needs {expected}"
        )
    positions = view.original_position_map
    if positions.numel() and int(positions.max()) >= frontier:
        raise InvalidModelInput("frontier", f"{frontier} is not past every retained position")


def check_dense(config: ModelConfig, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Dense prefill K/V a cache can admit: keys/values `[L, H_kv, T, d_h]`, the same shape."""
    expected = (config.num_layers, config.num_kv_heads)
    if tuple(keys.shape[:2]) != expected or keys.shape != values.shape:
        raise InvalidModelInput("source_k", f"shape {tuple(keys.shape)} does not match {expected}")


class SlottedCache:
    """What the paged `DecodeCache` and the padded baseline (services/model/padded_cache.py)
    share: requests in slots 0..B-1 of `request_ids`, the owners' K/V heads (`_owner_map`, None
    when the owners are the K/V heads) and each request's next position (`_frontier`, which
    each cache sizes itself)."""

    _frontier: torch.Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                 owner_to_kv_head: tuple[int, ...] | None) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.request_ids: list[str] = []
        self.num_owners, self._owner_map = owners_of(config, owner_to_kv_head, self.device)

    @property
    def scale(self) -> float:
        """Attention logit scale, 1/sqrt(d_h)."""
        return float(self.config.head_dim**-0.5)

    @property
    def head_to_owner(self) -> tuple[int, ...]:
        """The owner whose rows each query head reads: its K/V head i // G, or itself."""
        if self._owner_map is not None:
            return tuple(range(self.config.num_q_heads))
        return tuple(i // self.config.group_size for i in range(self.config.num_q_heads))

    @property
    def batch_size(self) -> int:
        return len(self.request_ids)

    def frontier(self) -> torch.Tensor:
        """Original position of the next token of each active request `[B]`."""
        return self._frontier[: self.batch_size]

    def _slot(self, request_id: str) -> int:
        try:
            return self.request_ids.index(request_id)
        except ValueError:
            raise InvalidModelInput("request_id", f"{request_id!r} is not admitted") from None


OmittedPart = tuple[torch.Tensor, torch.Tensor]  # log mass [H_q], value [H_q, d_h]


class OmittedTerm(Protocol):
    """What the rows a request's cache does not hold would add to one layer's attention:
    given the layer and the request's query there `[H_q, d_h]` (post-RoPE, as the keys), a
    log mass `[H_q]` (log of the summed e^{scale q . k} of those rows; -inf: none) and the
    value `[H_q, d_h]` it carries, or None when nothing is omitted. Called once a layer a
    step, on the decode thread.

    A term may also have `start_layer_parts(layer, [(term, query), ...])`: a function that
    starts several terms' parts of a layer beside the caller (on a kernel's own thread, say)
    and returns the function that waits for them. The cache starts the terms that share one
    before the layer attends over its rows and waits for them after; a term without one is
    asked after the rows."""

    def __call__(self, layer: int, query: torch.Tensor) -> OmittedPart | None: ...


PartsWait = Callable[[], list[OmittedPart | None]]
StartLayerParts = Callable[[int, Sequence[tuple[OmittedTerm, torch.Tensor]]], PartsWait]


@dataclass
class StepCapture:
    """What one decode step's attention saw, per layer, for every request of the batch
    (runtime state, filled layer by layer while the step runs)."""

    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, H_q, d_h]
    lse: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, H_q] fp32
    # Called with each layer's record as soon as it is in (on the decode thread, while later
    # layers are still to run): work that reads one layer's attention starts there.
    on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None

    def record(self, layer: int, q: torch.Tensor, lse: torch.Tensor) -> None:
        self.queries[layer] = q.detach()
        self.lse[layer] = lse.detach()
        if self.on_layer is not None:
            self.on_layer(layer, self.queries[layer], self.lse[layer])

    def query(self, slot: int) -> torch.Tensor:
        """Post-RoPE queries of one request, every layer.  # [L, H_q, d_h]"""
        return torch.stack([self.queries[layer][slot] for layer in sorted(self.queries)])

    def log_sum_exp(self, slot: int) -> torch.Tensor:
        """Log-sum-exp of the scaled logits over the rows each query saw.  # [L, H_q] fp32"""
        return torch.stack([self.lse[layer][slot] for layer in sorted(self.lse)])


def merge_partial(out: torch.Tensor, lse: torch.Tensor, log_mass: torch.Tensor,
                  value: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint parts from their partials: `out` `[B, H, d_h]` with
    log-sum-exp `lse` `[B, H]`, and a part of mass e^log_mass `[B, H]` (-inf: none, `out`
    unchanged) carrying `value` `[B, H, d_h]`: (e^r o + e^M V) / (e^r + e^M), in fp32."""
    share = torch.sigmoid(log_mass - lse.float())[..., None]  # [B, H, 1], the second part's
    return torch.lerp(out.float(), value, share).to(out.dtype)


@dataclass(frozen=True)
class KVLedger:
    """What a cache holds: `rows` (K, V and position of `row_bytes` each) in `pages` pages of
    `page_bytes`; allocated / ledger is the page rounding. `layout`: how the rows sit in the
    pages (`ragged`: packed from each owner's first page, no holes; `compacted`: the same,
    after rows were evicted and the kept ones moved up; no layout leaves tombstones)."""

    requests: int
    rows: int
    row_bytes: int
    pages: int
    page_bytes: int
    layout: str = LAYOUT_RAGGED

    @property
    def ledger_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def rounding(self) -> float:
        """allocated / ledger (1.0 for an empty cache)."""
        return self.allocated_bytes / self.ledger_bytes if self.rows else 1.0


class DecodeCache(SlottedCache):
    """Paged per-(request, layer, owner) KV rows for a batch of decoding requests.

    Requests occupy slots 0..B-1 in `request_ids` order; a decode step feeds one token per
    request in that order. Releasing a request frees its pages and moves the last slot's page
    table into the hole (no KV row moves). `owner_to_kv_head`: None = owners are the K/V
    heads; else one K/V head per owner. `pool`: the worker's page pool (else a private one,
    first sized for `batch_capacity` x `row_capacity` rows per owner, that grows).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        batch_capacity: int = 4,
        row_capacity: int = 256,
        backend: str = "auto",
        owner_to_kv_head: tuple[int, ...] | None = None,
        pool: PagePool | None = None,
        page_rows: int = DEFAULT_PAGE_ROWS,
    ) -> None:
        check_capacities(backend, BACKENDS, batch_capacity, row_capacity)
        super().__init__(config, dtype, device, owner_to_kv_head)
        self.pool = pool if pool is not None else self._private_pool(
            batch_capacity, row_capacity, page_rows)
        self._check_pool(self.pool)
        self.page_rows = self.pool.page_rows
        table_pages = -(-row_capacity // self.page_rows)
        shape = (config.num_layers, batch_capacity, self.num_owners)
        # Host bookkeeping (the decode loop decides allocations without a device sync).
        self._lengths = torch.zeros(shape, dtype=torch.long)  # rows per (layer, slot, owner)
        self._pages = torch.zeros(shape, dtype=torch.long)  # pages per (layer, slot, owner)
        self._table = torch.zeros((*shape, table_pages), dtype=torch.long)  # page ids
        self._frontier = torch.zeros(batch_capacity, dtype=torch.int64, device=self.device)
        # Per slot: the request wrote a non-finite K/V row. The pool stores it finite (a padded
        # plan reads neighbours' rows under its mask), so its attention is made NaN here
        # instead, and the request fails alone as it would have.
        self._poisoned = torch.zeros(batch_capacity, dtype=torch.bool, device=self.device)
        self._leases: list[PageLease] = []
        self._own_lease: list[bool] = []
        self._device_table: list[torch.Tensor] | None = None  # per step, off-CPU devices only
        self._plans: list[PagedPlan | None] = [None] * config.num_layers  # per layer, reused
        self._checked = [False] * config.num_layers  # the layer's plan holds for its pages
        self._varlen = backend == "varlen" or (
            backend == "auto" and varlen_decode_available(self.device, dtype)
        )
        self._capture: StepCapture | None = None
        self._contracts: list[RowContract] = []  # per slot
        self._gathered: list[int] = []  # this step's slots whose contract gathers their rows
        self._attention: dict[int, dict[int, torch.Tensor]] = {}  # slot -> layer -> [H, S]
        self._rotary: RotaryEmbedding | None = None  # built for the first cache-local request
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        self._step_rows = (none[None], none.int())  # this step's `_append_rows`
        self._undoable = False  # the last call committed a step and nothing was written since
        self._compacted: list[bool] = []  # per slot: some owner had rows evicted and compacted
        self._terms: dict[str, OmittedTerm] = {}  # omitted-value terms by request
        self._step_terms: list[tuple[int, OmittedTerm]] = []  # this step's, by slot

    def lengths(self, request_id: str) -> torch.Tensor:
        """Rows held per (layer, owner) for one request `[L, H_owner]`."""
        return self._lengths[:, self._slot(request_id)].clone()

    def rows(self, request_id: str, layer: int, head: int) -> tuple[torch.Tensor, ...]:
        """keys `[n, d_h]`, values `[n, d_h]`, original positions `[n]` held for one owner."""
        slot = self._slot(request_id)
        n = int(self._lengths[layer, slot, head])
        pages = self._table[layer, slot, head, : int(self._pages[layer, slot, head])]
        index = (pages[:, None] * self.page_rows + torch.arange(self.page_rows)).reshape(-1)[:n]
        index = index.to(self.device)
        d_h = self.config.head_dim
        return (self.pool.keys.view(-1, d_h)[index], self.pool.values.view(-1, d_h)[index],
                self.pool.positions.view(-1)[index])

    def ledger(self, request_id: str | None = None) -> KVLedger:
        """Rows held and pages allocated, for one request or the whole batch."""
        slots = slice(None) if request_id is None else slice(s := self._slot(request_id), s + 1)
        batch = self.batch_size
        lengths, pages = self._lengths[:, :batch][:, slots], self._pages[:, :batch][:, slots]
        row_bytes = 2 * self.config.head_dim * self.dtype.itemsize + POSITION_BYTES
        requests = batch if request_id is None else 1
        compacted = self._compacted[:batch][slots]
        layout = LAYOUT_COMPACTED if any(compacted) else LAYOUT_RAGGED
        return KVLedger(requests, int(lengths.sum()), row_bytes, int(pages.sum()),
                        self.pool.page_bytes, layout)

    def pages_after(self, request_id: str, rows: int, bound: int | None = None) -> int:
        """Pages one request holds once every (layer, owner) has `rows` more rows; with
        `bound` (decode-time retention: its budget plus the step's candidate row), an owner
        holds at most that many once a step has run (its rows now and the next one, if more)."""
        slot = self._slot(request_id)
        after = self._lengths[:, slot] + rows
        if bound is not None and rows > 0:
            after = torch.minimum(after, torch.clamp(self._lengths[:, slot] + 1, min=bound))
        needed = (after + self.page_rows - 1) // self.page_rows
        return int(torch.maximum(needed, self._pages[:, slot]).sum())

    def admit_view(self, request_id: str, view: PackedRows, frontier: int,
                   lease: PageLease | None = None, contract: RowContract = RowContract()) -> None:
        """Admit a request from a packed view; `frontier` is the next token's original position.
        Its pages are charged to `lease` (else to a lease the cache takes and releases);
        `contract`: how its rows are stored and read (keys of a cache-local one are un-rotated
        from their original positions here)."""
        check_view(view, self.config, self.num_owners, frontier)
        offsets = view.row_offsets.to(device="cpu", dtype=torch.long)  # [L, H + 1]
        counts = offsets[:, 1:] - offsets[:, :-1]  # [L, H]
        positions = view.original_position_map
        keys = self._stored_keys(view.packed_k, positions, contract)
        slot = self._new_slot(request_id, frontier, lease, contract)
        self._admit(slot, counts, offsets[:, :-1], keys, view.packed_v, positions)

    def admit_dense(
        self, request_id: str, keys: torch.Tensor, values: torch.Tensor,
        frontier: int | None = None, lease: PageLease | None = None,
        contract: RowContract = RowContract(),
    ) -> None:
        """Admit a request retaining every position: keys/values `[L, H_kv, T, d_h]` (keys
        post-RoPE at their positions, whatever `contract`)."""
        check_dense(self.config, keys, values)
        length = keys.shape[2]
        if self._owner_map is not None:  # every owner gets its K/V head's rows
            keys, values = keys[:, self._owner_map.cpu()], values[:, self._owner_map.cpu()]
        layers, owners = keys.shape[:2]
        counts = torch.full((layers, owners), length, dtype=torch.long)
        starts = torch.arange(layers * owners, dtype=torch.long).view(layers, owners) * length
        positions = torch.arange(length, dtype=torch.int32).repeat(layers * owners)
        d_h = self.config.head_dim
        flat = self._stored_keys(keys.reshape(-1, d_h), positions, contract)
        slot = self._new_slot(request_id, length if frontier is None else frontier, lease,
                              contract)
        self._admit(slot, counts, starts, flat, values.reshape(-1, d_h), positions)

    def append_rows(
        self, request_id: str, layer: int, head: int,
        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> None:
        """Add rows `[n, d_h]` at original `positions` `[n]` to one head (e.g. recalled rows)."""
        counts = torch.zeros(self._lengths.shape[0], self.num_owners, dtype=torch.long)
        counts[layer, head] = keys.shape[0]
        self.append_owner_rows(request_id, counts, keys, values, positions)

    def append_owner_rows(
        self, request_id: str, counts: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> None:
        """Add `counts[l, h]` rows `[n, d_h]` at original `positions` `[n]` to every (layer,
        owner) in one write, the rows given owner after owner in (layer, owner) order (a
        recall's pages of many owners: one page allocation and one copy, not one an owner)."""
        slot = self._slot(request_id)
        shape = (self._lengths.shape[0], self.num_owners)
        total = int(counts.sum()) if tuple(counts.shape) == shape else -1
        if bool((counts < 0).any()) or total != keys.shape[0]:
            raise InvalidModelInput(
                "counts", f"need non-negative [L, H_owner] = {list(shape)} counts summing to the "
                f"{keys.shape[0]} rows given")
        if values.shape != keys.shape or tuple(positions.shape) != (total,):
            raise InvalidModelInput("values", "keys, values and positions disagree in rows")
        flat = counts.long().reshape(-1)
        starts = (torch.cumsum(flat, 0) - flat).view(shape)  # each owner's first given row
        self._write(slot, counts.long(), starts, keys, values, positions)

    def drop_rows(self, request_id: str, layer: int, head: int, drop: torch.Tensor) -> int:
        """Evict rows from one owner (decode-time retention, a recall swap): `drop` `[n]` bool
        over the rows `rows()` returns, in that order. The kept rows are compacted to the
        front of the owner's pages (their order kept) and the pages past them go back to the
        pool; returns the pages freed. The ledger's layout reads `compacted` from then on."""
        slot = self._slot(request_id)
        held = int(self._lengths[layer, slot, head])
        if drop.dtype != torch.bool or tuple(drop.shape) != (held,):
            raise InvalidModelInput("drop", f"need a bool mask over the owner's {held} rows")
        self._undoable = False
        rows = self.page_rows
        pages = self._table[layer, slot, head, : int(self._pages[layer, slot, head])]
        index = (pages[:, None] * rows + torch.arange(rows)).reshape(-1)[:held]  # [n] pool rows
        kept = index[~drop.cpu()]
        keep = kept.numel()
        if keep == 0:
            raise InvalidModelInput("drop", "an owner keeps at least one row (its newest)")
        dest, source = index[:keep].to(self.device), kept.to(self.device)
        d_h, pool = self.config.head_dim, self.pool
        for flat in (pool.keys.view(-1, d_h), pool.values.view(-1, d_h), pool.positions.view(-1)):
            flat.index_copy_(0, dest, flat.index_select(0, source))  # gathered first: no overlap
        needed = -(-keep // rows)
        freed = pages[needed:].clone()
        pool.free(self._leases[slot], freed)
        self._pages[layer, slot, head] = needed
        self._lengths[layer, slot, head] = keep
        self._invalidate()
        self._compacted[slot] = True
        return int(freed.numel())

    def drop_owner_rows(self, request_id: str, drop: torch.Tensor, room: int = 0) -> int:
        """`drop_rows` for every (layer, owner) of a request at once (decode-time retention's
        step 6): `drop` `[L, H_owner, R]` bool, row r of owner (l, h) in `rows()` order for
        r < its rows (R at least the most any owner holds; the rest False). One gather and
        one index copy for all owners; an owner keeps the pages of its rows plus `room` more
        (retention: 1, the next step's candidate row, so an owner at a page boundary does not
        free a page to take it back at the next step). Returns the pages freed."""
        slot = self._slot(request_id)
        held = self._lengths[:, slot]  # [L, H]
        span = drop.shape[-1] if drop.dim() == 3 else 0
        local = torch.arange(span)
        if drop.dtype != torch.bool or tuple(drop.shape[:2]) != tuple(held.shape) or (
                span < int(held.max())):
            raise InvalidModelInput("drop", f"need a bool mask [L, H, R >= {int(held.max())}]")
        drop = drop.cpu()
        valid = local < held[..., None]  # [L, H, R]
        keep = valid & ~drop
        kept = keep.sum(-1)  # [L, H]
        if bool((drop & ~valid).any()) or bool((kept == 0).any()):
            raise InvalidModelInput("drop", "rows past an owner's own, or an owner left with none")
        changed = kept < held  # [L, H]
        if not bool(changed.any()):
            return 0
        self._undoable = False
        rows, table = self.page_rows, self._table[:, slot]  # [L, H, W]
        column = (local // rows).clamp(max=table.shape[-1] - 1).expand(*held.shape, -1)
        index = table.gather(2, column) * rows + local % rows  # [L, H, R] pool rows
        # Kept rows first, each group in row order: the first `kept` are the compacted rows.
        order = torch.sort(torch.where(keep, local, local + span), dim=-1).indices
        moved = (local < kept[..., None]) & changed[..., None]  # [L, H, R]
        dest = index[moved].to(self.device)
        source = index.gather(2, order)[moved].to(self.device)
        d_h, pool = self.config.head_dim, self.pool
        for flat in (pool.keys.view(-1, d_h), pool.values.view(-1, d_h), pool.positions.view(-1)):
            flat.index_copy_(0, dest, flat.index_select(0, source))  # gathered first: no overlap
        pages = self._pages[:, slot]
        needed = torch.minimum((kept + room + rows - 1) // rows, pages)
        columns = torch.arange(table.shape[-1])
        gone = (columns >= needed[..., None]) & (columns < pages[..., None]) & changed[..., None]
        freed = table[gone]
        pool.free(self._leases[slot], freed)
        self._pages[:, slot] = torch.where(changed, needed, pages)
        self._lengths[:, slot] = kept
        self._compacted[slot] = True
        if freed.numel():  # the attention plans read pages, not rows: same pages, same plans
            self._invalidate()
        return int(freed.numel())

    def set_omitted_term(self, request_id: str, term: OmittedTerm) -> None:
        """From the next step on, every layer's attention of this request also takes the
        partial `term` gives for that layer's query, merged with the paged rows' output o and
        log-sum-exp r as (e^r o + e^M V) / (e^r + e^M). Replaces the request's previous term.
        InvalidModelInput for a request whose contract gathers its rows (its attention is not
        the paged kernel's)."""
        slot = self._slot(request_id)
        if self._contracts[slot].gathered:
            raise InvalidModelInput("omitted_term", f"{request_id!r} gathers its rows")
        self._terms[request_id] = term

    def clear_omitted_term(self, request_id: str) -> None:
        """From the next step on, this request's attention reads its rows only."""
        self._slot(request_id)
        self._terms.pop(request_id, None)

    def has_omitted_term(self, request_id: str) -> bool:
        return request_id in self._terms

    def release(self, request_id: str) -> None:
        """Drop a request: its pages go back to the pool (zeroed when next handed out), and the
        last slot's page table moves into its place."""
        slot, last = self._slot(request_id), self.batch_size - 1
        self._terms.pop(request_id, None)
        self._undoable = False
        self._invalidate()
        held = self._pages[:, slot]  # [L, H]
        used = torch.arange(self._table.shape[-1]) < held[..., None]
        self.pool.free(self._leases[slot], self._table[:, slot][used])
        if self._own_lease[slot]:
            self._leases[slot].release()
        if slot != last:
            for tensor in (self._lengths, self._pages, self._table):
                tensor[:, slot] = tensor[:, last]
            self._frontier[slot] = self._frontier[last]
            self._poisoned[slot] = self._poisoned[last]
            self.request_ids[slot] = self.request_ids[last]
            self._leases[slot], self._own_lease[slot] = self._leases[last], self._own_lease[last]
            self._contracts[slot] = self._contracts[last]
            self._compacted[slot] = self._compacted[last]
        # The step's captured attention follows its request into the hole.
        self._attention.pop(slot, None)
        moved = self._attention.pop(last, None)
        if moved is not None and slot != last:
            self._attention[slot] = moved
        for tensor in (self._lengths, self._pages):
            tensor[:, last] = 0
        self._poisoned[last] = False
        self.request_ids.pop()
        self._leases.pop()
        self._own_lease.pop()
        self._contracts.pop()
        self._compacted.pop()

    def begin_step(self, capture: StepCapture | None = None) -> torch.Tensor:
        """Make room for one more row per (request, layer, owner): a new page for every owner
        whose last page is full (KVPoolExhausted naming the request when its budget has none);
        returns the positions `[B]` the model rotates this step's queries and keys to: the
        frontier, or 0 (no rotation) for a cache-local request. With `capture`, every layer of
        this step records its queries and log-sum-exps there."""
        if not self.request_ids:
            raise InvalidModelInput("batch", "no request admitted")
        batch = self.batch_size
        self._capture, self._undoable = None, False
        full = self._lengths[:, :batch] // self.page_rows >= self._pages[:, :batch]  # [L, B, H]
        if bool(full.any()):
            self._invalidate()
            for slot in full.any(dim=2).any(dim=0).nonzero()[:, 0].tolist():
                layers, heads = full[:, slot].nonzero(as_tuple=True)
                self._add_pages(slot, layers, heads, torch.ones_like(layers))
        if self._device_table is None and self.device.type != "cpu":
            self._device_table = [t.to(self.device) for t in self._table]
        self._step_rows = self._append_rows(batch)
        self._capture = capture
        self._gathered = [slot for slot, c in enumerate(self._contracts) if c.gathered]
        self._attention = {}
        self._step_terms = [(self._slot(rid), term) for rid, term in self._terms.items()]
        positions = self.frontier().clone()
        local = [slot for slot in self._gathered if self._contracts[slot].cache_local]
        if local:
            positions[local] = 0
        return positions

    def _layer_terms(self, layer: int, parts: Sequence[OmittedPart | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's omitted-value partials of layer l for the batch, from each step term's
        part (`_step_terms` order): log mass `[B, H_q]` (-inf: none) and value `[B, H_q, d_h]`;
        InvalidModelInput naming the requests whose term answered a shape that is not the
        layer's, a NaN or +inf mass or a non-finite value (checked once for the batch)."""
        heads, dim = self.config.num_q_heads, self.config.head_dim
        masses = [torch.full((heads,), -torch.inf)] * self.batch_size  # no term: no mass
        values = [torch.zeros(heads, dim)] * self.batch_size
        for (slot, _), part in zip(self._step_terms, parts, strict=True):
            if part is None:
                continue
            log_mass, term_value = part
            if log_mass.shape != (heads,) or term_value.shape != (heads, dim):
                raise InvalidModelInput("omitted_term", f"{self.request_ids[slot]!r}: layer "
                                        f"{layer} answered {tuple(log_mass.shape)} / "
                                        f"{tuple(term_value.shape)}")
            masses[slot], values[slot] = log_mass, term_value
        mass, value = torch.stack(masses).float(), torch.stack(values).float()
        # Below +inf (-inf is no mass; NaN compares false) and finite: one check (one read back)
        # for the batch, and the requests named only when it fails.
        if not bool((mass < torch.inf).all() & torch.isfinite(value).all()):
            bad = ~(mass < torch.inf).all(dim=1) | ~torch.isfinite(value).flatten(1).all(dim=1)
            named = [repr(self.request_ids[s]) for s in torch.nonzero(bad)[:, 0].tolist()]
            raise InvalidModelInput("omitted_term", f"{', '.join(named)}: layer {layer} "
                                    "answered a non-finite part")
        return mass.to(self.device), value.to(self.device)

    def _start_terms(self, layer: int, q: torch.Tensor) -> list[tuple[list[int], PartsWait]]:
        """Layer l's terms of this step, started: the terms that share a `start_layer_parts`
        together, each other term on its own (asked when its wait is called); each group's
        members (`_step_terms` indices) and wait."""
        terms = self._step_terms
        together: dict[StartLayerParts, list[int]] = {}
        waits: list[tuple[list[int], PartsWait]] = []
        for i, (slot, term) in enumerate(terms):
            start = getattr(term, "start_layer_parts", None)
            if start is None:
                waits.append(([i], functools.partial(_ask, term, layer, q[slot])))
            else:
                together.setdefault(start, []).append(i)
        for start, members in together.items():
            waits.append((members, start(layer, [(terms[i][1], q[terms[i][0]]) for i in members])))
        return waits

    def attention(self, layer: int) -> Attend:
        """The `Attend` of layer l for this step: append the new row to every owner, attend."""
        window = self.config.sliding_windows[layer]
        batch, scale, capture = self.batch_size, self.scale, self._capture
        terms = self._step_terms

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [B, H_q, d_h]; k, v [B, H_kv, d_h] at the frontier position
            if self._owner_map is not None:
                k, v = k[:, self._owner_map], v[:, self._owner_map]  # [B, H_owner, d_h]
            table = self._layer_table(layer)[:batch]  # [B, H, max_pages]
            self._append_step(layer, k, v)
            lengths = self._lengths[layer, :batch].to(self.device)  # [B, H], the new row included
            pool = self.pool
            if self._varlen and window is None and capture is None and not terms:
                out = paged_varlen_decode_attention(
                    q, pool.keys, pool.values, table, lengths, scale)
            else:
                hidden = None if window is None else self.frontier() - window
                # The omitted-value terms need only the query: those that start beside the
                # step (`OmittedTerm.start_layer_parts`) run while this thread attends over
                # the rows, the others are asked after.
                waits = self._start_terms(layer, q) if terms else ()
                out, lse = paged_decode_attention(
                    q, pool.keys, pool.values, table, lengths, scale,
                    hidden_at_or_before=hidden, page_positions=pool.positions,
                    plan=self._plan(layer, table, lengths),
                    with_lse=capture is not None or bool(terms),
                )
                parts = None
                if terms:
                    answered: list[OmittedPart | None] = [None] * len(terms)
                    for members, wait in waits:
                        for i, part in zip(members, wait(), strict=True):
                            answered[i] = part
                    parts = self._layer_terms(layer, answered)
                # The terms first: a capture's `on_layer` may read what they computed.
                if capture is not None and lse is not None:
                    capture.record(layer, q, lse)  # the rows' own, without the term
                if parts is not None and lse is not None:
                    out = merge_partial(out, lse, *parts)
            if self._gathered:
                out = self._attend_gathered(layer, q, out)
            return torch.where(self._poisoned[:batch, None, None], torch.nan, out)

        return attend

    def step_attention(self, request_id: str) -> StepAttention:
        """The last step's attention of a request whose contract captures it, every layer,
        over the rows each owner held then (InvalidModelInput if it captured none)."""
        slot = self._slot(request_id)
        layers = self._attention.get(slot)
        if layers is None or len(layers) != self.config.num_layers:
            raise InvalidModelInput("capture", f"{request_id!r} captured no step's attention")
        probs = tuple(layers[layer] for layer in range(self.config.num_layers))
        return StepAttention(probs, self._lengths[:, slot].clone())

    def contract(self, request_id: str) -> RowContract:
        """How one request's rows are stored and read."""
        return self._contracts[self._slot(request_id)]

    def end_step(self) -> None:
        """Commit the step: every owner gained one row, every frontier moves by one."""
        self._frontier[: self.batch_size] += 1
        self._capture, self._undoable = None, True

    def undo_step(self) -> None:
        """Take back the step just committed: every request drops the row that step appended
        to each owner and its frontier moves back by one (a page it opened stays, for the
        step's rerun). Only right after `end_step`, before any row is written, a request
        admitted or released (else InvalidModelInput)."""
        if not self._undoable:
            raise InvalidModelInput("undo_step", "only the step just committed can be undone")
        batch = self.batch_size
        self._lengths[:, :batch] -= 1
        self._frontier[:batch] -= 1
        self._undoable = False
        self._invalidate()  # the page the step opened stays, unused until the rerun

    def _attend_gathered(self, layer: int, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Replace the paged output of the requests whose contract gathers their rows with
        attention over those rows (rotated to slots when cache-local), recording the
        probabilities of those that capture them."""
        slots = self._gathered
        index = torch.tensor(slots, dtype=torch.long)
        pool = self.pool
        rows = gather_rows(pool.keys, pool.values, pool.positions, self._table[layer][index],
                           self._lengths[layer][index])
        window = self.config.sliding_windows[layer]
        hidden = None if window is None else self._frontier[index.to(self.device)] - window
        local = torch.tensor([self._contracts[s].cache_local for s in slots], device=self.device)
        heads = torch.tensor(self.head_to_owner, dtype=torch.long, device=self.device)
        result, probs = attend_rows(q[index.to(self.device)], rows, self.scale, heads, hidden,
                                    local, self._rotary)
        out = out.clone()
        out[index.to(self.device)] = result.to(out.dtype)
        for i, slot in enumerate(slots):
            how = self._contracts[slot].capture
            if how is not None:
                self._attention.setdefault(slot, {})[layer] = reduce_heads(probs[i], how)
        return out

    def _stored_keys(self, keys: torch.Tensor, positions: torch.Tensor,
                     contract: RowContract) -> torch.Tensor:
        """Keys as a request's contract stores them: cache-local ones un-rotated from their
        original positions (in fp32, then back to the keys' dtype)."""
        if not contract.cache_local:
            return keys
        if self._rotary is None:
            self._rotary = RotaryEmbedding(self.config.rope, self.config.head_dim)
        back = -positions.to(keys.device, torch.long)
        return rotate(keys.float(), back, self._rotary).to(keys.dtype)

    def _invalidate(self, layers: Sequence[int] | None = None) -> None:
        """Page tables changed (in `layers`; None: any): the device copies are stale, and those
        layers' attention plans are checked again before their next use (a recall that adds
        rows to a few layers leaves the others' alone)."""
        self._device_table = None
        for layer in range(len(self._plans)) if layers is None else layers:
            self._checked[layer] = False

    def _plan(self, layer: int, table: torch.Tensor, lengths: torch.Tensor) -> PagedPlan:
        # Reused while unchanged: between two page changes a step's row lands in a page the plan
        # already reads (after each step's append every owner uses exactly the pages it holds;
        # the one exception, a page an undone step opened, invalidates in `undo_step`). After a
        # change the plan is kept when it still `holds` (padded by the pool's growth room: an
        # owner's decode or recalled rows grew it in place), else built again, and the pages it
        # may read past the rows are made safe to read (`PagePool.clean`).
        plan = self._plans[layer]
        if plan is not None and self._checked[layer]:
            return plan
        used = pages_used(lengths, self.page_rows)
        if plan is None or not plan.holds(table, used):
            pool = self.pool
            plan = self._plans[layer] = paged_plan(
                table, used, page_rows=self.page_rows, pad_pages=pool.growth_pages,
                pool_pages=pool.num_pages)
            pool.clean(plan.padding())
        self._checked[layer] = True
        return plan

    def _layer_table(self, layer: int) -> torch.Tensor:
        if self._device_table is not None:
            return self._device_table[layer]
        return self._table[layer]

    def _append_rows(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where this step's row of every (layer, slot, owner) goes, for all layers at once:
        the pool row after each owner's last `[L, B * H]`, and the rows' position `[B * H]`."""
        rows, lengths = self.page_rows, self._lengths[:, :batch]  # [L, B, H]
        page = self._table[:, :batch].gather(3, (lengths // rows)[..., None])[..., 0]
        flat = (page * rows + lengths % rows).reshape(lengths.shape[0], -1).to(self.device)
        position = self._frontier[:batch, None].expand(-1, self.num_owners).reshape(-1)
        return flat, position.to(torch.int32)

    def _append_step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # One row per (slot, owner) into the page holding row `length`: [B * H] flat rows.
        flat, position = self._step_rows[0][layer], self._step_rows[1]
        d_h = self.config.head_dim
        pool = self.pool
        batch = k.shape[0]
        self._poisoned[:batch] |= ~(k.isfinite().flatten(1).all(dim=1)
                                    & v.isfinite().flatten(1).all(dim=1))
        pool.keys.view(-1, d_h).index_copy_(0, flat, _finite(k.reshape(-1, d_h), pool.dtype))
        pool.values.view(-1, d_h).index_copy_(0, flat, _finite(v.reshape(-1, d_h), pool.dtype))
        pool.positions.view(-1).index_copy_(0, flat, position)
        self._lengths[layer, : k.shape[0]] += 1

    def _admit(
        self, slot: int, counts: torch.Tensor, starts: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> None:
        # All or nothing: a request whose rows do not fit leaves no slot and no page behind.
        try:
            self._write(slot, counts, starts, keys, values, positions)
        except BaseException:
            self.release(self.request_ids[slot])
            raise

    def _write(
        self, slot: int, counts: torch.Tensor, starts: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
    ) -> None:
        """Append `counts[l, h]` rows to every (layer, owner) of a slot, taken from the packed
        rows `starts[l, h]`..: pages first, then one index copy for all of them."""
        self._undoable = False
        base = self._lengths[:, slot]  # [L, H] rows held before
        rows = self.page_rows
        needed = (base + counts + rows - 1) // rows - self._pages[:, slot]  # [L, H]
        layers, heads = (needed > 0).nonzero(as_tuple=True)
        if layers.numel():
            self._add_pages(slot, layers, heads, needed[layers, heads])
        flat_counts = counts.reshape(-1)
        total = int(flat_counts.sum())
        if total == 0:
            return
        # Rows outside a step: the pages used change, in the layers that got rows.
        self._invalidate(torch.nonzero(counts.sum(dim=1))[:, 0].tolist())
        segment = torch.repeat_interleave(torch.arange(flat_counts.numel()), flat_counts)  # [R]
        first = torch.cumsum(flat_counts, 0) - flat_counts  # [S] first new row of each segment
        local = torch.arange(total) - first[segment]  # [R] index among the new rows
        owners = counts.shape[1]
        layer_of, owner_of = segment // owners, segment % owners
        index = base.reshape(-1)[segment] + local  # [R] row index inside its owner
        page = self._table[layer_of, slot, owner_of, index // rows]
        dest = (page * rows + index % rows).to(self.device)
        source = (starts.reshape(-1)[segment] + local).to(keys.device)
        d_h = self.config.head_dim
        pool = self.pool
        for given, flat in ((keys, pool.keys.view(-1, d_h)), (values, pool.values.view(-1, d_h))):
            taken = given[source].to(self.device)
            if not bool(taken.isfinite().all()):
                self._poisoned[slot] = True
            flat.index_copy_(0, dest, _finite(taken, pool.dtype))
        pool.positions.view(-1).index_copy_(
            0, dest, positions.to(keys.device)[source].to(self.device, torch.int32))
        self._lengths[:, slot] += counts

    def _add_pages(self, slot: int, layers: torch.Tensor, heads: torch.Tensor,
                   counts: torch.Tensor) -> None:
        """`counts[i]` new pages at the end of (layers[i], slot, heads[i]), in one allocation
        that continues each owner's last page in place where the pool can (so attention reads
        the owner's rows as one run), new extents in the layer's region of the pool."""
        held = self._pages[layers, slot, heads]  # [n]
        last = self._table[layers, slot, heads, (held - 1).clamp(min=0)]
        after = torch.where(held > 0, last, -1)
        region = self.pool.num_pages // self.config.num_layers  # each layer's own region
        try:
            ids = self.pool.allocate_extents(self._leases[slot], counts.tolist(), after.tolist(),
                                             (layers * region).tolist())
        except KVPoolExhausted as exc:
            raise KVPoolExhausted(exc.field, exc.reason, self.request_ids[slot]) from None
        if int((held + counts).max()) > self._table.shape[-1]:
            self._grow_table(int((held + counts).max()))
            self._invalidate()  # every layer's table is a new, wider one
        else:
            self._invalidate(sorted(set(layers.tolist())))
        owner = torch.repeat_interleave(torch.arange(counts.numel()), counts)  # [P]
        first = torch.cumsum(counts, 0) - counts
        column = held[owner] + torch.arange(ids.numel()) - first[owner]
        self._table[layers[owner], slot, heads[owner], column] = ids.cpu()
        self._pages[layers, slot, heads] += counts

    def _grow_table(self, pages: int) -> None:
        width = max(pages, 2 * self._table.shape[-1])
        grown = torch.zeros((*self._table.shape[:3], width), dtype=torch.long)
        grown[..., : self._table.shape[-1]] = self._table
        self._table = grown

    def _private_pool(self, batch: int, rows: int, page_rows: int) -> PagePool:
        pages = batch * self.config.num_layers * self.num_owners * -(-rows // page_rows)
        return PagePool(pages, self.config.head_dim, self.dtype, self.device, page_rows,
                        field="decode_cache", growable=True)

    def _check_pool(self, pool: PagePool) -> None:
        wanted = (self.config.head_dim, self.dtype, self.device)
        if (pool.head_dim, pool.dtype, pool.device) != wanted:
            raise InvalidModelInput(
                "pool", f"pages of d_h {pool.head_dim} {pool.dtype} on {pool.device}; this cache "
                f"needs d_h {self.config.head_dim} {self.dtype} on {self.device}")

    def _new_slot(self, request_id: str, frontier: int, lease: PageLease | None,
                  contract: RowContract = RowContract()) -> int:
        if request_id in self.request_ids:
            raise InvalidModelInput("request_id", f"{request_id!r} is already admitted")
        slot = self.batch_size
        self._undoable = False
        self._invalidate()
        if slot == self._frontier.shape[0]:
            self._grow_batch(2 * slot)
        self.request_ids.append(request_id)
        self._leases.append(lease if lease is not None else self.pool.ledger.reserve(0, request_id))
        self._own_lease.append(lease is None)
        self._contracts.append(contract)  # a cache-local one's keys built `_rotary` already
        self._compacted.append(False)
        self._frontier[slot] = frontier
        self._poisoned[slot] = False
        self._lengths[:, slot] = 0
        self._pages[:, slot] = 0
        return slot

    def _grow_batch(self, slots: int) -> None:
        used = self.batch_size

        def grown(tensor: torch.Tensor) -> torch.Tensor:
            bigger = torch.zeros((tensor.shape[0], slots, *tensor.shape[2:]), dtype=tensor.dtype)
            bigger[:, :used] = tensor[:, :used]
            return bigger

        self._lengths, self._pages, self._table = (
            grown(self._lengths), grown(self._pages), grown(self._table))
        frontier = torch.zeros(slots, dtype=torch.int64, device=self.device)
        frontier[:used] = self._frontier[:used]
        self._frontier = frontier
        poisoned = torch.zeros(slots, dtype=torch.bool, device=self.device)
        poisoned[:used] = self._poisoned[:used]
        self._poisoned = poisoned


def _finite(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rows` as the pool stores them: in its dtype, NaN as 0 and an infinity as the largest
    finite value, so a neighbour's masked read (a padded plan's) never meets a NaN. The request
    that wrote such a row is marked poisoned, and its attention is NaN from then on."""
    return torch.nan_to_num(rows.to(dtype))


def _ask(term: OmittedTerm, layer: int, query: torch.Tensor) -> list[OmittedPart | None]:
    """A term without `start_layer_parts`, asked for its part of layer l."""
    return [term(layer, query)]
