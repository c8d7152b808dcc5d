"""The continuous-batching decode loop in-process: batched ragged views decode exactly as each
alone, full retention equals the model runtime's own greedy generation, stop conditions,
max batch, and the KV byte budget returning to zero after finish and cancellation."""

from __future__ import annotations

import queue
import random
import time
from dataclasses import replace

import pytest
import torch
from decode_helpers import EOS, prompt_ids, run_prefill, save_tiny_llama

from decode_worker.config import SchedulerConfig
from decode_worker.errors import CapacityExhausted
from decode_worker.scheduler import (
    FINISH_CANCELLED,
    DecodeFailed,
    DecodeFinished,
    DecodeRequest,
    DecodeScheduler,
    TokenOut,
    reservation_bytes,
)
from services.kvpolicy.packing import PackedKVView, pack
from services.model import SamplingParams, generate, load
from services.model.sampler import FINISH_EOS, FINISH_LENGTH, FINISH_STOP
from services.transfer import ViewLayout

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)
WAIT_S = 30.0


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(directory, seed=3)
    return load(directory)


@pytest.fixture
def scheduler(loaded):
    started = DecodeScheduler(loaded, SchedulerConfig(max_batch=4, kv_budget_bytes=64 * 1024 * 1024))
    started.start()
    yield started
    started.stop()


