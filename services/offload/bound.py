"""Query-aware recall: bound what omitted pages could add to a decode step, then pick pages.

This is Quest's page bound (ICML 2024) applied to omitted rows instead of resident ones.
For a query q (post-RoPE, like the cached keys), attention scale s (1/sqrt(d_h) unless the
model says otherwise) and a page whose keys satisfy min <= k <= max elementwise, every
row's logit obeys

    s * q.k  <=  b_p  =  s * sum_i max(q_i * min_i, q_i * max_i)  =  s * (q+ . max + q- . min)

with q+ = max(q, 0) and q- = min(q, 0). Let r be the log-sum-exp of the logits of the rows
the query does see (retained, decoded and already recalled rows) and n_p the row count of
page p. Since x / (e^r + x) grows with x, the softmax mass the omitted rows would take is

    omitted mass  <=  sum_p n_p e^{b_p} / (e^r + sum_p n_p e^{b_p})

summed over the pages still omitted. Everything after the page bounds is computed in log
space and float64; thresholds are compared as log-odds, so a threshold of 0 selects every
page that is still omitted, however small its bound. Per owner the bound is the maximum
over the query heads that read the owner's rows. Pure: tensors in, values out.

Ranking. The bound is safe but loose on a real model (SmolLM2-135M, 8-row pages: it sits a
median 13 nats above the page's true largest logit, and its top pages barely overlap the
pages that really take attention), so pages may instead be *ranked* by the midpoint estimate
s * q . (min + max) / 2, the logit of the box's centre (no bound: a ranking only, from the
same summaries). On the real model it puts the needle's pages first where the bound put them
hundreds deep (`docs/results/recall-smollm2/tuning.md`). `choose_pages` reads the
ranking from `Ranking`; the trigger (threshold, full-recall gate) always reads the bound.

Codes (`Ranking.CODES`, summaries with row codes: `recoverability.key_code_bits`). Neither
box-level ranking finds every page the copying heads read. With a few-bit code of every
omitted row's key coordinates inside its page's box, the decode worker estimates every
omitted row's logit, `page_code_log_odds` turns them into each page's estimated share
against the resident rows, and `choose_estimated` takes the best pages above a floor (a step
whose queries look nowhere omitted recalls nothing: the estimate, unlike the bound, is close
to the truth), each with the owner's next page. b-bit codes cost d_h b / 8 bytes a row on the wire
(4 bits: d_h / 2, what the fp16 min/max summaries of 8-row pages cost, 2 x 2 d_h bytes a page).
Scoring every omitted row reads the whole codes table each evaluated step; the page sketch
(each page's mean estimate and per-coordinate variance) scores every page at an eighth of the
reads, and only its best pages are scored row by row (`sketched_code_log_odds`).

The omitted-value term (summaries with page value means: `recoverability.omitted_value_term`).
The same estimated logits also say how much attention the pages that stay omitted would take,
and each page's mean value row says roughly what it would carry: `omitted_value_term` (the
whole table) and `layer_value_term` (one layer, as the decode step attends) give, per query
head, log sum_p m_p and sum_p m_p vbar_p / sum_p m_p with m_p = sum over page p's rows of
e^{s q . k^}, one more attention partial the decode cache merges with the resident rows'
(`DecodeCache.set_omitted_term`). An estimate of attention over all rows, never a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from services.kvpolicy.manifest import RecoverabilityContract
from services.offload import codes_kernel
from services.offload.errors import BoundInputInvalid
from services.offload.pages import PageRef, PageSummaries

# Rounding allowance. An attention logit s * q.k computed in float32 is within
# (d_h + 1) float32 unit roundoffs times s * sum_i |q_i| |k_i| of the exact one, and so is
# the page bound, now computed in float32 too (one batched product per step: float64 copies
# of every page's min and max cost more than the rest of the bound). With
# m_i = max(|min_i|, |max_i|) >= |k_i|, raising the computed bound by 16 (d_h + 1) unit
# roundoffs times s * sum_i |q_i| m_i (8 for each side, a wide margin over the (d_h + 3)
# needed), plus 2 (d_h + 2) smallest normal float32 numbers for underflow on both sides,
# keeps it above the exact logit and above a float32-accumulated one.
_ROUNDING_UNITS_PER_DIM = 16.0
_UNIT_ROUNDOFF = 2.0**-24
_SMALLEST_NORMAL = 2.0**-126
_UNDERFLOW_TERMS = 2


# Standard deviations of a page's row logits above its mean estimate that the page sketch
# scores it by (`sketch_page_scores`): on the tuning prompts (4K and 8K, 10%) the 1024 pages
# it scored best held every page the full scoring ranked first, and all of the estimated mass
# of the pages it chose but for one 4K multi-key step (75%) ("The page sketch", tuning.md).
# Not on prose, and no wider width or per-page ball does better (`recall.SKETCH_CANDIDATES`).
SKETCH_WIDTH = 2.5


@dataclass(frozen=True)
class RecallPolicy:
    """The recall knobs of a recoverability contract, in the form `choose_pages` reads.

    threshold: recall when an owner's omitted-mass bound exceeds it, in [0, 1).
    max_pages_per_step: pages recalled per evaluated step at most.
    full_recall_threshold: recall every omitted page when the bound exceeds it (optional,
        above `threshold`). cadence_steps: evaluate every N decode steps.
    """

    threshold: float
    max_pages_per_step: int
    full_recall_threshold: float | None = None
    cadence_steps: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold < 1.0:
            raise BoundInputInvalid("threshold", f"must be in [0, 1), got {self.threshold}")
        if self.max_pages_per_step < 1:
            raise BoundInputInvalid(
                "max_pages_per_step", f"must be positive, got {self.max_pages_per_step}"
            )
        full = self.full_recall_threshold
        if full is not None and not self.threshold < full < 1.0:
            raise BoundInputInvalid(
                "full_recall_threshold", f"must be in (threshold, 1), got {full}"
            )
        if self.cadence_steps < 1:
            raise BoundInputInvalid("cadence_steps", f"must be positive, got {self.cadence_steps}")

    @classmethod
    def from_contract(cls, contract: RecoverabilityContract) -> RecallPolicy:
        """The policy a recallable manifest declares."""
        if (
            not contract.recallable
            or contract.recall_threshold is None
            or contract.max_pages_per_step is None
            or contract.recall_cadence_steps is None
        ):
            raise BoundInputInvalid("recoverability.mode", f"{contract.mode.value} recalls nothing")
        return cls(
            threshold=contract.recall_threshold,
            max_pages_per_step=contract.max_pages_per_step,
            full_recall_threshold=contract.full_recall_on_quality_gate,
            cadence_steps=contract.recall_cadence_steps,
        )

    def due(self, step: int) -> bool:
        """Whether decode step `step` (0-based) evaluates the bound."""
        return step % self.cadence_steps == 0


class Ranking(StrEnum):
    """How `choose_pages` orders the candidate pages."""

    BOUND = "bound"  # the page's bounded share of its head's mass (Quest)
    MIDPOINT = "midpoint"  # the midpoint estimate's log-odds against the resident rows
    CODES = "codes"  # the rows' estimated logits (row codes) against the resident rows


@dataclass(frozen=True)
class RecallBound:
    """Page and omitted-mass bounds of one decode step, for every layer and query head."""

    page_bound: torch.Tensor  # [P_total, H_q] float64, -inf where the head reads another owner
    page_share: torch.Tensor  # [P_total] float64, log of the page's largest share of a head's bound
    page_segment: torch.Tensor  # [P_total] int64, layer * H_owner + owner
    live: torch.Tensor  # [P_total] bool, pages still omitted
    head_log_odds: torch.Tensor  # [L, H_q] float64, log(sum_p n_p e^{b_p}) - r
    owner_log_odds: torch.Tensor  # [L, H_owner] float64, max over the owner's reading heads
    # [P_total] float64, max over reading heads of  est_p + log n_p - r  (midpoint estimate
    # est_p; -inf for pages no longer live); None unless asked for
    page_estimate: torch.Tensor | None = None

    @property
    def head_mass_bound(self) -> torch.Tensor:
        """Bound on the omitted softmax mass per (layer, query head).  # [L, H_q] float64"""
        return torch.sigmoid(self.head_log_odds)

    @property
    def owner_mass_bound(self) -> torch.Tensor:
        """Per (layer, owner): the largest bound among the heads reading it.  # [L, H_owner]"""
        return torch.sigmoid(self.owner_log_odds)

    @property
    def max_mass_bound(self) -> float:
        return float(self.owner_mass_bound.max()) if self.owner_log_odds.numel() else 0.0


