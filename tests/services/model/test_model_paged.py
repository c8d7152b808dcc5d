"""The paged KV store (issue 17): the page ledger and pool (reserve, allocate, free, refuse past
the budget), admission of symbolic K/V rows into pages, steps appending into the last page,
release freeing pages, and paged attention against an independent dense masked reference."""

from __future__ import annotations

import pytest
import torch

from services.kvpolicy.packing import pack
from services.model import DecodeCache, StepCapture, attention, decode_step
from services.model.attention import paged_decode_attention
from services.model.config import parse_model_config
from services.model.errors import InvalidModelInput, KVPoolExhausted
from services.model.model import CausalLM
from services.model.paged import PageLedger, PagePool, page_nbytes

torch.set_num_threads(1)
LAYERS, KV_HEADS, D_H, ROWS = 2, 2, 8, 4  # ROWS: page rows, small so rows cross pages


def tiny_config(**overrides: object):
    return parse_model_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": KV_HEADS, "head_dim": D_H,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", **overrides,
    })


def symbolic(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K[l, h, t, c] = 1000 l + 100 h + 10 t + c (V = -K): every row names where it came from."""
    layer, h, t, c = torch.meshgrid(torch.arange(LAYERS), torch.arange(KV_HEADS),
                                    torch.arange(length), torch.arange(D_H), indexing="ij")
    keys = (1000 * layer + 100 * h + 10 * t + c).float()
    return keys, -keys


# Uneven per-(layer, owner) budgets, Ada-KV style: 1, 4 (one full page), 5, 9 rows.
SELECTED = [[[3], [0, 2, 5, 7]], [[0, 1, 2, 4, 6], [0, 1, 2, 3, 4, 5, 6, 8, 9]]]


def test_ledger_reserves_charges_and_refuses_past_capacity():
    ledger = PageLedger(capacity_pages=10, page_bytes=100)
    a = ledger.reserve(6, "a")
    with pytest.raises(KVPoolExhausted, match="kv_budget_bytes") as refused:
        ledger.reserve(5, "b")
    assert "6 of 10 pages" in str(refused.value)
    ledger.charge(a, 8)  # grows into the 4 unreserved pages
    assert (a.reserved, a.held, ledger.usage().reserved_pages) == (8, 8, 8)
    with pytest.raises(KVPoolExhausted):
        ledger.charge(a, 3)
    assert ledger.usage().held_pages == 8  # a refused charge holds nothing
    a.release()  # keeps what it holds until freed
    assert ledger.usage().reserved_pages == 8
    ledger.discharge(a, 8)
    assert ledger.usage() == type(ledger.usage())(10, 0, 0, 100)
    b = ledger.reserve(10, "b")
    ledger.trim(b, 3)
    assert (b.reserved, ledger.usage().reserved_pages) == (3, 3)


def test_pool_is_sized_by_the_budget_and_never_allocates_past_it():
    page = page_nbytes(ROWS, D_H, torch.float32)
    assert page == ROWS * (2 * D_H * 4 + 4)
    pool = PagePool.for_budget(10 * page + page - 1, D_H, torch.float32, page_rows=ROWS)
    assert (pool.num_pages, pool.preallocated_bytes) == (10, 10 * page)
    lease = pool.ledger.reserve(0, "r")
    pool.keys.fill_(float("nan"))  # what a previous request may have left behind
    ids = pool.allocate(lease, 7)
    assert sorted(ids.tolist()) == list(range(7)) and pool.pages_in_use == 7
    assert torch.equal(pool.keys[ids], torch.zeros(7, ROWS, D_H))  # handed out zeroed
    with pytest.raises(KVPoolExhausted):
        pool.allocate(lease, 4)
    assert pool.pages_in_use == 7 and pool.num_pages == 10
    pool.free(lease, ids[:3])
    assert pool.pages_in_use == 4 and lease.held == 4


def paged_cache(config, page_rows: int = ROWS, pool: PagePool | None = None) -> DecodeCache:
    return DecodeCache(config, torch.float32, batch_capacity=1, row_capacity=2,
                       page_rows=page_rows, pool=pool)


def test_admission_places_every_symbolic_row_and_counts_pages():
    config = tiny_config()
    keys, values = symbolic(12)
    view = pack(keys, values, SELECTED)
    cache = paged_cache(config)
    cache.admit_view("r", view, frontier=12)
    for layer, per_layer in enumerate(SELECTED):
        for head, kept in enumerate(per_layer):
            k, v, positions = cache.rows("r", layer, head)
            assert positions.tolist() == kept
            assert torch.equal(k, keys[layer, head, kept])
            assert torch.equal(v, values[layer, head, kept])
    ledger = cache.ledger("r")
    rows = sum(len(kept) for per_layer in SELECTED for kept in per_layer)
    assert (ledger.rows, ledger.pages) == (rows, 1 + 1 + 2 + 3)  # ceil(n / 4) per owner
    assert ledger.allocated_bytes == cache.pool.pages_in_use * cache.pool.page_bytes
    assert ledger.layout == "ragged"


def test_steps_append_into_the_last_page_and_release_frees_every_page():
    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = symbolic(12)
    cache = paged_cache(config)
    cache.admit_view("a", pack(keys, values, SELECTED), frontier=12)
    cache.admit_dense("b", keys, values)  # 12 rows per owner: 3 full pages each
    held = cache.pool.pages_in_use
    decode_step(model, cache, [1, 2])
    # "a": owners of 1, 5, 9 rows took no page, the full one (4 rows) one; "b": one per owner.
    assert cache.pool.pages_in_use == held + 1 + LAYERS * KV_HEADS
    for _ in range(3):
        decode_step(model, cache, [1, 2])
    assert cache.lengths("a").tolist() == [[5, 8], [9, 13]]
    assert cache.ledger("a").pages == 2 + 2 + 3 + 4
    _, _, positions = cache.rows("b", 1, 1)
    assert positions.tolist() == list(range(16))
    cache.release("a")
    assert cache.pool.pages_in_use == cache.ledger().pages == LAYERS * KV_HEADS * 4
    cache.release("b")
    assert cache.pool.pages_in_use == 0 and cache.pool.ledger.usage().reserved_pages == 0


def test_a_fixed_pool_refuses_admission_and_steps_past_its_budget():
    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = symbolic(12)
    pool = PagePool(8, D_H, torch.float32, page_rows=ROWS)
    cache = paged_cache(config, pool=pool)
    cache.admit_view("a", pack(keys, values, SELECTED), frontier=12)  # 7 pages
    with pytest.raises(KVPoolExhausted, match="kv_budget_bytes") as refused:
        cache.admit_dense("b", keys, values)
    assert refused.value.request_id == "b"
    assert cache.request_ids == ["a"] and pool.pages_in_use == 7  # nothing of "b" stays
    decode_step(model, cache, [1])  # the full page's owner takes the last page
    assert pool.pages_in_use == 8
    for _ in range(2):
        decode_step(model, cache, [1])  # every owner still has room in its last page
    with pytest.raises(KVPoolExhausted) as refused:
        decode_step(model, cache, [1])  # owners of 1 + 3, 5 + 3 and 9 + 3 rows need a page
    assert refused.value.request_id == "a" and pool.pages_in_use == 8


def dense_reference(q, keys, values, positions, hidden_before, scale, group):
    """Per (request, owner): softmax over its explicit rows, masked by the window. q [B, H_q, d]."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2])
    for b, per_request in enumerate(keys):
        for h, k in enumerate(per_request):
            for g in range(group):
                query = q[b, h * group + g]
                logits = (k @ query) * scale
                if hidden_before is not None:
                    logits[positions[b][h] <= hidden_before[b]] = float("-inf")
                out[b, h * group + g] = torch.softmax(logits, 0) @ values[b][h]
                lse[b, h * group + g] = torch.logsumexp(logits, 0)
    return out, lse


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_pages", [1, 3])
@pytest.mark.parametrize("contiguous", [False, True])
def test_paged_attention_equals_dense_masked_reference(group, window, block_pages, contiguous):
    generator = torch.Generator().manual_seed(group)
    # One row, exact pages, many pages; owners of equal page counts, adjacent or not.
    lengths = torch.tensor([[1, 9], [16, 4], [13, 33], [8, 8], [7, 2]])
    batch, owners = lengths.shape
    # Scattered pages are gathered in blocks; runs of >= 2 consecutive ones are read in place.
    pages = torch.arange(64) if contiguous else torch.randperm(64, generator=generator)
    pool_k = torch.randn(64, ROWS, D_H, generator=generator)
    pool_v = torch.randn(64, ROWS, D_H, generator=generator)
    pool_p = torch.zeros(64, ROWS, dtype=torch.int32)
    table = torch.zeros(batch, owners, 16, dtype=torch.long)
    keys, values, positions, taken = [], [], [], 0
    for b in range(batch):
        keys.append([]), values.append([]), positions.append([])
        for h in range(owners):
            n = int(lengths[b, h])
            count = -(-n // ROWS)
            table[b, h, :count] = pages[taken: taken + count]
            taken += count
            rows = pool_k[table[b, h, :count]].reshape(-1, D_H)[:n]
            held = torch.randperm(40, generator=generator)[:n].sort().values  # original positions
            pool_p[table[b, h, :count]] = torch.nn.functional.pad(held, (0, count * ROWS - n)).view(
                count, ROWS).int()
            keys[b].append(rows)
            values[b].append(pool_v[table[b, h, :count]].reshape(-1, D_H)[:n])
            positions[b].append(held)
    q = torch.randn(batch, owners * group, D_H, generator=generator)
    frontier = torch.tensor([38, 39, 40, 41, 42])
    hidden = None if window is None else frontier - window
    for b in range(batch):  # the newest row of every owner is always in the window
        for h in range(owners):
            if hidden is not None:
                positions[b][h][-1] = int(frontier[b])
                page = table[b, h, (int(lengths[b, h]) - 1) // ROWS]
                pool_p[page, (int(lengths[b, h]) - 1) % ROWS] = int(frontier[b])
    out, lse = paged_decode_attention(q, pool_k, pool_v, table, lengths, 0.3, hidden, pool_p,
                                      block_pages, run_pages=2)
    expected, expected_lse = dense_reference(q, keys, values, positions, hidden, 0.3, group)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


def test_page_size_does_not_change_a_sliding_window_decode():
    config = tiny_config(sliding_window=6, use_sliding_window=True, max_window_layers=0,
                         model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    assert any(w is not None for w in config.sliding_windows)
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = symbolic(12)
    keys, values = keys / 1000, values / 1000
    paged, dense = paged_cache(config), paged_cache(config, page_rows=64)  # one page per owner
    paged.admit_dense("r", keys, values)
    dense.admit_dense("r", keys, values)
    for token in (3, 4, 5, 6, 7):
        capture = StepCapture()
        paged_logits = decode_step(model, paged, [token], capture)
        torch.testing.assert_close(paged_logits, decode_step(model, dense, [token]),
                                   atol=1e-5, rtol=1e-5)
        assert set(capture.lse) == set(range(LAYERS))


def test_dropping_rows_compacts_the_owner_and_frees_its_pages():
    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = symbolic(12)
    keys, values = keys / 1000, values / 1000
    cache = paged_cache(config)
    cache.admit_dense("r", keys, values)  # 12 rows per owner: 3 pages each
    decode_step(model, cache, [1])  # 13 rows: 4 pages each
    decoded = [[cache.rows("r", layer, head) for head in range(KV_HEADS)]
               for layer in range(LAYERS)]
    held = cache.pool.pages_in_use
    drop = torch.zeros(13, dtype=torch.bool)
    drop[[0, 1, 2, 4, 5, 6, 9]] = True
    kept = [3, 7, 8, 10, 11, 12]
    assert cache.drop_rows("r", 1, 0, drop) == 2 and cache.pool.pages_in_use == held - 2
    k, v, positions = cache.rows("r", 1, 0)
    assert positions.tolist() == kept
    assert torch.equal(k[:5], keys[1, 0, kept[:5]]) and torch.equal(v[:5], values[1, 0, kept[:5]])
    assert torch.equal(k[5], decoded[1][0][0][12])  # the decoded row moved up with the rest
    ledger = cache.ledger()
    assert (ledger.layout, ledger.pages) == ("compacted", 4 * 4 - 2)
    # Decoding on equals a cache admitted from a packed view of exactly the kept rows.
    source_k = torch.stack([torch.stack([rows[0] for rows in per_layer]) for per_layer in decoded])
    source_v = torch.stack([torch.stack([rows[1] for rows in per_layer]) for per_layer in decoded])
    everything = list(range(13))
    selected = [[everything, everything], [kept, everything]]
    alone = paged_cache(config)
    alone.admit_view("r", pack(source_k, source_v, selected), frontier=13)
    for token in (2, 3, 4):
        torch.testing.assert_close(decode_step(model, cache, [token]),
                                   decode_step(model, alone, [token]), atol=1e-6, rtol=1e-6)
    with pytest.raises(InvalidModelInput, match="drop"):
        cache.drop_rows("r", 0, 0, torch.ones(16, dtype=torch.bool))


def test_pool_places_each_owner_in_one_extent_that_decode_growth_continues():
    pool = PagePool(64, D_H, torch.float32, page_rows=ROWS, growth_pages=4)
    lease = pool.ledger.reserve(0, "r")
    # Owner 0 at page 0; owner 1 after owner 0's 4 pages of growth room; owner 2 from page 40.
    ids = pool.allocate_extents(lease, [3, 2, 2], after=[-1, -1, -1], near=[0, 0, 40])
    assert ids.tolist() == [0, 1, 2, 7, 8, 40, 41]
    assert pool.allocate_extents(lease, [1], after=[2]).tolist() == [3]  # in place
    assert pool.allocate_extents(lease, [2], after=[8]).tolist() == [9, 10]
    # A new owner keeps clear of the growth room behind owner 1 (pages 11..14).
    assert pool.allocate_extents(lease, [1]).tolist() == [15]


def test_a_full_pool_hands_out_growth_room_and_scattered_pages_never_past_capacity():
    pool = PagePool(8, D_H, torch.float32, page_rows=ROWS, growth_pages=4)
    lease = pool.ledger.reserve(0, "r")
    assert pool.allocate_extents(lease, [3, 3]).tolist() == [0, 1, 2, 3, 4, 5]  # no room left
    pool.free(lease, [1, 4])
    assert pool.allocate_extents(lease, [2], after=[0]).tolist() == [6, 7]  # the free run
    assert pool.allocate_extents(lease, [2]).tolist() == [1, 4]  # no run left: any free pages
    with pytest.raises(KVPoolExhausted):
        pool.allocate_extents(lease, [1])
    assert pool.pages_in_use == 8 and pool.num_pages == 8


def fragmented_pool(pages: int) -> PagePool:
    """A fixed pool whose free pages are every other one: no two free pages are adjacent, so
    every owner's pages are scattered and attention gathers them."""
    pool = PagePool(pages, D_H, torch.float32, page_rows=ROWS)
    lease = pool.ledger.reserve(0, "filler")
    taken = pool.allocate(lease, pages)
    pool.free(lease, taken[::2])
    lease.release()  # the odd pages stay held; the even ones are free to reserve
    return pool


def test_contiguous_and_scattered_pages_decode_alike_and_equal_the_padded_reference():
    """The same symbolic rows in a fresh pool (each owner one run: the whole-run path) and in a
    fragmented one (every page gathered, partial softmaxes merged) give the padded slab's
    logits and log-sum-exps, step after step, rows crossing pages."""
    from services.model.padded_cache import PaddedDecodeCache

    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = symbolic(12)
    keys, values = keys / 1000, values / 1000
    view = pack(keys, values, SELECTED)
    whole = paged_cache(config, pool=PagePool(256, D_H, torch.float32, page_rows=ROWS))
    scattered = paged_cache(config, pool=fragmented_pool(256))
    reference = PaddedDecodeCache(config, torch.float32, batch_capacity=2)
    for cache in (whole, scattered, reference):
        cache.admit_view("a", view, frontier=12)
        cache.admit_dense("b", keys, values)
    for layer, per_layer in enumerate(SELECTED):  # the gathered rows are the symbolic ones
        for head, kept in enumerate(per_layer):
            k, v, positions = scattered.rows("a", layer, head)
            assert positions.tolist() == kept and torch.equal(k, keys[layer, head, kept])
    for token in (3, 4, 5, 6, 7, 8):
        captures = [StepCapture() for _ in range(3)]
        logits = [decode_step(model, cache, [token, token + 1], capture)
                  for cache, capture in zip((whole, scattered, reference), captures, strict=True)]
        assert all(plan is not None and plan.whole for plan in whole._plans)
        assert not any(plan is not None and plan.whole for plan in scattered._plans)
        for got, capture in zip(logits[:2], captures[:2], strict=True):
            torch.testing.assert_close(got, logits[2], atol=1e-5, rtol=1e-5)
            for slot in (0, 1):
                torch.testing.assert_close(capture.log_sum_exp(slot),
                                           captures[2].log_sum_exp(slot), atol=1e-5, rtol=1e-5)
    assert whole.ledger().pages == scattered.ledger().pages


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("whole", [True, False])
def test_whole_run_attention_equals_the_dense_reference_with_or_without_lse(
        window, whole, monkeypatch):
    """Owners in one run each, read in place as complete softmaxes (or, past the chain limit,
    as partial ones merged): the dense reference; the output without the log-sum-exp is the
    same bits (recall's capture path and the plain one agree exactly)."""
    if not whole:
        monkeypatch.setattr(attention, "WHOLE_CHAINS", 0)
    generator = torch.Generator().manual_seed(7)
    lengths = torch.tensor([[5, 5], [5, 5], [9, 3]])  # equal runs chain; a run of 3 rows alone
    batch, owners = lengths.shape
    pool_k = torch.randn(40, ROWS, D_H, generator=generator)
    pool_v = torch.randn(40, ROWS, D_H, generator=generator)
    pool_p = torch.zeros(40, ROWS, dtype=torch.int32)
    table = torch.zeros(batch, owners, 4, dtype=torch.long)
    keys, values, positions = [], [], []
    frontier = torch.tensor([20, 21, 22])
    for b in range(batch):
        keys.append([]), values.append([]), positions.append([])
        for h in range(owners):
            n, first = int(lengths[b, h]), 5 * (b * owners + h)  # runs at an even stride of 5
            count = -(-n // ROWS)
            table[b, h, :count] = torch.arange(first, first + count)
            held = torch.cat([torch.randperm(19, generator=generator)[: n - 1].sort().values,
                              frontier[b: b + 1]])  # the newest row is always visible
            pool_p[first:first + count] = torch.nn.functional.pad(
                held, (0, count * ROWS - n)).view(count, ROWS).int()
            keys[b].append(pool_k[first:first + count].reshape(-1, D_H)[:n])
            values[b].append(pool_v[first:first + count].reshape(-1, D_H)[:n])
            positions[b].append(held)
    q = torch.randn(batch, owners * 2, D_H, generator=generator)
    hidden = None if window is None else frontier - window
    out, lse = paged_decode_attention(q, pool_k, pool_v, table, lengths, 0.3, hidden, pool_p)
    plain, no_lse = paged_decode_attention(q, pool_k, pool_v, table, lengths, 0.3, hidden,
                                           pool_p, with_lse=False)
    expected, expected_lse = dense_reference(q, keys, values, positions, hidden, 0.3, 2)
    plan = attention.paged_plan(table, attention.pages_used(lengths, ROWS), page_rows=ROWS)
    assert plan.whole == whole and plan.short.numel() == (0 if whole else plan.pages.numel())
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
    if whole:
        assert torch.equal(plain, out) and no_lse is None
    else:
        torch.testing.assert_close(plain, expected, atol=1e-5, rtol=1e-5)


def test_a_padded_plan_chains_owners_of_different_lengths_and_reads_no_row_past_theirs():
    """Owners one run each at an even stride, holding 1 to 5 pages: one padded chain, each
    owner read up to the longest (its own rows past its length masked), equal to the dense
    reference. The pages read past an owner's rows are `padding()`: NaN there (never-written
    pool pages) reaches the output until they are zeroed, as `PagePool.clean` does; NaN
    anywhere else never does. The plan holds while an owner grows in place within its
    capacity, and not once a page moves or an owner outgrows it."""
    generator = torch.Generator().manual_seed(11)
    lengths = torch.tensor([[5, 13], [9, 2], [17, 6]])
    batch, owners = lengths.shape
    used = attention.pages_used(lengths, ROWS)  # [2, 4, 3, 1, 5, 2]
    stride, pool_pages = 8, 56
    pool_k = torch.full((pool_pages, ROWS, D_H), float("nan"))
    pool_v = torch.full((pool_pages, ROWS, D_H), float("nan"))
    table = torch.zeros(batch, owners, 8, dtype=torch.long)
    keys, values, positions = [], [], []
    for b in range(batch):
        keys.append([]), values.append([]), positions.append([])
        for h in range(owners):
            segment, n = b * owners + h, int(lengths[b, h])
            first, count = stride * segment, int(used[segment])
            table[b, h, :count] = torch.arange(first, first + count)
            rows = torch.zeros(count * ROWS, 2, D_H)  # a pool page comes zeroed
            rows[:n] = torch.randn(n, 2, D_H, generator=generator)
            pool_k[first:first + count] = rows[:, 0].view(count, ROWS, D_H)
            pool_v[first:first + count] = rows[:, 1].view(count, ROWS, D_H)
            keys[b].append(rows[:n, 0]), values[b].append(rows[:n, 1])
            positions[b].append(torch.arange(n))
    plan = attention.paged_plan(table, used, page_rows=ROWS, pad_pages=4, pool_pages=pool_pages)
    assert plan.whole and len(plan.chains) == 1 and plan.chains[0].count == 5 + 4
    assert plan.capacity is not None and plan.capacity.tolist() == [9] * 6
    bounded = attention.paged_plan(table, used, page_rows=ROWS, pad_pages=4, pool_pages=48)
    assert bounded.capacity is not None and bounded.capacity.tolist() == [8] * 6  # pool's end
    q = torch.randn(batch, owners * 2, D_H, generator=generator)
    expected, expected_lse = dense_reference(q, keys, values, positions, None, 0.3, 2)
    leaked, _ = paged_decode_attention(q, pool_k, pool_v, table, lengths, 0.3, plan=plan)
    assert bool(leaked.isnan().any())  # the longest owner's span crosses the others' NaN pages
    padding = plan.padding()
    assert padding.tolist() == [p for s in range(6)
                                for p in range(stride * s + int(used[s]), stride * s + 9)]
    fresh = padding[pool_k[padding].isnan().flatten(1).any(dim=1)]  # never written, as clean
    pool_k[fresh], pool_v[fresh] = 0.0, 0.0
    out, lse = paged_decode_attention(q, pool_k, pool_v, table, lengths, 0.3, plan=plan)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)
    assert plan.holds(table, used)
    grown, grown_used = table.clone(), used.clone()
    grown[1, 1, 1:5] = torch.arange(stride * 3 + 1, stride * 3 + 5)  # 1 -> 5 pages, in place
    grown_used[3] = 5
    assert plan.holds(grown, grown_used)
    grown_used[3] = 10  # past its capacity of 9
    assert not plan.holds(grown, grown_used)
    moved = table.clone()
    moved[0, 1, 3] = 40  # a page outside the run
    assert not plan.holds(moved, used)
    assert not attention.paged_plan(table, used, page_rows=ROWS).holds(table, used)


def test_clean_zeroes_only_the_pages_nothing_wrote():
    pool = PagePool(6, D_H, torch.float32, page_rows=ROWS)
    pool.keys.fill_(float("nan")), pool.values.fill_(float("nan"))  # what torch.empty may hold
    lease = pool.ledger.reserve(0, "r")
    taken = pool.allocate(lease, 2)  # zeroed
    pool.keys[taken[0]] = 7.0
    pool.free(lease, taken[:1])  # a freed page keeps its (finite) rows
    pool.clean(torch.tensor([0, 1, 2, 3]))
    assert bool((pool.keys[0] == 7.0).all()) and bool((pool.keys[1:4] == 0).all())
    assert bool(pool.keys[4:].isnan().all()) and bool(pool.values[4:].isnan().all())
    pool.keys[2] = float("nan")  # a page is cleaned once, not every time a plan reads it
    pool.clean(torch.tensor([2]))
    assert bool(pool.keys[2].isnan().all())


def test_a_plan_holds_while_owners_grow_in_place_and_non_finite_rows_are_stored_finite():
    """A padded plan is built once and kept while decode steps and appended rows (a recall's)
    grow owners in place across pages, the logits those of the padded reference; a request's
    NaN and infinite K/V rows are stored finite, so a neighbour's masked read never meets them,
    and that request's own logits are NaN (it fails alone, as it would have)."""
    from services.model.padded_cache import PaddedDecodeCache

    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = symbolic(12)
    keys, values = keys / 1000, values / 1000
    view = pack(keys, values, SELECTED)
    cache = DecodeCache(config, torch.float32, batch_capacity=2, row_capacity=64,
                        page_rows=ROWS, pool=PagePool(256, D_H, torch.float32, page_rows=ROWS))
    reference = PaddedDecodeCache(config, torch.float32, batch_capacity=2, row_capacity=64)
    for each in (cache, reference):
        each.admit_view("a", view, frontier=12)
        each.admit_dense("b", keys, values)
    decode_step(model, cache, [1, 2]), decode_step(model, reference, [1, 2])
    plans = list(cache._plans)
    assert all(plan is not None and plan.capacity is not None for plan in plans)
    for token in range(3, 9):  # owners of 2 to 14 rows cross pages: pages added in place
        torch.testing.assert_close(decode_step(model, cache, [token, token + 1]),
                                   decode_step(model, reference, [token, token + 1]),
                                   atol=1e-5, rtol=1e-5)
    assert all(kept is now for kept, now in zip(plans, cache._plans, strict=True))
    held = cache.lengths("a")
    cache.append_rows("a", 1, 1, keys[1, 1, 10:11], values[1, 1, 10:11], torch.tensor([10]))
    decode_step(model, cache, [3, 4])
    assert all(kept is now for kept, now in zip(plans, cache._plans, strict=True))
    assert int(cache.lengths("a")[1, 1]) == int(held[1, 1]) + 2

    bad_k, bad_v = keys.clone(), values.clone()
    bad_k[0, 1, 4], bad_v[1, 0, 7] = float("nan"), float("inf")
    cache.admit_dense("c", bad_k, bad_v)
    k, v, _ = cache.rows("c", 0, 1)
    assert bool(k.isfinite().all()) and bool((k[4] == 0).all())
    _, v, _ = cache.rows("c", 1, 0)
    assert bool(v.isfinite().all()) and bool((v[7] == torch.finfo(torch.float32).max).all())
    logits = decode_step(model, cache, [5, 6, 7])
    assert bool(logits[:2].isfinite().all()) and bool(logits[2].isnan().all())  # "c" fails alone
    cache.release("c")
    cache.admit_dense("d", keys, values)  # its slot, clean again
    assert bool(decode_step(model, cache, [5, 6, 7]).isfinite().all())
