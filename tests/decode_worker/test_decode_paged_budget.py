"""The decode loop's KV budget is its page pool (issue 17): the reservation admission control
holds is trimmed to exactly the pages the request's (layer, owner) rows will take, the pages
it allocates are charged to it, and a request that needs a page the budget does not have fails
alone (RESOURCE_EXHAUSTED naming kv_budget_bytes) while the rest of its batch goes on."""

from __future__ import annotations

import queue
import time

import pytest
import torch
from decode_helpers import prompt_ids, run_prefill, save_tiny_llama

from decode_worker.config import SchedulerConfig
from decode_worker.errors import CapacityExhausted
from decode_worker.scheduler import (
    DecodeFailed,
    DecodeFinished,
    DecodeRequest,
    DecodeScheduler,
    TokenOut,
    reservation_bytes,
)
from decode_worker.stream import failure
from services.kvpolicy.packing import pack
from services.model import SamplingParams, load
from services.model.paged import page_nbytes
from services.model.sampler import FINISH_LENGTH
from services.transfer import ViewLayout

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)
WAIT_S = 30.0
PAGE_ROWS = 16
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(directory, seed=3)
    return load(directory)


class Recorder:
    """Records a request's events, and the budget's pages as each token is handed on (the
    loop thread calls it between the step and the release)."""

    def __init__(self, scheduler: DecodeScheduler) -> None:
        self.scheduler = scheduler
        self.events: queue.Queue = queue.Queue()
        self.usage: list[tuple[int, int]] = []  # (reserved, allocated) bytes per token

    def __call__(self, event) -> None:
        if isinstance(event, TokenOut):
            budget = self.scheduler.budget
            self.usage.append((budget.used_bytes, budget.allocated_bytes))
        self.events.put(event)

    def drain(self) -> tuple[list[TokenOut], DecodeFinished | DecodeFailed]:
        tokens, deadline = [], time.monotonic() + WAIT_S
        while True:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if not isinstance(event, TokenOut):
                return tokens, event
            tokens.append(event)


def selection(length: int, counts: list[list[int]]) -> list[list[list[int]]]:
    """The last `n` positions of the prompt per (layer, owner)."""
    return [[list(range(length - n, length)) for n in per_layer] for per_layer in counts]


def submit(scheduler, name, prefilled, selected, nbytes: int | None = None) -> Recorder:
    view = pack(prefilled.result.source_k, prefilled.result.source_v, selected)
    if nbytes is None:
        nbytes = reservation_bytes(ViewLayout.of(view), MAX_TOKENS, scheduler.loaded.dtype,
                                   page_rows=PAGE_ROWS)
    sink = Recorder(scheduler)
    scheduler.submit(DecodeRequest(
        request_id=name, view=view, frontier=prefilled.length, first_token=prefilled.first_token,
        sampling=SamplingParams(ignore_eos=True), max_tokens=MAX_TOKENS, cache_generation=1,
        reservation=scheduler.budget.reserve(nbytes, name), sink=sink,
    ))
    return sink


def start(loaded, budget_bytes: int) -> DecodeScheduler:
    config = SchedulerConfig(max_batch=4, kv_budget_bytes=budget_bytes, page_rows=PAGE_ROWS)
    scheduler = DecodeScheduler(loaded, config)
    scheduler.start()
    return scheduler


def test_the_reservation_is_the_pages_the_request_allocates(loaded):
    page = page_nbytes(PAGE_ROWS, loaded.config.head_dim, loaded.dtype)
    scheduler = start(loaded, 64 * 1024 * 1024)
    try:
        prefilled = run_prefill(loaded, prompt_ids(40, seed=1))
        counts = [[3, 16], [29, 40]]  # uneven per (layer, owner), one exactly a page
        sink = submit(scheduler, "r", prefilled, selection(40, counts))
        tokens, finished = sink.drain()
        assert isinstance(finished, DecodeFinished) and finished.reason == FINISH_LENGTH
        # Every owner ends with its rows plus MAX_TOKENS - 1 decoded ones, in whole pages.
        exact = sum(-(-(n + MAX_TOKENS - 1) // PAGE_ROWS) for per_layer in counts
                    for n in per_layer)
        view = pack(prefilled.result.source_k, prefilled.result.source_v, selection(40, counts))
        worst = reservation_bytes(ViewLayout.of(view), MAX_TOKENS, loaded.dtype, page_rows=PAGE_ROWS)
        assert exact * page < worst  # what accept reserved: each owner rounded up at worst
        reserved = {r for r, _ in sink.usage}
        assert reserved == {exact * page}  # trimmed at admission, before the first step
        assert all(allocated <= exact * page for _, allocated in sink.usage)
        assert sink.usage[-1][1] == exact * page  # the last step fills the reservation
        assert (scheduler.budget.used_bytes, scheduler.budget.allocated_bytes) == (0, 0)
    finally:
        scheduler.stop()


def test_a_request_without_pages_fails_alone_naming_the_budget(loaded):
    page = page_nbytes(PAGE_ROWS, loaded.config.head_dim, loaded.dtype)
    prefilled = run_prefill(loaded, prompt_ids(40, seed=2))
    counts = [[16, 16], [16, 16]]  # 4 full pages: every owner needs a page at its first step
    honest_pages = 4 * -(-(16 + MAX_TOKENS - 1) // PAGE_ROWS)
    scheduler = start(loaded, (honest_pages + 4 + 2) * page)  # room for the greedy one's view
    try:
        honest = submit(scheduler, "honest", prefilled, selection(40, counts))
        greedy = submit(scheduler, "greedy", prefilled, selection(40, counts), nbytes=1)
        tokens, finished = greedy.drain()
        assert isinstance(finished, DecodeFailed) and finished.exhausted
        assert "kv_budget_bytes" in finished.message and "greedy" in finished.message
        error = failure(None, finished)  # type: ignore[arg-type]
        assert isinstance(error, CapacityExhausted) and error.field == "kv_budget_bytes"
        tokens, finished = honest.drain()
        assert isinstance(finished, DecodeFinished) and len(tokens) == MAX_TOKENS - 1
        assert scheduler.pool.pages_in_use == 0 and scheduler.budget.used_bytes == 0
    finally:
        scheduler.stop()