class Collector:
    """A sink that records one request's events (called from the loop thread)."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def __call__(self, event) -> None:
        self.events.put(event)

    def drain(self, timeout_s: float = WAIT_S) -> tuple[list[TokenOut], DecodeFinished | DecodeFailed]:
        tokens = []
        deadline = time.monotonic() + timeout_s
        while True:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if isinstance(event, TokenOut):
                tokens.append(event)
            else:
                return tokens, event


def ragged_selection(length: int, num_layers: int, num_heads: int, seed: int) -> list[list[list[int]]]:
    """A different random subset per (layer, K/V head), always keeping the last position."""
    rng = random.Random(seed)
    grid = []
    for _ in range(num_layers):
        owners = []
        for _ in range(num_heads):
            keep = rng.randint(1, length - 1)
            owners.append(sorted(rng.sample(range(length - 1), keep)) + [length - 1])
        grid.append(owners)
    return grid


def request_for(scheduler, name, prefilled, view: PackedKVView, sampling=SamplingParams(), max_tokens=8):
    sink = Collector()
    layout = ViewLayout.of(view)
    nbytes = reservation_bytes(layout, max_tokens, scheduler.loaded.dtype)
    request = DecodeRequest(
        request_id=name,
        view=view,
        frontier=prefilled.length,
        first_token=prefilled.first_token,
        sampling=sampling,
        max_tokens=max_tokens,
        cache_generation=1,
        reservation=scheduler.budget.reserve(nbytes, name),
        sink=sink,
    )
    return request, sink


def decode_alone(scheduler, name, prefilled, view, sampling=SamplingParams(), max_tokens=8):
    request, sink = request_for(scheduler, name, prefilled, view, sampling, max_tokens)
    scheduler.submit(request)
    return sink.drain()


def test_batched_ragged_views_decode_like_each_alone(loaded, scheduler):
    config = loaded.config
    cases = []
    for index, (length, sampling) in enumerate(
        [(13, SamplingParams()), (29, SamplingParams(temperature=0.8, top_k=20, seed=7)), (7, SamplingParams()),
         (21, SamplingParams(temperature=1.0, top_p=0.9, seed=11))]
    ):
        prefilled = run_prefill(loaded, prompt_ids(length, seed=100 + index))
        selected = ragged_selection(length, config.num_layers, config.num_kv_heads, seed=index)
        view = pack(prefilled.result.source_k, prefilled.result.source_v, selected)
        cases.append((f"r{index}", prefilled, view, sampling))

    alone = {name: decode_alone(scheduler, f"{name}-alone", p, v, s, 10) for name, p, v, s in cases}
    batched = [request_for(scheduler, name, p, v, s, 10) for name, p, v, s in cases]
    for request, _ in batched:
        scheduler.submit(request)
    for (name, *_), (_, sink) in zip(cases, batched, strict=True):
        tokens, finished = sink.drain()
        expected_tokens, expected_finish = alone[name]
        assert [t.token_id for t in tokens] == [t.token_id for t in expected_tokens], name
        assert [t.logprob for t in tokens] == pytest.approx([t.logprob for t in expected_tokens], abs=1e-4)
        assert [t.index for t in tokens] == list(range(1, len(tokens) + 1))
        assert finished.reason == expected_finish.reason
    assert scheduler.max_batch_seen == len(cases)
    assert scheduler.budget.used_bytes == 0


def test_full_retention_equals_runtime_greedy_generation(loaded, scheduler):
    for index, length in enumerate((5, 17, 40)):
        prompt = prompt_ids(length, seed=200 + index)
        expected = generate(loaded, prompt, max_new_tokens=12)
        prefilled = run_prefill(loaded, prompt)
        everything = [[list(range(length))] * loaded.config.num_kv_heads] * loaded.config.num_layers
        view = pack(prefilled.result.source_k, prefilled.result.source_v, everything)
        tokens, finished = decode_alone(scheduler, f"full-{index}", prefilled, view, max_tokens=12)
        assert [prefilled.first_token] + [t.token_id for t in tokens] == expected
        assert isinstance(finished, DecodeFinished)
        assert finished.output_tokens == len(expected)
        # One appended row per decode step: the cache generation counts the steps.
        assert finished.cache_generation == 1 + len(tokens)


def test_stop_conditions(loaded, scheduler):
    prefilled = run_prefill(loaded, prompt_ids(11, seed=300))
    view = pack(prefilled.result.source_k, prefilled.result.source_v, ragged_selection(11, 2, 2, seed=3))
    free_run, _ = decode_alone(scheduler, "free", prefilled, view, SamplingParams(ignore_eos=True), 6)
    stop_id = free_run[2].token_id
    first_stop = next(i for i, t in enumerate(free_run) if t.token_id == stop_id)

    tokens, finished = decode_alone(scheduler, "stop", prefilled, view, SamplingParams(stop_token_ids=(stop_id,)), 6)
    assert (finished.reason, len(tokens)) == (FINISH_STOP, first_stop + 1)
    tokens, finished = decode_alone(scheduler, "length", prefilled, view, SamplingParams(ignore_eos=True), 4)
    assert (finished.reason, finished.output_tokens, len(tokens)) == (FINISH_LENGTH, 4, 3)

    eos_first = replace(prefilled, first_token=EOS)
    tokens, finished = decode_alone(scheduler, "eos-first", eos_first, view, SamplingParams(), 6)
    assert (tokens, finished.reason, finished.output_tokens) == ([], FINISH_EOS, 1)
    tokens, finished = decode_alone(scheduler, "one-token", prefilled, view, SamplingParams(), 1)
    assert (tokens, finished.reason, finished.cache_generation) == ([], FINISH_LENGTH, 1)
    assert scheduler.budget.used_bytes == 0


def test_max_batch_bounds_every_step(loaded):
    limited = DecodeScheduler(loaded, SchedulerConfig(max_batch=2, kv_budget_bytes=64 * 1024 * 1024))
    limited.start()
    try:
        prefilled = run_prefill(loaded, prompt_ids(9, seed=400))
        view = pack(prefilled.result.source_k, prefilled.result.source_v, ragged_selection(9, 2, 2, seed=4))
        requests = [request_for(limited, f"b{i}", prefilled, view, SamplingParams(ignore_eos=True), 5) for i in range(5)]
        for request, _ in requests:
            limited.submit(request)
        outcomes = [sink.drain() for _, sink in requests]
        assert all(len(tokens) == 4 for tokens, _ in outcomes)
        assert limited.max_batch_seen == 2
        assert limited.budget.used_bytes == 0
    finally:
        limited.stop()


def test_cancellation_frees_kv_and_budget_is_enforced(loaded, scheduler):
    prefilled = run_prefill(loaded, prompt_ids(15, seed=500))
    view = pack(prefilled.result.source_k, prefilled.result.source_v, ragged_selection(15, 2, 2, seed=5))
    running, running_sink = request_for(scheduler, "long", prefilled, view, SamplingParams(ignore_eos=True), 4000)
    waiting, waiting_sink = request_for(scheduler, "short", prefilled, view, SamplingParams(ignore_eos=True), 3)
    assert scheduler.budget.used_bytes == running.reservation.nbytes + waiting.reservation.nbytes
    scheduler.submit(running)
    first = running_sink.events.get(timeout=WAIT_S)
    assert isinstance(first, TokenOut)
    scheduler.cancel("long")
    scheduler.cancel("never-submitted")  # unknown ids are ignored
    tokens, finished = running_sink.drain()
    assert finished.reason == FINISH_CANCELLED
    assert 1 + len(tokens) + 1 == finished.output_tokens  # first token + drained + the one read above
    assert scheduler.active == 0 and scheduler.budget.used_bytes == waiting.reservation.nbytes

    scheduler.submit(waiting)
    assert waiting_sink.drain()[1].reason == FINISH_LENGTH
    assert scheduler.budget.used_bytes == 0

    with pytest.raises(CapacityExhausted) as error:
        scheduler.budget.reserve(scheduler.budget.capacity_bytes + 1, "too big")
    assert error.value.field == "kv_budget_bytes"
    assert scheduler.budget.used_bytes == 0


def test_stopping_fails_what_is_left_and_releases_it(loaded):
    stopping = DecodeScheduler(loaded, SchedulerConfig(max_batch=1, kv_budget_bytes=64 * 1024 * 1024))
    stopping.start()
    prefilled = run_prefill(loaded, prompt_ids(6, seed=600))
    view = pack(prefilled.result.source_k, prefilled.result.source_v, ragged_selection(6, 2, 2, seed=6))
    requests = [request_for(stopping, f"s{i}", prefilled, view, SamplingParams(ignore_eos=True), 4000) for i in range(2)]
    for request, _ in requests:
        stopping.submit(request)
    assert isinstance(requests[0][1].events.get(timeout=WAIT_S), TokenOut)
    stopping.stop()
    for _, sink in requests:
        assert isinstance(sink.drain()[1], DecodeFailed)
    assert stopping.budget.used_bytes == 0
