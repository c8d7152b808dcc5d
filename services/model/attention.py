"""Self-attention: the projection module and the three attention computations the runtime
needs. Keys are stored after RoPE at their original positions, so a key row carries its
position with it and attention over any subset of rows needs no re-rotation.

- `causal_chunk_attention`: one prefill chunk of queries against all keys before it.
- `observation_attention`: the last W_obs queries' softmax rows, for SnapKV scoring.
- `ragged_decode_attention` / `varlen_decode_attention`: one new query per request over a
  padded per-(request, K/V head) cache where every head has its own length;
  `ragged_decode_attention_lse` also returns each query's log-sum-exp (for recall),
  `ragged_decode_attention_probs` the probabilities (for decode-time retention). The padded
  baseline (`services.model.padded_cache`) and the dense reference of the paged kernels.
- `paged_decode_attention` / `paged_varlen_decode_attention`: the same over KV pages through a
  page table per (request, owner); cost follows the rows each (request, owner) holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.model.config import ModelConfig
from services.model.layers import RMSNorm, apply_rotary

# attend(q [N, H_q, d_h], k [N, H_kv, d_h], v [N, H_kv, d_h]) -> [N, H_q, d_h]; N tokens are
# either one prefill chunk of one sequence or one new token per request of a decode batch.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SelfAttention(nn.Module):
    """q/k/v/o projections (+ Qwen3 per-head q/k RMSNorm); the attention itself is injected."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d_h, h_q, h_kv = config.head_dim, config.num_q_heads, config.num_kv_heads
        self.num_heads, self.head_dim = h_q, d_h
        self.q_proj = nn.Linear(config.hidden_size, h_q * d_h, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, h_kv * d_h, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, h_kv * d_h, bias=config.qkv_bias)
        self.o_proj = nn.Linear(h_q * d_h, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(d_h, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d_h, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """x `[N, D]`, cos/sin `[N, d_h]` at each token's original position -> `[N, D]`."""
        q = self.q_proj(x).unflatten(-1, (-1, self.head_dim))  # [N, H_q, d_h]
        k = self.k_proj(x).unflatten(-1, (-1, self.head_dim))  # [N, H_kv, d_h]
        v = self.v_proj(x).unflatten(-1, (-1, self.head_dim))  # [N, H_kv, d_h]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.o_proj(attend(q, k, v).flatten(-2))


def causal_chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Queries at positions [start, start+C) over keys at positions [0, start+C).

    q `[C, H_q, d_h]`, keys/values `[H_kv, start+C, d_h]` -> `[C, H_q, d_h]`.
    Peak score memory is C x (start+C) per head: the T x T matrix is never built.
    """
    chunk = q.shape[0]
    mask = None
    if start > 0 or window is not None:
        mask = visibility_mask(
            torch.arange(start, start + chunk, device=q.device),
            torch.arange(keys.shape[1], device=q.device),
            window,
        )  # [C, start+C]
    # 4-D inputs: torch's CPU flash kernel only takes [B, H, T, d_h]; 3-D falls back to math.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )  # [1, H_q, C, d_h]
    return out[0].transpose(0, 1)


def observation_attention(
    q_obs: torch.Tensor,
    keys: torch.Tensor,
    q_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Softmax rows of the last W_obs queries over all T keys, in fp32, causal inside the window.

    q_obs `[H_q, W_obs, d_h]`, keys `[H_kv, T, d_h]`, q_positions `[W_obs]` -> `[H_q, W_obs, T]`.
    """
    h_q, w_obs, d_h = q_obs.shape
    h_kv, length, _ = keys.shape
    grouped = q_obs.float().view(h_kv, h_q // h_kv * w_obs, d_h)  # [H_kv, G*W_obs, d_h]
    scores = torch.matmul(grouped, keys.float().transpose(1, 2)) * scale  # [H_kv, G*W_obs, T]
    scores = scores.view(h_q, w_obs, length)
    visible = visibility_mask(q_positions, torch.arange(length, device=keys.device), window)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def visibility_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """True where key position j is visible to query position i: j <= i (and i - j < window)."""
    # Compared straight into bool: an int64 [Q, K] difference would cost 8x the mask's memory.
    visible = k_positions[None, :] <= q_positions[:, None]  # [Q, K]
    if window is not None:
        visible &= k_positions[None, :] > (q_positions - window)[:, None]
    return visible


def ragged_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over per-(request, K/V head) ragged rows (pad + mask).

    q `[B, H_q, d_h]`; keys/values `[B, H_kv, S, d_h]` (rows beyond a head's length are padding,
    any contents); lengths `[B, H_kv]`; hidden `[B, H_kv, S]` bool masks further rows
    (sliding window). Query head i reads K/V head i // G only. Softmax in fp32 -> `[B, H_q, d_h]`.
    """
    scores = _ragged_scores(q, keys, lengths, scale, hidden)  # [B, H_kv, G, S]
    return _ragged_output(scores, values)


def ragged_decode_attention_lse(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ragged_decode_attention` (same output, same arithmetic) plus, per request and query
    head, the log-sum-exp of the scaled logits over the rows that query sees `[B, H_q]` fp32
    (what recall bounds the omitted rows' softmax mass against)."""
    scores = _ragged_scores(q, keys, lengths, scale, hidden)  # [B, H_kv, G, S]
    lse = torch.logsumexp(scores, dim=-1).reshape(q.shape[0], -1)  # [B, H_q]
    return _ragged_output(scores, values), lse


def ragged_decode_attention_probs(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ragged_decode_attention` (same output, same arithmetic) plus the attention
    probabilities themselves `[B, H_kv, G, S]` fp32 (0 on padding and hidden rows): the
    evidence decode-time retention scores rows with (H2O, Scissorhands, Keyformer)."""
    scores = _ragged_scores(q, keys, lengths, scale, hidden)  # [B, H_kv, G, S]
    probs = torch.softmax(scores, dim=-1)
    batch, _, _, d_h = values.shape
    return torch.matmul(probs.to(values.dtype), values).view(batch, -1, d_h), probs


def _ragged_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden: torch.Tensor | None,
) -> torch.Tensor:
    """Scaled fp32 logits, -inf on padding and hidden rows.  # [B, H_kv, G, S]"""
    batch, h_kv, span, d_h = keys.shape
    grouped = q.view(batch, h_kv, -1, d_h)  # [B, H_kv, G, d_h]
    # keys @ q^T reads the [S, d_h] rows in storage order (faster on CPU than q @ keys^T).
    scores = torch.matmul(keys, grouped.transpose(-1, -2)).transpose(-1, -2)  # [B, H_kv, G, S]
    scores = scores.float().contiguous() * scale
    masked = torch.arange(span, device=q.device) >= lengths[..., None]  # [B, H_kv, S]
    if hidden is not None:
        masked |= hidden
    return scores.masked_fill_(masked[:, :, None, :], float("-inf"))


def _ragged_output(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ values: scores `[B, H_kv, G, S]`, values `[B, H_kv, S, d_h]`."""
    batch, _, _, d_h = values.shape
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(probs, values).view(batch, -1, d_h)


def varlen_decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's flash-attention varlen kernel: CUDA only, half precision only."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same result as `ragged_decode_attention` via torch's varlen flash kernel (CUDA).

    Every (request, K/V head) is its own sequence of `lengths[b, h]` valid rows inside a slot of
    `capacity` rows, whose single query token carries that head's G query heads.
    q `[B, H_q, d_h]`; key_cache/value_cache `[B, H_kv, capacity, d_h]` contiguous.
    """
    from torch.nn.attention.varlen import varlen_attn

    batch, h_kv, capacity, d_h = key_cache.shape
    sequences = batch * h_kv
    steps = torch.arange(sequences + 1, device=q.device, dtype=torch.int32)
    out = varlen_attn(
        q.reshape(sequences, -1, d_h),  # [B*H_kv, G, d_h]
        key_cache.reshape(sequences * capacity, 1, d_h),
        value_cache.reshape(sequences * capacity, 1, d_h),
        steps,
        steps * capacity,
        1,
        capacity,
        scale=scale,
        enable_gqa=True,
        seqused_k=lengths.reshape(-1).to(torch.int32),
    )  # [B*H_kv, G, d_h]
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were requested
    return out.reshape(batch, -1, d_h)


@dataclass(frozen=True)
class PagedChain:
    """Runs of `count` pages each whose first pool pages are `page0 + i * stride`: one strided
    view `[m, count * P, d_h]` of the pool, read in place. `seg` `[m]`: each run's segment;
    `first_row` `[m]`: the index of its first row in that segment (`offset`: not all 0);
    `tail`: some run holds its segment's last used page (the view stops at the longest run's
    last row, rows past a shorter one's are masked); `identity`: the runs are segments 0..S-1
    in order (the queries are read as they are)."""

    page0: int
    stride: int
    count: int
    seg: torch.Tensor
    first_row: torch.Tensor
    tail: bool
    identity: bool
    offset: bool  # some run starts past its segment's first row


@dataclass(frozen=True)
class PagedPlan:
    """Which pages one paged attention reads and how (runtime index tensors, reusable across
    steps while every (request, owner) uses the same pages, `matches`).

    `used` `[S]` pages per segment; `pages`, `seg`, `local` `[Np]`: every used page in segment
    order, its segment and its index there. `chains`: the runs of consecutive pool pages read
    in place (`PagedChain`); the other pages, `short` `[Ns]` indices into `pages`, are gathered
    into `grid` `[Nb * k]` (k = `block_pages` per block) at `slot`; a block's segment is
    `block_seg` `[Nb]`. `whole`: every segment is exactly one run, so each softmax is
    complete in one chain and nothing is gathered or merged (the common case: the pool places
    an owner's pages consecutively).

    A padded plan (`paged_plan`'s `pad_pages`) also has `first` `[S]`, each segment's first
    pool page, and `capacity` `[S]`, the pages its chain may read from there (rows past the
    segment's length are masked): it stays right while the pages change within them (`holds`),
    so decode growth and a recall's rows landing in place do not rebuild it."""

    used: torch.Tensor
    pages: torch.Tensor
    seg: torch.Tensor
    local: torch.Tensor
    chains: tuple[PagedChain, ...]
    short: torch.Tensor
    grid: torch.Tensor
    slot: torch.Tensor
    block_seg: torch.Tensor
    block_pages: int
    whole: bool
    first: torch.Tensor | None = None
    capacity: torch.Tensor | None = None

    def matches(self, used: torch.Tensor) -> bool:
        return self.used.shape == used.shape and bool(torch.equal(self.used, used))

    def holds(self, page_table: torch.Tensor, used: torch.Tensor) -> bool:
        """Whether this padded plan reads every row of page_table `[B, H, W]` with `used`
        `[B * H]` pages: each segment's pages are still `first`, `first + 1`, .. and no more
        than its `capacity` (a plan without them holds only for the pages it was built on)."""
        if self.first is None or self.capacity is None or self.used.shape != used.shape:
            return False
        if bool((used > self.capacity).any()):
            return False
        width = page_table.shape[-1]
        column = torch.arange(width, device=page_table.device)
        expected = self.first[:, None] + column  # [S, W]
        held = column < used[:, None]
        return bool(((page_table.reshape(used.numel(), width) == expected) | ~held).all())

    def padding(self) -> torch.Tensor:
        """The pool pages this padded plan may read past each segment's used pages  # [n]"""
        if self.first is None or self.capacity is None:
            return torch.zeros(0, dtype=torch.long, device=self.used.device)
        extra = self.capacity - self.used  # [S]
        seg = torch.repeat_interleave(torch.arange(extra.numel(), device=extra.device), extra)
        start = (self.first + self.used)[seg]
        return start + torch.arange(seg.numel(), device=extra.device) - (
            torch.cumsum(extra, 0) - extra)[seg]


def pages_used(lengths: torch.Tensor, page_rows: int) -> torch.Tensor:
    """Pages each (request, owner) of `lengths` `[B, H]` rows uses  # [B * H]"""
    return (lengths.reshape(-1) + page_rows - 1) // page_rows


# A plan whose segments are one run each reads them all in place when they form at most this
# many chains (one batched product each); more, and short runs are gathered into blocks.
WHOLE_CHAINS = 8


def paged_plan(page_table: torch.Tensor, used: torch.Tensor, block_pages: int = 4,
               run_pages: int = 32, page_rows: int = 1, pad_pages: int = 0,
               pool_pages: int | None = None) -> PagedPlan:
    """The plan of `paged_decode_attention` for page_table `[B, H, W]` and `used` `[B * H]`
    (`page_rows`: rows per page, for the chains' row offsets). A run of at least `run_pages`
    consecutive pool pages of one owner is read in place; so is every run when each segment
    is one run in at most `WHOLE_CHAINS` chains.

    `pad_pages` > 0 (with the pool's `pool_pages`): when each segment is one run, runs whose
    first pages are evenly spaced join one chain even when their page counts differ by up to
    `pad_pages`, each read up to the longest (rows past a segment's length masked), and every
    chain may read `pad_pages` more, within the pool: a layer whose owners hold different row
    counts (a recall's rows, per-head budgets) is still a few strided products, and the plan
    `holds` while owners grow into those pages. The pages read past a segment's rows must hold
    finite values (`PagedPlan.padding`; a masked row weighs 0, but 0 * NaN is NaN)."""
    device = page_table.device
    segments = used.numel()
    seg = torch.repeat_interleave(torch.arange(segments, device=device), used)  # [Np]
    local = torch.arange(seg.numel(), device=device) - (torch.cumsum(used, 0) - used)[seg]
    pages = page_table.reshape(segments, -1)[seg, local]  # [Np] in segment order
    in_run = torch.zeros_like(pages, dtype=torch.bool)
    chains: tuple[PagedChain, ...] = ()
    whole = False
    if pages.numel():
        breaks = torch.ones_like(in_run)
        breaks[1:] = (pages[1:] != pages[:-1] + 1) | (seg[1:] != seg[:-1])
        starts = breaks.nonzero()[:, 0]
        counts = torch.diff(starts, append=torch.tensor([pages.numel()], device=device))
        if starts.numel() == segments:  # every segment is one run
            if pad_pages > 0 and pool_pages is not None:
                chains, capacity = _padded_chains(pages[starts], used, pad_pages, pool_pages)
                if len(chains) <= WHOLE_CHAINS:
                    return PagedPlan(used, pages, seg, local, chains, pages[:0], pages[:0],
                                     pages[:0], pages[:0], block_pages, True, pages[starts],
                                     capacity)
            chains = _chains(seg, local, pages, used, starts, counts, page_rows, segments)
            whole = len(chains) <= WHOLE_CHAINS
        if not whole:
            long = counts >= run_pages
            in_run = torch.repeat_interleave(long, counts)
            chains = _chains(seg, local, pages, used, starts[long], counts[long], page_rows,
                             segments) if bool(long.any()) else ()
        else:
            in_run = torch.ones_like(in_run)
    short = (~in_run).nonzero()[:, 0]
    short_seg = seg[short]
    count = torch.bincount(short_seg, minlength=segments)  # [S] gathered pages per segment
    blocks = (count + block_pages - 1) // block_pages
    block_seg = torch.repeat_interleave(torch.arange(segments, device=device), blocks)  # [Nb]
    rank = torch.arange(short.numel(), device=device) - (torch.cumsum(count, 0) - count)[short_seg]
    slot = (torch.cumsum(blocks, 0) - blocks)[short_seg] * block_pages + rank
    # Unused slots of a segment's last block read some page (finite) with no row counted.
    filler = int(pages[0]) if pages.numel() else 0
    grid = torch.full((block_seg.numel() * block_pages,), filler, dtype=torch.long, device=device)
    grid[slot] = pages[short]
    return PagedPlan(used, pages, seg, local, chains, short, grid, slot, block_seg, block_pages,
                     whole)


def _padded_chains(first: torch.Tensor, used: torch.Tensor, pad_pages: int,
                   pool_pages: int) -> tuple[tuple[PagedChain, ...], torch.Tensor]:
    """Segments that are one run each, by first pool page `first` `[S]`, grouped into chains
    of evenly spaced runs whose page counts differ by at most `pad_pages`, each chain reading
    its longest run's pages plus `pad_pages` (within the pool) from every run's first page
    -> the chains and each segment's readable pages `[S]`."""
    run_page, run_count = first.tolist(), used.tolist()
    order = sorted(range(len(run_page)), key=lambda i: run_page[i])
    groups: list[list[int]] = [[order[0]]]
    low = high = run_count[order[0]]
    for index in order[1:]:
        chain = groups[-1]
        page, count = run_page[index], run_count[index]
        spaced = len(chain) == 1 or page - run_page[chain[-1]] == (
            run_page[chain[1]] - run_page[chain[0]])
        wide = max(high, count)
        if spaced and wide - min(low, count) <= pad_pages and page + wide <= pool_pages:
            chain.append(index)
            low, high = min(low, count), wide
            continue
        groups.append([index])
        low = high = count
    device, segments = first.device, len(run_page)
    capacity = [0] * segments
    chains = []
    for chain in groups:
        longest = max(run_count[i] for i in chain)
        readable = min(longest + pad_pages, pool_pages - run_page[chain[-1]])
        stride = run_page[chain[1]] - run_page[chain[0]] if len(chain) > 1 else readable
        for i in chain:
            capacity[i] = readable
        chains.append(PagedChain(
            run_page[chain[0]], stride, readable, torch.tensor(chain, device=device),
            torch.zeros(len(chain), dtype=torch.long, device=device), True,
            chain == list(range(segments)), False))
    return tuple(chains), torch.tensor(capacity, dtype=used.dtype, device=device)


def _chains(seg: torch.Tensor, local: torch.Tensor, pages: torch.Tensor, used: torch.Tensor,
            firsts: torch.Tensor, counts: torch.Tensor, page_rows: int,
            segments: int) -> tuple[PagedChain, ...]:
    """Runs (first index into `pages`, page count) grouped into chains: same page count, first
    pool pages evenly spaced. Once per plan, not per step."""
    run_seg, run_page = seg[firsts].tolist(), pages[firsts].tolist()
    run_local, run_count = local[firsts].tolist(), counts.tolist()
    last = [run_local[i] + run_count[i] == int(used[run_seg[i]]) for i in range(len(run_seg))]
    by_count: dict[int, list[int]] = {}
    for index, count in enumerate(run_count):
        by_count.setdefault(count, []).append(index)
    groups: list[tuple[int, list[int]]] = []
    for count, members in by_count.items():
        members.sort(key=lambda i: run_page[i])
        chain = [members[0]]
        for index in members[1:]:
            step = run_page[index] - run_page[chain[-1]]
            if len(chain) == 1 or step == run_page[chain[1]] - run_page[chain[0]]:
                chain.append(index)
                continue
            groups.append((count, chain))
            chain = [index]
        groups.append((count, chain))
    device = pages.device
    result = []
    for count, chain in groups:
        page0 = run_page[chain[0]]
        stride = run_page[chain[1]] - page0 if len(chain) > 1 else count
        owners = [run_seg[i] for i in chain]
        first_rows = [run_local[i] * page_rows for i in chain]
        result.append(PagedChain(
            page0, stride, count, torch.tensor(owners, dtype=torch.long, device=device),
            torch.tensor(first_rows, device=device), any(last[i] for i in chain),
            owners == list(range(segments)), any(first_rows)))
    return tuple(result)


def paged_decode_attention(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    hidden_at_or_before: torch.Tensor | None = None,
    page_positions: torch.Tensor | None = None,
    block_pages: int = 4,
    run_pages: int = 32,
    plan: PagedPlan | None = None,
    with_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query per request over each (request, owner)'s pages, and its log-sum-exp.

    q `[B, H_q, d_h]`; key_pages/value_pages `[N, P, d_h]` (a pool of P-row pages);
    page_table `[B, H, W]` page ids, the first ceil(lengths / P) of each (request, owner) in
    row order; lengths `[B, H]` rows held (>= 1). Query head i reads owner i // G.
    hidden_at_or_before `[B]`: rows whose original position (page_positions `[N, P]`) is at or
    before it are hidden (sliding window). Softmax in fp32 -> `[B, H_q, d_h]`, `[B, H_q]` fp32
    (None when not `with_lse`).

    Only the pages rows live in are read (`paged_plan`, or `plan` when the caller kept one that
    still matches): runs of consecutive pool pages in place, one product per chain of runs;
    every other page gathered, `block_pages` pages of one owner per block, one batched product
    per block. When every (request, owner) is one run (`PagedPlan.whole`), each chain's
    softmax is final; else each run and block yields a partial softmax (its max, sum and
    weighted values), combined per (request, owner) at the end.
    """
    batch, owners = lengths.shape
    rows = key_pages.shape[1]
    if plan is None:
        plan = paged_plan(page_table, pages_used(lengths, rows), block_pages, run_pages, rows)
    flat = lengths.reshape(-1)
    queries = q.reshape(batch * owners, -1, q.shape[-1])  # [S, G, d_h]
    window = None
    if hidden_at_or_before is not None and page_positions is not None:
        window = (hidden_at_or_before.repeat_interleave(owners), page_positions)
    if plan.whole:
        out, lse = _whole_runs(queries, key_pages, value_pages, plan, flat, scale, window,
                               with_lse)
        return out.reshape(batch, -1, q.shape[-1]).to(q.dtype), (
            None if lse is None else lse.reshape(batch, -1))
    parts = []
    if plan.chains:
        parts.append(_run_partials(queries, key_pages, value_pages, plan, flat, scale, window))
    if plan.short.numel():
        filled = (flat[plan.seg] - plan.local * rows).clamp_(max=rows)  # [Np] rows in each page
        parts.append(_block_partials(queries, key_pages, value_pages, plan, filled, scale, window))
    out, lse = _combine(parts, batch * owners, batch)
    return out.to(q.dtype), lse


Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # seg, max, sum, out
Window = tuple[torch.Tensor, torch.Tensor] | None  # oldest hidden position per segment, positions


def _chain_scores(queries: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                  chain: PagedChain, lengths: torch.Tensor, scale: float,
                  window: Window) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked fp32 logits `[m, G, span]` of one chain's runs over the pool's rows in place (no
    copy), and the values view `[m, span, d_h]` they weigh."""
    rows, d_h = key_pages.shape[1], key_pages.shape[2]
    key_pages, value_pages = key_pages.contiguous(), value_pages.contiguous()  # the pool: no-op
    span = chain.count * rows
    shape = (chain.seg.numel(), span, d_h)
    strides = (chain.stride * rows * d_h, d_h, 1)
    offset = chain.page0 * rows * d_h
    keys = key_pages.as_strided(shape, strides, key_pages.storage_offset() + offset)
    values = value_pages.as_strided(shape, strides, value_pages.storage_offset() + offset)
    masked = None
    if chain.tail:  # a run ending in its owner's last page, partly filled
        held = lengths if chain.identity else lengths.index_select(0, chain.seg)
        if chain.offset:
            held = held - chain.first_row
        low, high = (int(bound) for bound in torch.aminmax(held))
        span = min(span, high)  # rows past every run's last are not read at all
        keys, values = keys[:, :span], values[:, :span]
        if low < span:
            masked = torch.arange(span, device=held.device) >= held[:, None]  # [m, span]
    if not chain.identity:
        queries = queries.index_select(0, chain.seg)
    if queries.dtype == torch.float32:  # scaled before the product: G x d_h, not G x span
        scores = torch.bmm(queries * scale, keys.transpose(1, 2))
    else:
        scores = torch.bmm(queries, keys.transpose(1, 2)).float().mul_(scale)
    if window is not None:
        oldest, positions = window
        positions = positions.contiguous()  # the pool's: no-op
        at = positions.as_strided((shape[0], span), (chain.stride * rows, 1),
                                  positions.storage_offset() + chain.page0 * rows)
        hidden = at <= oldest.index_select(0, chain.seg)[:, None].to(positions.dtype)
        masked = hidden if masked is None else masked | hidden
    if masked is not None:
        scores.masked_fill_(masked[:, None, :], float("-inf"))  # [m, G, span]
    return scores, values


def _whole_runs(queries: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                plan: PagedPlan, lengths: torch.Tensor, scale: float, window: Window,
                with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every segment is one run: one complete softmax per chain, written to its segments
    -> `[S, G, d_h]` fp32 and the log-sum-exps `[S, G]` (None without `with_lse`). A segment's
    newest row is always visible, so no softmax is over hidden rows only."""
    segments, group, d_h = queries.shape
    out = lse = None
    for chain in plan.chains:
        scores, values = _chain_scores(queries, key_pages, value_pages, chain, lengths, scale,
                                       window)
        # The same output with or without the log-sum-exp (recall's capture path must compute
        # exactly what the plain path does).
        part_lse = torch.logsumexp(scores, dim=2) if with_lse else None
        part = torch.bmm(torch.softmax(scores, dim=2).to(values.dtype), values).float()
        if chain.identity:  # the only chain: its rows are the segments in order
            return part, part_lse
        if out is None:
            out = torch.empty(segments, group, d_h, device=queries.device)
            lse = torch.empty(segments, group, device=queries.device) if with_lse else None
        out.index_copy_(0, chain.seg, part)
        if lse is not None and part_lse is not None:
            lse.index_copy_(0, chain.seg, part_lse)
    assert out is not None  # a whole plan has a chain per segment
    return out, lse


def _run_partials(queries: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                  plan: PagedPlan, lengths: torch.Tensor, scale: float, window: Window) -> Partials:
    """One partial softmax per run, over the pool's rows in place (no copy): the runs of a
    chain are one strided view, one product."""
    segs, peaks, sums, outs = [], [], [], []
    for chain in plan.chains:
        scores, values = _chain_scores(queries, key_pages, value_pages, chain, lengths, scale,
                                       window)
        peak, weights, total = _softmax_parts(scores, dim=2)
        segs.append(chain.seg)
        peaks.append(peak)
        sums.append(total)
        outs.append(torch.bmm(weights.to(values.dtype), values).float())
    return torch.cat(segs), torch.cat(peaks), torch.cat(sums), torch.cat(outs)


def _block_partials(queries: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                    plan: PagedPlan, filled: torch.Tensor, scale: float,
                    window: Window) -> Partials:
    """One partial softmax per block of `block_pages` gathered pages of one segment."""
    rows, d_h = key_pages.shape[1], key_pages.shape[2]
    k, grid, block_seg = plan.block_pages, plan.grid, plan.block_seg
    span = k * rows
    grid_filled = torch.zeros_like(grid)
    grid_filled[plan.slot] = filled[plan.short]
    keys = key_pages.index_select(0, grid).view(-1, span, d_h)  # [Nb, k*P, d_h]
    # q @ keys^T: one [G, d_h] x [d_h, k*P] product per block (several times faster on CPU
    # than keys @ q^T for these thin shapes).
    scores = torch.bmm(queries.index_select(0, block_seg), keys.transpose(1, 2)).float() * scale
    masked = (torch.arange(rows, device=grid.device) >= grid_filled.view(-1, k, 1)).view(-1, span)
    if window is not None:
        oldest, positions = window
        held = positions.index_select(0, grid).view(-1, span)
        masked |= held <= oldest[block_seg, None].to(positions.dtype)
    scores.masked_fill_(masked[:, None, :], float("-inf"))  # [Nb, G, k*P]
    peak, weights, total = _softmax_parts(scores, dim=2)
    values = value_pages.index_select(0, grid).view(-1, span, d_h)  # [Nb, k*P, d_h]
    out = torch.bmm(weights.to(values.dtype), values).float()  # [Nb, G, d_h]
    return block_seg, peak, total, out


def _softmax_parts(
    scores: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """max, exp(scores - max) and its sum along `dim`. A part whose rows are all hidden gets
    max -inf and weights exp(-inf - finfo.min) = 0 (never exp(-inf - -inf) = NaN)."""
    peak = scores.amax(dim=dim)
    weights = torch.exp(scores - peak.clamp(min=torch.finfo(peak.dtype).min).unsqueeze(dim))
    return peak, weights, weights.sum(dim=dim)


def _combine(parts: list[Partials], segments: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial softmaxes per segment: out = sum_i e^(m_i - M) o_i / sum_i e^(m_i - M) s_i."""
    if len(parts) == 1:
        seg, peak, total, out = parts[0]
    else:
        seg = torch.cat([p[0] for p in parts])
        peak, total, out = (torch.cat([p[i] for p in parts]) for i in (1, 2, 3))
    group, d_h = out.shape[1], out.shape[2]
    best = torch.full((segments, group), float("-inf"), device=out.device)
    best.scatter_reduce_(0, seg[:, None].expand(-1, group), peak, "amax")  # finite: newest row
    factor = torch.exp(peak - best.index_select(0, seg))  # [n, G]; 0 for an all-hidden part
    norm = torch.zeros(segments, group, device=out.device).index_add_(0, seg, factor * total)
    merged = torch.zeros(segments, group, d_h, device=out.device)
    merged.index_add_(0, seg, factor[..., None] * out)
    result = (merged / norm[..., None]).reshape(batch, -1, d_h)
    lse = (best + torch.log(norm)).reshape(batch, -1)
    return result, lse


def paged_varlen_decode_attention(
    q: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    page_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_decode_attention`'s output via torch's varlen flash kernel (CUDA, half precision):
    every (request, owner)'s rows are gathered from its pages into one packed sequence, whose
    single query token carries that owner's G query heads. Arguments as there."""
    from torch.nn.attention.varlen import varlen_attn

    batch, owners = lengths.shape
    rows, d_h = key_pages.shape[1], key_pages.shape[2]
    segments = batch * owners
    flat = lengths.reshape(-1)
    seg = torch.repeat_interleave(torch.arange(segments, device=q.device), flat)  # [R]
    first = torch.cumsum(flat, 0) - flat
    local = torch.arange(seg.numel(), device=q.device) - first[seg]  # row index in segment
    page = page_table.reshape(segments, -1)[seg, local // rows]
    index = page * rows + local % rows  # [R] rows of the pool, segment after segment
    cu_k = torch.zeros(segments + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = torch.cumsum(flat, 0)
    cu_q = torch.arange(segments + 1, device=q.device, dtype=torch.int32)
    out = varlen_attn(
        q.reshape(segments, -1, d_h),  # [S, G, d_h]
        key_pages.reshape(-1, d_h)[index][:, None],  # [R, 1, d_h]
        value_pages.reshape(-1, d_h)[index][:, None],
        cu_q,
        cu_k,
        1,
        int(flat.max()),
        scale=scale,
        enable_gqa=True,
    )  # [S, G, d_h]
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were requested
    return out.reshape(batch, -1, d_h)
