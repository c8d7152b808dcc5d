"""Offload store: byte bound, LRU, leases on a fake clock, fencing, fetch, thread safety."""

from __future__ import annotations

import threading
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_helpers import symbolic_kv

from services.offload.errors import PageRefInvalid, StoreInvalid
from services.offload.pages import OmittedRows, PageRef, gather_omitted, summarize_pages
from services.offload.store import (
    OffloadStore,
    OffloadStoreConfig,
    OnFull,
    RefusalReason,
    Refused,
    Stored,
    StoreKey,
)

torch.set_num_threads(1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@cache
def omitted(tokens: int) -> OmittedRows:
    """One layer, two K/V heads, d_h 4; every position omitted, pages of 4."""
    k, v = symbolic_kv(1, 2, tokens, 4)
    return gather_omitted(k, v, summarize_pages(k, [[[], []]], page_size=4))


def key(request: str, generation: int = 1, state: int = 1) -> StoreKey:
    return StoreKey(request, generation, state)


def make_store(capacity: int, on_full: OnFull = OnFull.EVICT_LRU) -> tuple[OffloadStore, FakeClock]:
    clock = FakeClock()
    return OffloadStore(OffloadStoreConfig(capacity, lease_s=10.0, on_full=on_full), clock), clock


def test_fetch_returns_the_symbolic_rows_of_the_asked_pages() -> None:
    k, v = symbolic_kv(2, 2, 10, 3)
    rows = gather_omitted(k, v, summarize_pages(k, [[[0, 1, 5, 9], [2, 3]], [[], []]], 3))
    store, _ = make_store(10_000)
    assert isinstance(store.put(key("a"), rows), Stored)
    fetched = store.fetch(key("a"), [PageRef(0, 1, 1), PageRef(1, 1, 3)])
    assert fetched.missing == ()
    first, second = fetched.pages
    assert first.positions.tolist() == [4, 5, 6]
    assert first.k.tolist() == [[100 + 10 * t + c for c in range(3)] for t in (4, 5, 6)]
    assert second.positions.tolist() == [9]
    assert second.v.tolist() == [[6000 + 100 + 90 + c for c in range(3)]]
    assert fetched.rows == 4 and fetched.nbytes == 4 * (2 * 3 * 4 + 4)
    with pytest.raises(PageRefInvalid) as info:
        store.fetch(key("a"), [PageRef(0, 0, 0), PageRef(0, 0, 2)])
    assert info.value.field == "pages[1].page_index"


def test_bytes_return_to_zero_after_release() -> None:
    store, _ = make_store(10_000)
    for name in ("a", "b"):
        store.put(key(name, 1, 1), omitted(8))
        store.put(key(name, 1, 2), omitted(4))
    assert store.used_bytes == 2 * (omitted(8).nbytes + omitted(4).nbytes)
    assert store.release("a") == omitted(8).nbytes + omitted(4).nbytes
    assert store.keys() == (key("b", 1, 1), key("b", 1, 2))
    store.release("b")
    assert store.used_bytes == 0 and store.keys() == ()
    assert store.fetch(key("a"), [PageRef(0, 0, 0)]).missing == (PageRef(0, 0, 0),)


def test_lease_expires_unless_renewed() -> None:
    store, clock = make_store(10_000)
    stored = store.put(key("a"), omitted(4))
    assert isinstance(stored, Stored) and stored.lease_deadline == 10.0
    store.put(key("b"), omitted(4))
    clock.now = 9.5
    assert store.renew("a", 1) == 1
    assert store.renew("a", 2) == 0  # another request generation holds nothing
    clock.now = 10.0
    assert store.keys() == (key("a"),)  # b's lease ran out at 10.0
    assert store.used_bytes == omitted(4).nbytes
    clock.now = 15.0
    assert store.fetch(key("a"), [PageRef(0, 0, 0)]).missing == ()  # fetching renews too
    clock.now = 24.9
    assert store.expire() == ()
    clock.now = 25.0
    assert store.expire() == (key("a"),)
    assert store.used_bytes == 0
    assert store.renew("a", 1) == 0


def test_fence_releases_older_generations_and_refuses_them_later() -> None:
    store, _ = make_store(10_000)
    store.put(key("a", 1), omitted(4))
    store.put(key("b", 1), omitted(4))
    assert store.fence("a", 2) == omitted(4).nbytes
    assert store.keys() == (key("b", 1),)
    late = store.put(key("a", 1, 2), omitted(4))
    assert isinstance(late, Refused) and late.reason is RefusalReason.STALE_GENERATION
    assert isinstance(store.put(key("a", 2), omitted(4)), Stored)
    newer = store.put(key("a", 3), omitted(8))  # a newer generation fences out generation 2
    assert isinstance(newer, Stored) and newer.evicted == ()
    assert store.keys() == (key("b", 1), key("a", 3))
    assert store.used_bytes == omitted(4).nbytes + omitted(8).nbytes


def test_lru_eviction_makes_room_and_reports_the_victims() -> None:
    store, _ = make_store(2 * omitted(8).nbytes)
    store.put(key("a"), omitted(8))
    store.put(key("b"), omitted(8))
    store.fetch(key("a"), [])  # a is now the most recently used
    stored = store.put(key("c"), omitted(8))
    assert isinstance(stored, Stored) and stored.evicted == (key("b"),)
    assert store.keys() == (key("a"), key("c"))
    assert store.fetch(key("b"), [PageRef(0, 0, 0)]).missing == (PageRef(0, 0, 0),)


def test_a_request_never_evicts_its_own_rows() -> None:
    store, _ = make_store(omitted(8).nbytes + omitted(4).nbytes)
    store.put(key("a", 1, 1), omitted(8))
    refused = store.put(key("a", 1, 2), omitted(8))
    assert isinstance(refused, Refused) and refused.reason is RefusalReason.STORE_FULL
    assert store.keys() == (key("a", 1, 1),)
    replaced = store.put(key("a", 1, 1), omitted(4))  # the same key replaces its entry
    assert isinstance(replaced, Stored) and store.used_bytes == omitted(4).nbytes


def test_refuse_policy_keeps_every_live_entry() -> None:
    store, _ = make_store(2 * omitted(8).nbytes, OnFull.REFUSE)
    store.put(key("a"), omitted(8))
    store.put(key("b"), omitted(8))
    refused = store.put(key("c"), omitted(4))
    assert isinstance(refused, Refused) and refused.reason is RefusalReason.STORE_FULL
    assert (refused.used_bytes, refused.capacity_bytes) == (2 * omitted(8).nbytes,) * 2
    assert store.keys() == (key("a"), key("b"))


def test_an_entry_above_capacity_is_refused() -> None:
    store, _ = make_store(omitted(8).nbytes - 1)
    refused = store.put(key("a"), omitted(8))
    assert isinstance(refused, Refused) and refused.reason is RefusalReason.LARGER_THAN_CAPACITY
    assert store.used_bytes == 0


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from("abc"), st.integers(1, 3), st.integers(1, 2),
                  st.sampled_from([4, 8, 16])),
        st.tuples(st.just("fetch"), st.sampled_from("abc"), st.integers(1, 3), st.integers(1, 2)),
        st.tuples(st.just("renew"), st.sampled_from("abc"), st.integers(1, 3)),
        st.tuples(st.just("release"), st.sampled_from("abc")),
        st.tuples(st.just("fence"), st.sampled_from("abc"), st.integers(1, 3)),
        st.tuples(st.just("tick"), st.floats(0.0, 6.0)),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(OPS, st.sampled_from(list(OnFull)), st.integers(1, 3))
