"""Row codes in page summaries and the codes ranking, against brute force."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from services.offload import codes_kernel
from services.offload.bound import (
    Ranking,
    candidate_code_log_odds,
    choose_estimated,
    code_logits,
    layer_page_lse,
    omitted_value_term,
    owner_readers,
    page_code_log_odds,
    sketch_page_scores,
    sketched_code_log_odds,
)
from services.offload.errors import BoundInputInvalid, SummaryInvalid
from services.offload.pages import (
    PageSummaries,
    encode_codes,
    gather_omitted,
    summarize_pages,
    unpack_codes,
    value_mean_matches,
    with_value_means,
)
from services.offload.recall import (
    CODES_STRATEGY,
    SKETCH_STRATEGY,
    RecallStrategy,
    worker_strategy,
)

torch.set_num_threads(1)


def _case(seed: int, *, uneven: bool) -> tuple[torch.Tensor, list[list[list[int]]]]:
    """Random keys [L=3, H_kv=2, T=40, d_h=16] and a selection (equal counts per owner, or not)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, 40, 16, generator=gen) * 2.0
    rng = random.Random(seed)
    selected = []
    for _layer in range(3):
        per_owner = []
        for _owner in range(2):
            count = rng.randint(4, 20) if uneven else 10
            per_owner.append(sorted(rng.sample(range(40), count)))
        selected.append(per_owner)
    return keys, selected


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_codes_round_trip_and_bound_each_coordinate_by_its_page_box(bits: int) -> None:
    keys, selected = _case(1, uneven=True)
    pages = summarize_pages(keys, selected, 4, code_bits=bits)
    segment, position = pages.rows()
    owners = pages.num_owners
    rows = keys[segment // owners, segment % owners, position]  # [N, d_h], page after page
    assert pages.row_codes is not None
    assert tuple(pages.row_codes.shape) == (rows.shape[0], 16 * bits // 8)
    codes = unpack_codes(pages.row_codes, bits, 16)
    assert int(codes.max()) <= 2**bits - 1
    low, high = pages.page_min.float()[pages.row_page], pages.page_max.float()[pages.row_page]
    assert bool(((rows >= low) & (rows <= high)).all())
    # Each estimate is the nearest of the 2^b levels of its box: within half a level.
    estimates = pages.row_estimates.float()
    step = (high - low) / (2**bits - 1)
    slack = 0.5 * step + 0.01 * (high.abs() + low.abs() + 1)  # bfloat16 rounding of the table
    assert bool(((estimates - rows).abs() <= slack).all())
    # Encoding is exactly the packed codes.
    assert torch.equal(encode_codes(rows, low, high, bits), pages.row_codes)
    # The codes' bytes are part of what travels.
    plain = summarize_pages(keys, selected, 4)
    assert pages.nbytes == plain.nbytes + pages.row_codes.numel()


def _without_kernel(monkeypatch: pytest.MonkeyPatch, kernel: bool) -> None:
    """Score as a machine without a C++ compiler does (one coordinates-first block, torch)."""
    if not kernel:
        monkeypatch.setattr(codes_kernel, "available", lambda: False)
        monkeypatch.setattr(codes_kernel, "_kernel", lambda query, block: None)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("uneven", [False, True])
def test_page_log_odds_equal_brute_force_over_the_estimates(
        uneven: bool, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_kernel(monkeypatch, kernel)
    keys, selected = _case(2, uneven=uneven)
    pages = summarize_pages(keys, selected, 4, code_bits=2)
    head_to_owner = [0, 0, 1, 1]  # GQA: 4 query heads on 2 K/V heads
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(3, 4, 16, generator=gen)
    lse = torch.randn(3, 4, generator=gen).double()
    live = torch.rand(pages.num_pages, generator=gen) > 0.3
    scale = 0.25
    got = page_code_log_odds(pages, query, lse, head_to_owner, live=live, scale=scale)
    estimates = pages.row_estimates.double()
    segment, _ = pages.rows()
    expected = torch.full((pages.num_pages,), -math.inf, dtype=torch.float64)
    for page in range(pages.num_pages):
        if not live[page]:
            continue
        rows = torch.nonzero(pages.row_page == page)[:, 0]
        layer, owner = divmod(int(segment[rows[0]]), pages.num_owners)
        heads = [h for h, o in enumerate(head_to_owner) if o == owner]
        per_head = torch.stack([estimates[rows] @ query[layer, h].double() * scale - lse[layer, h]
                                for h in heads])  # [G, n]
        expected[page] = torch.logsumexp(per_head.amax(dim=0), 0)
    assert torch.allclose(got, expected, atol=2e-2, rtol=0)  # bfloat16 products
    assert bool(torch.isinf(got[~live]).all())


def test_code_table_places_every_row_in_its_page_slots_and_pads_with_minus_inf() -> None:
    keys, selected = _case(6, uneven=True)  # owners with different page counts, partial pages
    pages = summarize_pages(keys, selected, 4, code_bits=4)
    table = pages.code_table
    coordinates = table.coordinates_first()
    segments, dim, slots = coordinates.shape
    assert (segments, dim) == (pages.num_layers * pages.num_owners, 16) and slots % 4 == 0
    used = torch.isfinite(table.slot_bias).flatten()
    assert int(used.sum()) == pages.omitted_rows
    assert torch.equal(torch.nonzero(used)[:, 0], torch.sort(table.row_slot).values)
    flat = coordinates.mT.reshape(-1, dim)
    assert bool((flat[~used] == 0).all())
    # Row n of page p sits in page p's slots, in order: slot // page_size is page p's cell.
    cell = table.row_slot // pages.page_size
    assert torch.equal(cell, table.page_slot[pages.row_page])
    assert torch.equal(table.page_slot // (slots // 4), pages.page_segment)
    assert table.nbytes == flat.numel() * 2 + table.slot_bias.numel() * 4
    assert pages.code_table_bytes == table.nbytes  # the ledger's figure, before any table
    assert summarize_pages(keys, selected, 4).code_table_bytes == 0


def test_the_page_sketch_is_each_pages_mean_and_variance_of_its_estimates() -> None:
    keys, selected = _case(7, uneven=True)
    pages = summarize_pages(keys, selected, 4, code_bits=4)
    table, sketch = pages.code_table, pages.page_sketch
    segments, dim, cells = sketch.mean.shape
    coordinates = table.coordinates_first()
    assert (segments, dim) == coordinates.shape[:2] and cells == coordinates.shape[2] // 4
    assert sketch.variance.shape == sketch.mean.shape
    assert sketch.nbytes == 2 * sketch.mean.numel() * 2
    assert pages.code_table_bytes == table.nbytes  # no served strategy builds the sketch
    mean = sketch.mean.mT.reshape(-1, dim).float()  # [S * cells, d_h]
    variance = sketch.variance.mT.reshape(-1, dim).float()
    estimates = pages.row_estimates.float()
    for page in range(pages.num_pages):
        rows = estimates[pages.row_page == page]
        cell = int(table.page_slot[page])
        torch.testing.assert_close(mean[cell], rows.mean(dim=0), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(variance[cell], rows.var(dim=0, unbiased=False), atol=2e-2,
                                   rtol=1e-2)
    unused = torch.ones(segments * cells, dtype=torch.bool)
    unused[table.page_slot] = False
    assert bool((mean[unused] == 0).all()) and bool((variance[unused] == 0).all())


def _scoring_case(seed: int) -> tuple[PageSummaries, torch.Tensor, torch.Tensor, torch.Tensor]:
    keys, selected = _case(seed, uneven=True)
    pages = summarize_pages(keys, selected, 4, code_bits=4)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(3, 4, 16, generator=gen)
    lse = torch.randn(3, 4, generator=gen).double()
    live = torch.rand(pages.num_pages, generator=gen) > 0.3
    return pages, query, lse, live


@pytest.mark.parametrize("seed", [8, 9])
def test_sketch_scores_equal_brute_force_over_each_pages_rows(seed: int) -> None:
    pages, query, lse, live = _scoring_case(seed)
    head_to_owner, scale, width = [0, 0, 1, 1], 0.25, 2.5
    got = sketch_page_scores(pages, query, lse, head_to_owner, live=live, scale=scale,
                             width=width)
    estimates = pages.row_estimates.double()
    segment, _ = pages.rows()
    for page in range(pages.num_pages):
        if not live[page]:
            assert got[page] == -math.inf
            continue
        rows = estimates[pages.row_page == page]
        layer, owner = divmod(int(segment[pages.row_page == page][0]), pages.num_owners)
        mean, variance = rows.mean(dim=0), rows.var(dim=0, unbiased=False)
        q = query.double() * scale
        expected = max(float(q[layer, h] @ mean + width * (q[layer, h] ** 2 @ variance).sqrt()
                             - lse[layer, h]) for h in (0, 1, 2, 3) if head_to_owner[h] == owner)
        assert abs(float(got[page]) - expected) < 5e-2  # bfloat16 sketch and products


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("seed", [10, 11])
def test_candidates_get_the_full_scorings_log_odds_and_the_rest_minus_inf(
        seed: int, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_kernel(monkeypatch, kernel)
    pages, query, lse, live = _scoring_case(seed)
    head_to_owner = [0, 1, 0, 1]
    full = page_code_log_odds(pages, query, lse, head_to_owner, live=live)
    chosen = torch.tensor([5, 0, pages.num_pages - 1, 7])
    torch.testing.assert_close(candidate_code_log_odds(pages, query, lse, head_to_owner, chosen),
                               page_code_log_odds(pages, query, lse, head_to_owner)[chosen],
                               atol=1e-5, rtol=0)
    # As many candidates as live pages: the full scoring.
    every = sketched_code_log_odds(pages, query, lse, head_to_owner, pages.num_pages, live=live)
    torch.testing.assert_close(every, full, atol=1e-5, rtol=0)
    # Fewer: exactly the sketch's best live pages are scored, with the full scoring's values.
    few = sketched_code_log_odds(pages, query, lse, head_to_owner, 3, live=live)
    scores = sketch_page_scores(pages, query, lse, head_to_owner, live=live)
    best = set(scores.topk(3).indices.tolist())
    scored = set(torch.nonzero(torch.isfinite(few))[:, 0].tolist())
    assert scored == best and all(bool(live[p]) for p in scored)
    torch.testing.assert_close(few[sorted(scored)], full[sorted(scored)], atol=1e-5, rtol=0)
    none = sketched_code_log_odds(pages, query, lse, head_to_owner, 3,
                                  live=torch.zeros_like(live))
    assert bool(torch.isinf(none).all())
    for bad in (torch.tensor([-1]), torch.tensor([pages.num_pages])):
        with pytest.raises(BoundInputInvalid) as error:
            candidate_code_log_odds(pages, query, lse, head_to_owner, bad)
        assert error.value.field == "pages"
    with pytest.raises(BoundInputInvalid) as error:
        sketched_code_log_odds(pages, query, lse, head_to_owner, 0)
    assert error.value.field == "candidates"


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("seed", [12, 13])
def test_layers_scored_one_by_one_give_the_whole_tables_log_odds_to_the_bit(
        seed: int, kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`layer_page_lse` (what the planner thread computes as each layer attends) over every
    layer is the whole table's scoring, so a plan built from it chooses the same pages."""
    _without_kernel(monkeypatch, kernel)
    pages, query, lse, live = _scoring_case(seed)
    head_to_owner, scale = [0, 1, 1, 0], 0.25
    readers = owner_readers(pages, head_to_owner)
    parts = [layer_page_lse(pages, layer, query[layer], lse[layer], readers, scale=scale)
             for layer in range(pages.num_layers)]
    assert all(part.shape[0] == pages.num_owners for part in parts)
    # From the layer's code logits already computed (what the value term computed ahead
    # hands its plan): the same scores.
    logits, owners = code_logits(pages, query, head_to_owner, scale=scale).logits, pages.num_owners
    for layer, part in enumerate(parts):
        from_logits = layer_page_lse(pages, layer, query[layer], lse[layer], readers,
                                     logits=logits[layer * owners:(layer + 1) * owners])
        assert torch.equal(from_logits, part)
    whole = page_code_log_odds(pages, query, lse, head_to_owner, live=live, scale=scale)
    by_layer = page_code_log_odds(pages, query, lse, head_to_owner, live=live, scale=scale,
                                  page_lse=torch.cat(parts))
    assert torch.equal(by_layer, whole)
    with pytest.raises(BoundInputInvalid) as error:
        page_code_log_odds(pages, query, lse, head_to_owner, page_lse=torch.cat(parts[1:]))
    assert error.value.field == "page_lse"
    with pytest.raises(BoundInputInvalid) as error:
        layer_page_lse(pages, pages.num_layers, query[0], lse[0], readers)
    assert error.value.field == "layer"


def test_choose_estimated_ranks_floors_caps_and_adds_successors() -> None:
    odds = torch.tensor([0.5, -3.0, 2.0, -1.0, 1.0, -9.0], dtype=torch.float64)
    segment = torch.tensor([0, 0, 0, 1, 1, 1])
    live = torch.tensor([True, True, True, True, False, True])
    assert choose_estimated(odds, live, 3, None, segment).tolist() == [2, 0, 3]
    assert choose_estimated(odds, live, 6, -2.0, segment).tolist() == [2, 0, 3]
    assert choose_estimated(odds, live, 6, 5.0, segment).tolist() == []
    # Successors: the owner's next live pages, never another owner's, within the cap.
    assert choose_estimated(odds, live, 6, None, segment, successors=1).tolist() == [2, 0, 1, 3, 5]
    assert choose_estimated(odds, live, 3, None, segment, successors=1).tolist() == [2, 0, 1]


def _choose_brute_force(odds: list[float], live: list[bool], cap: int, floor: float | None,
                       segment: list[int], successors: int) -> list[int]:
    """choose_estimated by its words: rank the live finite pages at or above the floor (best
    first, ties to the lower index), follow each by its owner's next live pages looked for
    within 4 x successors after it, stop at the cap."""
    ranked = sorted((p for p in range(len(odds)) if live[p] and math.isfinite(odds[p])
                     and (floor is None or odds[p] >= floor)), key=lambda p: (-odds[p], p))
    chosen: list[int] = []
    for page in ranked[:cap]:
        if page not in chosen:
            chosen.append(page)
        found = 0
        for after in range(page + 1, min(len(odds), page + 4 * successors + 1)):
            if found == successors or segment[after] != segment[page]:
                break
            if live[after] and after not in chosen:
                chosen.append(after)
                found += 1
        if len(chosen) >= cap:
            break
    return chosen[:cap]


@pytest.mark.parametrize("seed", range(6))
def test_choose_estimated_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    pages = rng.randint(1, 60)
    segment = sorted(rng.randrange(4) for _ in range(pages))
    odds = [rng.choice([-math.inf, round(rng.gauss(0, 2), 1)]) for _ in range(pages)]
    live = [rng.random() > 0.2 for _ in range(pages)]
    for cap, floor, successors in ((8, None, 0), (8, -1.0, 1), (16, 0.0, 2), (3, None, 3)):
        got = choose_estimated(torch.tensor(odds, dtype=torch.float64), torch.tensor(live), cap,
                               floor, torch.tensor(segment), successors)
        assert got.tolist() == _choose_brute_force(odds, live, cap, floor, segment, successors)


def test_summaries_refuse_inconsistent_codes() -> None:
    keys, selected = _case(4, uneven=False)
    pages = summarize_pages(keys, selected, 4, code_bits=2)
    fields = dict(page_size=4, page_min=pages.page_min, page_max=pages.page_max,
                  page_first=pages.page_first, page_count=pages.page_count,
                  page_offsets=pages.page_offsets)
    assert pages.row_codes is not None
    with pytest.raises(SummaryInvalid) as missing:
        PageSummaries(**fields, code_bits=2)
    assert missing.value.field == "row_codes"
    with pytest.raises(SummaryInvalid) as stray:
        PageSummaries(**fields, row_codes=pages.row_codes)
    assert stray.value.field == "row_codes"
    with pytest.raises(SummaryInvalid) as shape:
        PageSummaries(**fields, code_bits=2, row_codes=pages.row_codes[1:])
    assert shape.value.field == "row_codes"
    with pytest.raises(SummaryInvalid) as bits:
        PageSummaries(**fields, code_bits=3, row_codes=pages.row_codes)
    assert bits.value.field == "code_bits"
    with pytest.raises(SummaryInvalid):
        summarize_pages(keys, selected, 4, code_bits=8)
    with pytest.raises(SummaryInvalid) as plain:
        _ = summarize_pages(keys, selected, 4).row_estimates
    assert plain.value.field == "row_codes"


def test_the_codes_strategy_needs_codes_and_the_worker_picks_it_only_with_them() -> None:
    keys, selected = _case(5, uneven=False)
    assert worker_strategy(summarize_pages(keys, selected, 4, code_bits=1)) is CODES_STRATEGY
    assert worker_strategy(summarize_pages(keys, selected, 4)) is not CODES_STRATEGY
    assert worker_strategy(None) is not CODES_STRATEGY
    with pytest.raises(BoundInputInvalid) as wrong:
        RecallStrategy(successor_pages=1)
    assert wrong.value.field == "successor_pages"
    assert CODES_STRATEGY.sketch_candidates is None
    assert replace(CODES_STRATEGY, sketch_candidates=SKETCH_STRATEGY.sketch_candidates) == SKETCH_STRATEGY
    for bad, field in ((dict(sketch_candidates=4), "sketch_candidates"),
                       (dict(ranking=Ranking.CODES, sketch_candidates=0), "sketch_candidates"),
                       (dict(ranking=Ranking.CODES, sketch_width=-1.0), "sketch_width"),
                       (dict(ranking=Ranking.CODES, sketch_width=math.nan), "sketch_width")):
        with pytest.raises(BoundInputInvalid) as wrong:
            RecallStrategy(**bad)  # type: ignore[arg-type]
        assert wrong.value.field == field


def _with_values(seed: int, *, uneven: bool, bits: int = 4) -> tuple[PageSummaries, torch.Tensor]:
    """A case's summaries with page value means, and its values `[L, H_kv, T, d_h]`."""
    keys, selected = _case(seed, uneven=uneven)
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(seed + 100))
    pages = summarize_pages(keys, selected, 4, code_bits=bits)
    return with_value_means(pages, gather_omitted(keys, values, pages)), values


def test_page_value_means_are_each_pages_mean_and_travel_and_are_charged() -> None:
    pages, values = _with_values(7, uneven=True)
    segment, position = pages.rows()
    owners = pages.num_owners
    rows = values[segment // owners, segment % owners, position]  # [N, d_h]
    assert pages.page_value_mean is not None
    for page in range(pages.num_pages):
        expected = rows[pages.row_page == page].mean(dim=0)
        torch.testing.assert_close(pages.page_value_mean[page], expected, atol=1e-6, rtol=0)
    plain = replace(pages, page_value_mean=None)
    assert pages.nbytes == plain.nbytes + pages.num_pages * 16 * 4
    grid = pages.value_grid  # [S, longest, d_h] bfloat16, pages where the codes table has them
    cells = grid.reshape(-1, 16)
    assert torch.equal(cells[pages.code_table.page_slot], pages.page_value_mean.to(torch.bfloat16))
    unused = torch.ones(cells.shape[0], dtype=torch.bool)
    unused[pages.code_table.page_slot] = False
    assert bool((cells[unused] == 0).all())
    assert pages.code_table_bytes == pages.code_table.nbytes + grid.numel() * 2
    assert plain.code_table_bytes == pages.code_table.nbytes
    assert value_mean_matches(pages.page_value_mean, rows, pages.page_count)
    shifted = rows.clone()
    shifted[[0, 1]] = shifted[[1, 0]]  # a V row moved to its neighbour in the same page
    shifted[[2, 5]] = shifted[[5, 2]]  # and across pages
    assert not value_mean_matches(pages.page_value_mean, shifted, pages.page_count)


def test_summaries_refuse_value_means_without_codes_or_of_the_wrong_shape() -> None:
    pages, _ = _with_values(8, uneven=False)
    means = pages.page_value_mean
    assert means is not None
    cases = [
        dict(code_bits=0, row_codes=None, page_value_mean=means),
        dict(page_value_mean=means[1:]),
        dict(page_value_mean=means[:, 1:]),
        dict(page_value_mean=means.int()),
        dict(page_value_mean=torch.full_like(means, math.nan)),
    ]
    for change in cases:
        with pytest.raises(SummaryInvalid) as error:
            replace(pages, **change)
        assert error.value.field == "page_value_mean"
    with pytest.raises(SummaryInvalid) as absent:
        _ = replace(pages, page_value_mean=None).value_grid
    assert absent.value.field == "page_value_mean"


@pytest.mark.parametrize("uneven", [False, True])
def test_the_omitted_value_term_equals_brute_force_over_the_estimates_and_means(
    uneven: bool,
) -> None:
    """Per query head: the log of sum over live pages and their rows of e^{s q . k^}, and the
    pages' mean values weighted by their rows' summed e^{s q . k^}."""
    pages, _ = _with_values(9, uneven=uneven)
    head_to_owner = [0, 0, 1, 1]
    gen = torch.Generator().manual_seed(10)
    query = torch.randn(3, 4, 16, generator=gen)
    live = torch.rand(pages.num_pages, generator=gen) > 0.3
    live[pages.page_segment == 0] = False  # an owner with nothing live: no mass
    scale = 0.25
    logits = code_logits(pages, query, head_to_owner, scale=scale)
    term = omitted_value_term(pages, logits, live)
    estimates = pages.row_estimates.double()
    means = pages.page_value_mean
    assert means is not None
    mass = torch.full((3, 4), -math.inf, dtype=torch.float64)
    value = torch.zeros(3, 4, 16, dtype=torch.float64)
    for layer in range(3):
        for head, owner in enumerate(head_to_owner):
            segment = layer * pages.num_owners + owner
            alive = [p for p in range(pages.num_pages)
                     if pages.page_segment[p] == segment and live[p]]
            if not alive:
                continue
            page_mass = torch.stack([torch.logsumexp(
                estimates[pages.row_page == p] @ query[layer, head].double() * scale, 0)
                for p in alive])
            mass[layer, head] = torch.logsumexp(page_mass, 0)
            value[layer, head] = page_mass.softmax(0) @ means[alive].double()
    assert torch.allclose(term.log_mass.double(), mass, atol=3e-2, rtol=0)  # bfloat16 table
    assert torch.allclose(term.value.double(), value, atol=3e-2, rtol=0)
    assert bool(torch.isinf(term.log_mass[0, :2]).all()) and bool((term.value[0, :2] == 0).all())
    assert not term.empty
    assert omitted_value_term(pages, logits, torch.zeros_like(live)).empty
    # The page log-odds read the same logits when given them.
    lse = torch.randn(3, 4, generator=gen).double()
    assert torch.equal(page_code_log_odds(pages, query, lse, head_to_owner, live=live, scale=scale),
                       page_code_log_odds(pages, query, lse, head_to_owner, live=live,
                                          logits=logits))