@dataclass(frozen=True)
class RecallChoice:
    """What one evaluated step recalls: flat page indices, best first."""

    pages: torch.Tensor  # [n] int64
    triggered: bool  # some owner's bound exceeded the threshold (codes: some page chosen)
    full_recall: bool  # the full-recall gate fired: every omitted page is chosen
    max_mass_bound: float | None  # None: not computed (codes ranking without a gate)

    def page_refs(self, summaries: PageSummaries) -> tuple[PageRef, ...]:
        return tuple(summaries.page_ref(int(p)) for p in self.pages)


def page_logit_bounds(
    summaries: PageSummaries,
    query: torch.Tensor,
    head_to_owner: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """b_p for every page and every query head reading the page's owner.  # [P_total, H_q]

    `query` is `[L, H_q, d_h]`; `head_to_owner[i]` is the owner whose rows query head i
    reads (its K/V head, or i itself when owners are query heads). Entries of heads that
    read another owner are -inf. `scale` defaults to 1/sqrt(d_h).
    """
    return _page_logits(summaries, query, head_to_owner, scale, estimate=False)[0]


def page_midpoint_logits(
    summaries: PageSummaries,
    query: torch.Tensor,
    head_to_owner: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """s * q . (min + max) / 2 per page and reading head (-inf elsewhere).  # [P_total, H_q]"""
    estimate = _page_logits(summaries, query, head_to_owner, scale, estimate=True)[1]
    assert estimate is not None
    return estimate


def _page_logits(
    summaries: PageSummaries,
    query: torch.Tensor,
    head_to_owner: Sequence[int],
    scale: float | None,
    *,
    estimate: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bound, and when `estimate` the midpoint estimate, both `[P_total, H_q]`."""
    owner_of_head = _check_query(summaries, query, head_to_owner)
    scale = _scale(scale, summaries.head_dim)
    q = query.detach().to(device=summaries.page_min.device, dtype=torch.float32)  # [L, H_q, d_h]
    tables = _tables(summaries)
    relative = _ROUNDING_UNITS_PER_DIM * (summaries.head_dim + 1) * _UNIT_ROUNDOFF
    absolute = _UNDERFLOW_TERMS * (summaries.head_dim + 2) * _SMALLEST_NORMAL
    q_pos, q_neg = q.clamp(min=0), q.clamp(max=0)  # [L, H_q, d_h]
    low, high, reach = tables.lhr
    mid: torch.Tensor | None = None
    if tables.even is not None:  # every layer holds as many pages: one batched product
        shape = (summaries.num_layers, tables.even, summaries.head_dim)
        low, high, reach = low.view(shape), high.view(shape), reach.view(shape)
        raw = high @ q_pos.mT + low @ q_neg.mT  # [L, P_l, H_q]
        slack = reach @ q.abs().mT * relative  # [L, P_l, H_q]
        out = (scale * (raw + slack)).reshape(summaries.num_pages, -1).double() + absolute
        if estimate:
            mid = (((low + high) @ q.mT) * (0.5 * scale)).reshape(summaries.num_pages, -1)
    else:
        out = torch.empty((summaries.num_pages, q.shape[1]), dtype=torch.float64)
        mid = torch.empty_like(out) if estimate else None
        for layer, (start, end) in enumerate(tables.ranges):
            raw = high[start:end] @ q_pos[layer].T + low[start:end] @ q_neg[layer].T  # [P_l, H_q]
            slack = reach[start:end] @ q[layer].abs().T * relative  # [P_l, H_q]
            out[start:end] = (scale * (raw + slack)).double() + absolute
            if mid is not None:
                mid[start:end] = (low[start:end] + high[start:end]) @ q[layer].T * (0.5 * scale)
    unread = tables.page_owner[:, None] != owner_of_head[None, :]  # [P_total, H_q]
    if mid is not None:  # a ranking, not a bound: float32 is enough
        mid = mid.double().masked_fill_(unread, -math.inf)
    return out.masked_fill_(unread, -math.inf), mid


@dataclass(frozen=True)
class _Tables:
    """What every bound of one summaries object reads (float32)."""

    lhr: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # min, max, max(|min|, |max|)
    page_owner: torch.Tensor  # [P_total] int64
    ranges: list[tuple[int, int]]  # per layer, [start, end) of its pages
    even: int | None  # pages per layer when every layer holds as many


def _tables(summaries: PageSummaries) -> _Tables:
    """The float32 tables of `summaries` (`PageSummaries.bound_extents`, computed once)."""
    ranges = summaries.layer_ranges
    return _Tables(
        lhr=summaries.bound_extents,
        page_owner=summaries.page_segment % summaries.num_owners,
        ranges=ranges,
        even=_even(ranges),
    )


def _even(ranges: list[tuple[int, int]]) -> int | None:
    """Pages per layer when every layer holds as many (and some), else None."""
    sizes = {end - start for start, end in ranges}
    size = sizes.pop() if len(sizes) == 1 else 0
    return size or None


def bound_omitted_mass(
    summaries: PageSummaries,
    query: torch.Tensor,
    retained_lse: torch.Tensor,
    head_to_owner: Sequence[int],
    *,
    live: torch.Tensor | None = None,
    scale: float | None = None,
    estimate: bool = False,
) -> RecallBound:
    """Page bounds and the omitted-mass bound of one decode step.

    `retained_lse` `[L, H_q]` is r per layer and query head, computed with the same scale;
    `live` `[P_total]` bool marks the pages still omitted (default: all), so recalled
    pages stop counting once their rows are visible (and inside r). `estimate` adds the
    midpoint ranking (`RecallBound.page_estimate`).
    """
    page_bound, mid = _page_logits(summaries, query, head_to_owner, scale, estimate=estimate)
    r = _check_lse(retained_lse, summaries.num_layers, int(query.shape[1]))  # [L, H_q]
    alive = _check_live(live, summaries.num_pages)  # [P_total]
    log_count = summaries.page_count.double().log()  # [P_total]
    layer_of_page = summaries.page_segment // summaries.num_owners  # [P_total]
    page_estimate = None
    if mid is not None:
        odds = (mid + log_count[:, None] - r[layer_of_page]).amax(dim=1)  # [P_total]
        page_estimate = odds.masked_fill(~alive, -math.inf)
    terms = (page_bound + log_count[:, None]).masked_fill(~alive[:, None], -math.inf)
    ranges = summaries.layer_ranges
    even = _even(ranges)
    if even is not None:
        log_mass = torch.logsumexp(terms.view(summaries.num_layers, even, -1), dim=1)
    else:
        log_mass = torch.stack(
            [torch.logsumexp(terms[start:end], dim=0) for start, end in ranges]
        )  # [L, H_q]
    log_odds = torch.where(log_mass == -math.inf, -math.inf, log_mass - r)  # [L, H_q]
    denominator = torch.logaddexp(r, log_mass)  # [L, H_q], log(e^r + sum_p n_p e^{b_p})
    share = torch.where(terms == -math.inf, -math.inf, terms - denominator[layer_of_page])
    return RecallBound(
        page_bound=page_bound,
        page_share=share.amax(dim=1),
        page_segment=summaries.page_segment,
        live=alive,
        head_log_odds=log_odds,
        owner_log_odds=_per_owner(log_odds, head_to_owner, summaries.num_owners),
        page_estimate=page_estimate,
    )


def choose_pages(
    bound: RecallBound,
    policy: RecallPolicy,
    ranking: Ranking = Ranking.BOUND,
    min_estimate: float | None = None,
) -> RecallChoice:
    """Pages to recall this step.

    Full recall when the largest owner bound exceeds `full_recall_threshold`: every page
    still omitted. Otherwise, when some owner's bound exceeds `threshold`, the pages of
    those owners ranked first, at most `max_pages_per_step` (ties: the lower page index
    first): by `page_share` (`Ranking.BOUND`) or by `page_estimate` (`Ranking.MIDPOINT`,
    which needs a bound computed with `estimate=True`). `min_estimate` (log-odds, midpoint
    ranking only) drops pages whose estimate is below it. Nothing when no bound exceeds
    the threshold.
    """
    live = bound.live  # [P_total]
    worst = bound.max_mass_bound
    top = float(bound.owner_log_odds.max()) if bound.owner_log_odds.numel() else -math.inf
    full = policy.full_recall_threshold
    if full is not None and top > _logit(full):
        pages = torch.nonzero(live)[:, 0]
        return RecallChoice(pages=pages, triggered=True, full_recall=True, max_mass_bound=worst)
    hot = (bound.owner_log_odds > _logit(policy.threshold)).flatten()  # [L * H_owner]
    candidate = live & hot[bound.page_segment]  # [P_total]
    score = bound.page_share
    if ranking is Ranking.MIDPOINT:
        if bound.page_estimate is None:
            raise BoundInputInvalid("ranking", "midpoint ranking needs bound(estimate=True)")
        score = bound.page_estimate
        if min_estimate is not None:
            candidate = candidate & (score >= min_estimate)
    elif min_estimate is not None:
        raise BoundInputInvalid("min_estimate", "only the midpoint ranking reads it")
    ranked = score.masked_fill(~candidate, -math.inf)
    order = torch.sort(ranked, descending=True, stable=True).indices
    take = min(policy.max_pages_per_step, int(candidate.sum()))
    return RecallChoice(
        pages=order[:take], triggered=bool(hot.any()), full_recall=False, max_mass_bound=worst
    )


@dataclass(frozen=True)
class CodeLogits:
    """One step's s q_h . k^_n for every slot of the codes table (`CodeTable`) and every
    query head h reading the slot's owner: what `page_code_log_odds` ranks pages by and
    `omitted_value_term` weighs page values with, computed once for both."""

    logits: torch.Tensor  # [S, G, slots] float32, heads of owner s in `readers[s % H_owner]` order
    readers: torch.Tensor  # [H_owner, G] int64, the query heads reading each owner


@dataclass(frozen=True)
class ValueTerm:
    """What the still-omitted pages add to one step's attention, per layer and query head, as
    one more attention partial: an estimated mass e^log_mass carrying `value`. Merged with
    the resident rows' partial (output o, log-sum-exp r) it gives (e^r o + e^M V) / (e^r + e^M)
    (`DecodeCache.set_omitted_term`)."""

    log_mass: torch.Tensor  # [L, H_q] float32, log sum over live pages of sum_n e^{s q . k^_n}
    value: torch.Tensor  # [L, H_q, d_h] float32, the live pages' mean values weighted by mass

    @property
    def empty(self) -> bool:
        """No live page: the term adds nothing."""
        return not bool(torch.isfinite(self.log_mass).any())


def code_logits(
    summaries: PageSummaries,
    query: torch.Tensor,
    head_to_owner: Sequence[int],
    *,
    scale: float | None = None,
) -> CodeLogits:
    """s q_h . k^_n for every code slot and reading head (k^_n: the row's key as its code
    places it, `PageSummaries.row_estimates`): one pass over the whole table
    (`codes_kernel.block_logits`; heads first: the reductions after it run over contiguous
    slots)."""
    grouped_q, readers = _grouped_query(summaries, query, head_to_owner, scale)  # [S, G, d_h]
    table = summaries.code_table
    logits = codes_kernel.block_logits(grouped_q, table.estimates, summaries.head_dim, table.block)
    return CodeLogits(logits, readers)


def layer_page_lse(
    summaries: PageSummaries,
    layer: int,
    query: torch.Tensor,
    retained_lse: torch.Tensor,
    readers: torch.Tensor,
    *,
    scale: float | None = None,
    logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """`page_code_log_odds`' page log-sum-exps of one layer's owner segments, from that
    layer's queries `[H_q, d_h]` and r `[H_q]` alone (`readers`: `owner_readers`), equal to the
    whole table's to the bit (the kernel scores segments independently): a layer is scored as
    soon as its attention is in, while the later layers of the step still run. `logits`: the
    layer's code logits `[H_owner, G, slots]` when already computed (`LayerTerm.logits`), read
    instead of the table (the same values to the bit).
    # [H_owner, slots / page_size] float32"""
    if not 0 <= layer < summaries.num_layers:
        raise BoundInputInvalid("layer", f"must be in [0, {summaries.num_layers}), got {layer}")
    if logits is not None:
        return _page_lse_of_logits(summaries, layer, logits, retained_lse, readers)
    owners, table = summaries.num_owners, summaries.code_table
    r = retained_lse.detach().double().cpu()[readers].float()  # [H_owner, G]
    rows = slice(layer * owners, (layer + 1) * owners)
    q = query.detach().float().cpu() * _scale(scale, summaries.head_dim)  # [H_q, d_h]
    return codes_kernel.block_page_lse(q[readers], r, table.estimates[rows],
                                       table.slot_bias[rows], summaries.head_dim, table.block,
                                       summaries.page_size)


def start_layer_page_lse(
    summaries: Sequence[PageSummaries], layer: int, logits: Sequence[torch.Tensor],
    retained_lse: torch.Tensor, rows: Sequence[int], readers: Sequence[torch.Tensor],
) -> Callable[[], list[torch.Tensor]]:
    """`layer_page_lse` from the layer's code logits for several requests (request i: its
    summaries, its logits `[H_owner, G, slots]` (`LayerTerm.logits`), its row of the step's r
    `retained_lse` `[B, H_q]` and its readers), started on the kernel's own thread while the
    caller goes on (`codes_kernel.start_pages_lse_of`); returns the function that waits for
    them, each `[H_owner, slots / page_size]` to the bit `layer_page_lse`'s. Where the kernel
    does not take them all they are computed here, request by request, before this returns."""
    tables = [one.code_table for one in summaries]
    if any(not 0 <= layer < one.num_layers for one in summaries):
        raise BoundInputInvalid("layer", f"{layer} is not a layer of every request")
    bias = [table.slot_bias[layer * one.num_owners:(layer + 1) * one.num_owners]
            for one, table in zip(summaries, tables, strict=True)]
    pending = codes_kernel.start_pages_lse_of(
        logits, retained_lse.detach().cpu(), rows, readers, bias,
        [table.block for table in tables], [one.page_size for one in summaries])
    if pending is not None:
        return lambda: [parts[0] for parts in pending.wait()]
    pages = [_page_lse_of_logits(one, layer, part, retained_lse[row], heads)
             for one, part, row, heads in zip(summaries, logits, rows, readers, strict=True)]
    return lambda: pages


def _page_lse_of_logits(summaries: PageSummaries, layer: int, logits: torch.Tensor,
                        retained_lse: torch.Tensor, readers: torch.Tensor) -> torch.Tensor:
    """`layer_page_lse` from the layer's code logits `[H_owner, G, slots]` and r `[H_q]`.
    # [H_owner, slots / page_size] float32"""
    owners, table = summaries.num_owners, summaries.code_table
    r = retained_lse.detach().double().cpu()[readers].float()  # [H_owner, G]
    return codes_kernel.page_lse_of(logits, r, table.slot_bias[layer * owners:(layer + 1) * owners],
                                    table.block, summaries.page_size)


def page_code_log_odds(
    summaries: PageSummaries,
    query: torch.Tensor,
    retained_lse: torch.Tensor,
    head_to_owner: Sequence[int],
    *,
    live: torch.Tensor | None = None,
    scale: float | None = None,
    logits: CodeLogits | None = None,
    page_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per page, log(estimated mass of its rows / resident mass): logsumexp over the page's
    rows n of max over the reading heads h of s * q_h . k^_n - r_h, with k^_n the row's key as
    its code places it (`PageSummaries.row_estimates`). An estimate, not a bound (the codes
    round each coordinate to 2^b levels of its page's box). -inf for pages not `live`.
    `logits`: this step's `code_logits`, when already computed; `page_lse`: the page
    log-sum-exps `[S, slots / page_size]` themselves, scored layer by layer as the step ran
    (`layer_page_lse`).  # [P_total] float64

    Why: the Quest bound sits ~13 nats above a real model's true page logits and ranks the
    needle's pages hundreds deep; the codes' estimates rank them first (1-bit codes already:
    `docs/results/recall-smollm2/tuning.md`), and say how much a page would really add, so
    they can also decide whether a step recalls at all (`RecallStrategy.min_estimate`).
    """
    alive = _check_live(live, summaries.num_pages)
    table = summaries.code_table
    # Per slot its most attentive reader, at least the largest head's estimate and at most
    # log(G) below a sum over heads, at a third of the work (this runs at every evaluated
    # step over every omitted row); then a log-sum-exp over each page's slots (unused slots
    # are -inf). Without this step's logits, one pass of the kernel over the table.
    if page_lse is not None:
        _check_query(summaries, query, head_to_owner)
        _check_lse(retained_lse, summaries.num_layers, int(query.shape[1]))
        grid = (summaries.num_layers * summaries.num_owners,
                table.slot_bias.shape[1] // summaries.page_size)
        if tuple(page_lse.shape) != grid:
            raise BoundInputInvalid("page_lse", f"shape {tuple(page_lse.shape)}, expected {grid}")
        pages = page_lse.flatten()
    elif logits is None:
        grouped, readers = _grouped_query(summaries, query, head_to_owner, scale)
        grouped_r = _grouped_lse(retained_lse, query, readers, summaries.num_layers)
        pages = codes_kernel.block_page_lse(grouped, grouped_r[:, :, 0], table.estimates,
                                            table.slot_bias, summaries.head_dim, table.block,
                                            summaries.page_size).flatten()
    else:
        grouped_r = _grouped_lse(retained_lse, query, logits.readers, summaries.num_layers)
        pages = codes_kernel.page_lse_of(logits.logits, grouped_r[:, :, 0], table.slot_bias,
                                         table.block, summaries.page_size).flatten()
    odds = pages.index_select(0, table.page_slot).double()  # [P_total]
    return odds.masked_fill_(~alive, -math.inf)


def sketch_page_scores(
    summaries: PageSummaries,
    query: torch.Tensor,
    retained_lse: torch.Tensor,
    head_to_owner: Sequence[int],
    *,
    live: torch.Tensor | None = None,
    scale: float | None = None,
    width: float = SKETCH_WIDTH,
) -> torch.Tensor:
    """Per page, a cheap stand-in for `page_code_log_odds` read from the page sketch
    (`PageSummaries.page_sketch`): max over the reading heads h of
    s q_h . mu_p + width * sqrt(sum_c (s q_hc)^2 var_pc) - r_h, the page's mean estimated logit
    raised by `width` standard deviations of its rows' logits around it (coordinates taken as
    independent). Neither a bound nor the page's log-odds: it picks which pages
    `candidate_code_log_odds` scores row by row. -inf for pages not `live`.  # [P_total] float32

    Why: reading the whole codes table is what an evaluated step costs (memory-bound: 45 MB a
    request at 4K and 10%), and the sketch is an eighth of it a coordinate. Its mean alone
    misses pages one row of which takes the attention (`SKETCH_WIDTH`)."""
    grouped, readers = _grouped_query(summaries, query, head_to_owner, scale)
    r = _grouped_lse(retained_lse, query, readers, summaries.num_layers)  # [S, G, 1]
    return _sketch_scores(summaries, grouped, r, _check_live(live, summaries.num_pages), width)


def candidate_code_log_odds(
    summaries: PageSummaries,
    query: torch.Tensor,
    retained_lse: torch.Tensor,
    head_to_owner: Sequence[int],
    pages: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """`page_code_log_odds` of `pages` `[C]` (flat page indices) only, reading only their
    rows of the codes table: what the full scoring gives those pages, up to the order of a
    bfloat16 product's sums.  # [C] float64"""
    index = pages.long()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= summaries.num_pages):
        raise BoundInputInvalid("pages", f"entries must be pages in [0, {summaries.num_pages})")
    grouped, readers = _grouped_query(summaries, query, head_to_owner, scale)
    r = _grouped_lse(retained_lse, query, readers, summaries.num_layers)  # [S, G, 1]
    return _candidate_odds(summaries, grouped, r, index)


def sketched_code_log_odds(
    summaries: PageSummaries,
    query: torch.Tensor,
    retained_lse: torch.Tensor,
    head_to_owner: Sequence[int],
    candidates: int,
    *,
    live: torch.Tensor | None = None,
    scale: float | None = None,
    width: float = SKETCH_WIDTH,
) -> torch.Tensor:
    """`page_code_log_odds` of the `candidates` live pages the sketch scores best
    (`sketch_page_scores`), -inf for every other page: the codes ranking at a fraction of
    the reads, exact wherever the pages it would choose are among the candidates.
    # [P_total] float64"""
    if candidates < 1:
        raise BoundInputInvalid("candidates", f"must be positive, got {candidates}")
    grouped, readers = _grouped_query(summaries, query, head_to_owner, scale)
    r = _grouped_lse(retained_lse, query, readers, summaries.num_layers)  # [S, G, 1]
    scores = _sketch_scores(summaries, grouped, r, _check_live(live, summaries.num_pages), width)
    take = min(candidates, int(torch.isfinite(scores).sum()))
    odds = torch.full((summaries.num_pages,), -math.inf, dtype=torch.float64)
    if take == 0:
        return odds
    chosen = scores.topk(take).indices
    return odds.index_copy_(0, chosen, _candidate_odds(summaries, grouped, r, chosen))


def _sketch_scores(summaries: PageSummaries, grouped: torch.Tensor, r: torch.Tensor,
                   alive: torch.Tensor, width: float) -> torch.Tensor:
    """`sketch_page_scores` from grouped s q `[S, G, d_h]` and r `[S, G, 1]`.  # [P_total]"""
    sketch = summaries.page_sketch
    low = grouped.to(sketch.mean.dtype)
    centre = torch.bmm(low, sketch.mean).float()  # [S, G, pages]
    spread = torch.bmm(grouped.square().to(low.dtype), sketch.variance).float()
    best = centre.add_(spread.clamp_(min=0.0).sqrt_().mul_(width)).sub_(r).amax(dim=1)
    scores = best.flatten().index_select(0, summaries.code_table.page_slot)  # [P_total]
    return scores.masked_fill_(~alive, -math.inf)


def _candidate_odds(summaries: PageSummaries, grouped: torch.Tensor, r: torch.Tensor,
                    pages: torch.Tensor) -> torch.Tensor:
    """`candidate_code_log_odds` from grouped s q and r (`_sketch_scores`).  # [C] float64"""
    table, size, dim = summaries.code_table, summaries.page_size, summaries.head_dim
    slots = table.slot_bias.shape[1]
    width = slots // size  # pages a segment
    cell = table.page_slot.index_select(0, pages)  # [C] in the [S * pages] grid
    segment, local = cell // width, cell % width
    # Page p's coordinate c is a run of `size` slots of its block `[d_h, span]` (`span` slots:
    # `table.block`, or fewer in a segment's last block); the table seen as rows of `size`
    # slots, one row gather (4x a fancy index's speed).
    per_block = table.block // size  # pages a full block
    first = (local // per_block) * per_block  # the block's first page
    span = torch.clamp(width - first, max=per_block)  # pages the block holds
    start = segment * (dim * width) + first * dim  # the block's first row of `size` slots
    runs = ((start + local - first)[:, None] + torch.arange(dim) * span[:, None]).flatten()
    rows = table.estimates.view(-1, size).index_select(0, runs).view(-1, dim, size)
    logits = codes_kernel.row_logits(grouped[segment], rows, table.block)  # [C, G, size]
    bias = table.slot_bias.view(-1, width, size)[segment, local]  # [C, size]
    best = logits.sub_(r[segment]).amax(dim=1).add_(bias)  # [C, size]
    return best.logsumexp(dim=1).double()


def _grouped_query(summaries: PageSummaries, query: torch.Tensor, head_to_owner: Sequence[int],
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """s q grouped by owner segment: `[S, G, d_h]` float32 (segment l * H_owner + o holds
    the heads reading owner o of layer l, in `readers[o]` order), and readers `[H_owner, G]`."""
    owner_of_head = _check_query(summaries, query, head_to_owner)
    q = query.detach().float().cpu() * _scale(scale, summaries.head_dim)  # [L, H_q, d_h]
    readers = _readers(owner_of_head, summaries.num_owners)
    return q[:, readers].reshape(-1, readers.shape[1], q.shape[-1]), readers


def _grouped_lse(retained_lse: torch.Tensor, query: torch.Tensor, readers: torch.Tensor,
                 layers: int) -> torch.Tensor:
    """r grouped like `_grouped_query`.  # [S, G, 1] float32"""
    r = _check_lse(retained_lse, layers, int(query.shape[1]))  # [L, H_q]
    return r[:, readers].reshape(-1, readers.shape[1], 1).float()


def omitted_value_term(
    summaries: PageSummaries, logits: CodeLogits, live: torch.Tensor | None = None
) -> ValueTerm:
    """What the `live` pages (default: all) would add to this step's attention, estimated
    from their rows' codes and their mean values (`PageSummaries.page_value_mean`): per
    query head h, m_p = sum over page p's rows of e^{s q_h . k^_n}, and the term's mass
    sum_p m_p carrying sum_p m_p vbar_p / sum_p m_p. Two approximations: each row's key is its
    code's, and each row's value its page's mean (8-row pages of neighbouring positions).

    Why: on SmolLM2-135M at 8K and 10%, recall alone and this term alone each miss a needle
    that both together answer (`docs/results/recall-smollm2/tuning.md`, "The omitted mass's
    value"): attention that is spread over thousands of omitted rows is not worth fetching
    row by row, but its sum still moves the output."""
    alive = _check_live(live, summaries.num_pages)
    _, _, mass, value = codes_kernel.value_term_of(
        logits.logits, live_bias(summaries, alive), summaries.value_grid, summaries.page_size)
    heads, by_layer = logits.readers.flatten(), (summaries.num_layers, summaries.num_owners)
    return ValueTerm(_to_heads(mass.unflatten(0, by_layer), heads, dim=1),
                     _to_heads(value.unflatten(0, by_layer), heads, dim=1))


def live_bias(summaries: PageSummaries, live: torch.Tensor) -> torch.Tensor:
    """The codes table's slot bias with the slots of pages not `live` `[P_total]` at -inf
    too: 0 for a row of a live page, else -inf.  # [S, slots] float32"""
    alive = live_grid(summaries, live).repeat_interleave(summaries.page_size, dim=1)
    return summaries.code_table.slot_bias.masked_fill(~alive, -math.inf)  # alive [S, slots]


@dataclass(frozen=True)
class TermInputs:
    """What one request's omitted-value term of one layer reads besides the query, fixed
    between recalls (`term_inputs`): the layer's owner segments, its readers, and its rows of
    the codes table, the live bias and the value grid, as the kernel takes them."""

    segments: slice
    readers: torch.Tensor  # [H_owner, G] int64
    estimates: torch.Tensor  # [H_owner, d_h * slots] bfloat16, contiguous rows
    bias: torch.Tensor  # [H_owner, slots] float32, contiguous
    grid: torch.Tensor  # [H_owner, slots / page_size, d_h] bfloat16, contiguous
    head_dim: int
    block: int
    page_size: int


def term_inputs(summaries: PageSummaries, layer: int, readers: torch.Tensor,
                bias: torch.Tensor) -> TermInputs:
    """Layer l's `TermInputs` (`readers`: `CodeLogits.readers`; `bias`: `live_bias`)."""
    owners = summaries.num_owners
    segments = slice(layer * owners, (layer + 1) * owners)
    table = summaries.code_table
    return TermInputs(segments, readers.contiguous(), table.estimates[segments],
                      bias[segments].float().contiguous(),
                      summaries.value_grid[segments].contiguous(), summaries.head_dim,
                      table.block, summaries.page_size)


def layer_value_term(
    summaries: PageSummaries, layer: int, query: torch.Tensor, readers: torch.Tensor,
    bias: torch.Tensor, scale: float,
) -> LayerTerm:
    """`omitted_value_term` for one layer's query `[H_q, d_h]` (in the decode step, as the
    layer attends), with what it was computed from: the layer's code logits (which the
    step's recall plan reads instead of scoring again) and its pages' masses (from which
    `LayerTerm.without` takes pages out once recalled). `readers`: `CodeLogits.readers`;
    `bias`: `live_bias`."""
    return start_layer_value_terms([(term_inputs(summaries, layer, readers, bias), query)],
                                   scale)()[0]


def start_layer_value_terms(calls: Sequence[tuple[TermInputs, torch.Tensor]],
                            scale: float) -> Callable[[], list[LayerTerm]]:
    """`layer_value_term` of one layer for several requests (each its inputs and query
    `[H_q, d_h]`), started on the kernel's own thread (`codes_kernel.start_layers_value_term`)
    while the caller goes on (the decode step attends over the rows meanwhile); returns the
    function that waits for the terms. Where the kernel does not take them all they are
    computed here in torch, request by request, before this returns."""
    queries = [query.detach().to(dtype=torch.float32, device=inputs.estimates.device)
               for inputs, query in calls]
    pending = None
    if len({inputs.head_dim for inputs, _ in calls}) == 1:
        pending = codes_kernel.start_layers_value_term(
            queries, [inputs.readers for inputs, _ in calls], scale,
            [inputs.estimates for inputs, _ in calls], [inputs.bias for inputs, _ in calls],
            [inputs.grid for inputs, _ in calls], calls[0][0].head_dim,
            [inputs.block for inputs, _ in calls], [inputs.page_size for inputs, _ in calls])
    if pending is None:
        terms = [_torch_value_term(inputs, q, scale) for (inputs, _), q in zip(calls, queries, strict=True)]
        return lambda: terms

    def wait() -> list[LayerTerm]:
        return [LayerTerm(mass, value, logits, page_mass, top, inputs.segments,
                          inputs.readers.flatten())
                for (logits, page_mass, top, mass, value), (inputs, _)
                in zip(pending.wait(), calls, strict=True)]

    return wait


def _torch_value_term(inputs: TermInputs, query: torch.Tensor, scale: float) -> LayerTerm:
    """`layer_value_term` where the kernel does not run (`codes_kernel.block_value_term`'s
    torch path). `query` `[H_q, d_h]` float32."""
    logits, page_mass, top, mass, value = codes_kernel.block_value_term(
        (query * scale)[inputs.readers], inputs.estimates, inputs.bias, inputs.grid,
        inputs.head_dim, inputs.block, inputs.page_size)  # logits [H_owner, G, slots]
    heads = inputs.readers.flatten()
    return LayerTerm(_to_heads(mass, heads), _to_heads(value, heads), logits, page_mass, top,
                     inputs.segments, heads)


@dataclass(frozen=True)
class LayerTerm:
    """One layer's omitted-value term (`layer_value_term`)."""

    log_mass: torch.Tensor  # [H_q] float32
    value: torch.Tensor  # [H_q, d_h] float32
    logits: torch.Tensor  # [H_owner, G, slots] float32, the layer's code logits
    page_mass: torch.Tensor  # [H_owner, G, pages] float32, each page's mass / e^top
    top: torch.Tensor  # [H_owner, G, 1] float32
    segments: slice  # the layer's owner segments
    heads: torch.Tensor  # [H_q] int64, the query head of each (owner, reader)

    def without(self, summaries: PageSummaries, grid_live: torch.Tensor) -> LayerTerm:
        """The same term with only the pages `grid_live` `[S, pages]` (`live_grid`) still
        counted: recalled pages taken out, their mass and value, with the masses of the
        query that computed the term (no code logits are read again)."""
        page_mass = self.page_mass * grid_live[self.segments, None, :]
        mass, value = codes_kernel.term_of(page_mass, self.top,
                                           summaries.value_grid[self.segments])
        return replace(self, log_mass=_to_heads(mass, self.heads),
                       value=_to_heads(value, self.heads), page_mass=page_mass)


def take_out_pages(summaries: PageSummaries, gone: torch.Tensor, bias: torch.Tensor,
                   grid: torch.Tensor) -> None:
    """Pages `gone` `[P_total]` bool taken out of a `live_bias` and its `live_grid`, in place:
    their slots -inf, their grid entries False (what both give for the live pages less these,
    without building either again over the whole table)."""
    page_slot = summaries.code_table.page_slot[torch.nonzero(gone)[:, 0]]  # [n] grid indices
    grid.view(-1)[page_slot] = False
    size = summaries.page_size
    slots = (page_slot[:, None] * size + torch.arange(size)).flatten()
    bias.view(-1)[slots] = -math.inf


def live_grid(summaries: PageSummaries, live: torch.Tensor) -> torch.Tensor:
    """`live` `[P_total]` laid out like the codes table's pages.  # [S, pages] bool"""
    table = summaries.code_table
    segments, slots = table.slot_bias.shape
    grid = torch.zeros(segments * (slots // summaries.page_size), dtype=torch.bool)
    grid[table.page_slot] = live
    return grid.view(segments, -1)


def _to_heads(part: torch.Tensor, heads: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`part` with its owner and reader dims (`dim`, `dim + 1`) as one query-head dim: entry
    (o, g) goes to query head `heads[o * G + g]`."""
    flat = part.flatten(dim, dim + 1)
    return torch.empty_like(flat).index_copy_(dim, heads, flat)


def _readers(owner_of_head: torch.Tensor, owners: int) -> torch.Tensor:
    """The query heads reading each owner, `[H_owner, G]` (every owner is read by as many
    heads under GQA; fewer for some owner is not a layout a checkpoint has)."""
    groups = [torch.nonzero(owner_of_head == o)[:, 0] for o in range(owners)]
    if len({g.numel() for g in groups}) != 1:
        raise BoundInputInvalid("head_to_owner", "owners are read by different numbers of heads")
    return torch.stack(groups)


def choose_estimated(
    page_log_odds: torch.Tensor,
    live: torch.Tensor,
    max_pages: int,
    min_log_odds: float | None,
    page_segment: torch.Tensor,
    successors: int = 0,
) -> torch.Tensor:
    """At most `max_pages` pages, best estimate first (ties: the lower index), none below
    `min_log_odds`; each ranked page is followed by its owner's next `successors` live pages
    (a copied span is read forward: the rows after a recalled page are the next steps'),
    within the same cap.  # [n] int64"""
    candidate = live & torch.isfinite(page_log_odds)
    if min_log_odds is not None:
        candidate &= page_log_odds >= min_log_odds
    ranked = page_log_odds.masked_fill(~candidate, -math.inf)
    take = min(max_pages, int(candidate.sum()))
    order = _top(ranked, take)
    if not successors:
        return torch.tensor(order, dtype=torch.long)
    chosen: dict[int, None] = {}
    reach = 4 * successors  # pages looked at after a ranked one
    for page in order:
        chosen.setdefault(page)
        # Only the window after the page is read (not the whole [P_total] as lists: this runs
        # at every evaluated step of every session).
        window = slice(page, page + reach + 1)
        own, alive = page_segment[window].tolist(), live[window].tolist()
        found = 0
        for offset in range(1, len(own)):
            if found == successors or own[offset] != own[0]:
                break
            after = page + offset
            if alive[offset] and after not in chosen:
                chosen[after] = None
                found += 1
        if len(chosen) >= max_pages:
            break
    return torch.tensor(list(chosen)[:max_pages], dtype=torch.long)


def _top(values: torch.Tensor, take: int) -> list[int]:
    """The indices of the `take` largest `values`, largest first, ties to the lower index: a
    stable descending sort's first `take`, without sorting all of them (a full sort of 42K
    pages took 3 ms a call)."""
    if take <= 0:
        return []
    last = values.topk(take).values[-1]
    above = torch.nonzero(values > last)[:, 0]
    tied = torch.nonzero(values == last)[:, 0][: take - above.numel()]
    picked = torch.cat([above, tied]).sort().values  # ascending index
    return picked[torch.sort(values[picked], descending=True, stable=True).indices].tolist()


def _scale(scale: float | None, head_dim: int) -> float:
    value = head_dim**-0.5 if scale is None else float(scale)
    if not math.isfinite(value) or value <= 0:
        raise BoundInputInvalid("scale", f"must be a positive finite number, got {scale}")
    return value


def _check_query(
    summaries: PageSummaries, query: torch.Tensor, head_to_owner: Sequence[int]
) -> torch.Tensor:
    expected = (summaries.num_layers, len(head_to_owner), summaries.head_dim)
    if tuple(query.shape) != expected:
        raise BoundInputInvalid(
            "query", f"shape {tuple(query.shape)}, expected [L, H_q, d_h] = {expected}"
        )
    if not query.dtype.is_floating_point or not bool(torch.isfinite(query).all()):
        raise BoundInputInvalid("query", "must hold finite floating-point values")
    return _check_heads(summaries, head_to_owner)


def owner_readers(summaries: PageSummaries, head_to_owner: Sequence[int]) -> torch.Tensor:
    """The query heads reading each owner, `[H_owner, G]` (`CodeLogits.readers`)."""
    return _readers(_check_heads(summaries, head_to_owner), summaries.num_owners)


def _check_heads(summaries: PageSummaries, head_to_owner: Sequence[int]) -> torch.Tensor:
    owners = summaries.num_owners
    if any(
        isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < owners for o in head_to_owner
    ):
        raise BoundInputInvalid("head_to_owner", f"every entry must be an owner in [0, {owners})")
    unread = sorted(set(range(owners)) - set(head_to_owner))
    if unread:
        raise BoundInputInvalid("head_to_owner", f"owners {unread} are read by no query head")
    return torch.tensor(list(head_to_owner), dtype=torch.long)


def _check_lse(retained_lse: torch.Tensor, num_layers: int, num_heads: int) -> torch.Tensor:
    if tuple(retained_lse.shape) != (num_layers, num_heads):
        raise BoundInputInvalid(
            "retained_lse",
            f"shape {tuple(retained_lse.shape)}, expected [{num_layers}, {num_heads}]",
        )
    r = retained_lse.detach().double().cpu()
    if bool(torch.isnan(r).any()) or bool((r == math.inf).any()):
        raise BoundInputInvalid("retained_lse", "must be finite or -inf (no visible row)")
    return r


def _check_live(live: torch.Tensor | None, num_pages: int) -> torch.Tensor:
    if live is None:
        return torch.ones(num_pages, dtype=torch.bool)
    if live.dtype != torch.bool or tuple(live.shape) != (num_pages,):
        raise BoundInputInvalid(
            "live", f"expected [{num_pages}] bool, got {tuple(live.shape)} {live.dtype}"
        )
    return live.cpu()


def _per_owner(log_odds: torch.Tensor, head_to_owner: Sequence[int], owners: int) -> torch.Tensor:
    index = torch.tensor(list(head_to_owner), dtype=torch.long).expand_as(log_odds)
    empty = torch.full((log_odds.shape[0], owners), -math.inf, dtype=log_odds.dtype)
    return empty.scatter_reduce(1, index, log_odds, "amax", include_self=True)


def _logit(probability: float) -> float:
    if probability <= 0.0:
        return -math.inf
    return math.log(probability) - math.log1p(-probability)