def test_bytes_never_exceed_the_bound_and_return_to_zero(
    ops: list[tuple], on_full: OnFull, entries: int
) -> None:
    store, clock = make_store(entries * omitted(8).nbytes, on_full)
    sizes: dict[StoreKey, int] = {}
    floors: dict[str, int] = {}
    for op in ops:
        if op[0] == "put":
            k = key(op[1], op[2], op[3])
            result = store.put(k, omitted(op[4]))
            if isinstance(result, Stored):
                sizes[k] = result.nbytes
            if op[2] < floors.get(op[1], 0):
                assert isinstance(result, Refused)
                assert result.reason is RefusalReason.STALE_GENERATION
            floors[op[1]] = max(floors.get(op[1], 0), op[2])
        elif op[0] == "fetch":
            fetched = store.fetch(key(op[1], op[2], op[3]), [PageRef(0, 0, 0)])
            assert len(fetched.pages) + len(fetched.missing) == 1
        elif op[0] == "renew":
            store.renew(op[1], op[2])
        elif op[0] == "release":
            store.release(op[1])
            floors.pop(op[1], None)
        elif op[0] == "fence":
            store.fence(op[1], op[2])
            floors[op[1]] = max(floors.get(op[1], 0), op[2])
        else:
            clock.now += op[1]
        held = store.keys()
        assert store.used_bytes == sum(sizes[k] for k in held) <= store.config.capacity_bytes
        assert all(k.request_generation >= floors.get(k.request_id, 0) for k in held)
    for request in "abc":
        store.release(request)
    assert store.used_bytes == 0 and store.keys() == ()


def test_concurrent_use_keeps_the_bound_and_ends_at_zero() -> None:
    store, _ = make_store(3 * omitted(8).nbytes)
    errors: list[BaseException] = []
    peak = [0]

    def worker(name: str) -> None:
        try:
            for i in range(150):
                k = key(name, 1 + i // 50, 1 + i % 2)
                store.put(k, omitted(8 if i % 3 else 16))
                store.fetch(k, [PageRef(0, 1, 0)])
                store.renew(name, k.request_generation)
                peak[0] = max(peak[0], store.used_bytes)
                if i % 7 == 0:
                    store.release(name)
        except BaseException as exc:  # surfaced below, a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(name,)) for name in "abcd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert 0 < peak[0] <= store.config.capacity_bytes
    for name in "abcd":
        store.release(name)
    assert store.used_bytes == 0


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: OffloadStoreConfig(0, 1.0), "capacity_bytes"),
        (lambda: OffloadStoreConfig(10, 0.0), "lease_s"),
        (lambda: OffloadStoreConfig(10, 1.0, "drop_oldest"), "on_full"),
        (lambda: StoreKey("", 1, 1), "request_id"),
        (lambda: StoreKey("a", 0, 1), "request_generation"),
        (lambda: StoreKey("a", 1, 0), "state_generation"),
    ],
)
def test_config_and_keys_are_validated(build: object, field: str) -> None:
    with pytest.raises(StoreInvalid) as info:
        build()  # type: ignore[operator]
    assert info.value.field == field
