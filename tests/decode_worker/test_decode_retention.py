"""Decode-time retention in the decode loop (issue 18): for every method (window, sinks +
recent under both position contracts, H2O, Scissorhands, Keyformer, the scoring ones on a
SnapKV prompt view) the loop's tokens and the rows every (layer, owner) holds after every
step equal a dense reference that applies the same policy to plain K/V tensors; no owner
ever holds more than its budget; successors are published on the cadence and at the end,
each one the fenced successor of the last; a step taken back before its commit leaves
neither a row nor score state; a loop that dies mid-generation leaves the last published
state as it was."""

from __future__ import annotations

import queue
import time
from dataclasses import replace

import pytest
import torch
from decode_helpers import pack_state, prompt_ids, run_prefill, save_tiny_llama

from decode_worker.config import SchedulerConfig
from decode_worker.retention import RetentionSession
from decode_worker.scheduler import (
    DecodeFailed,
    DecodeFinished,
    DecodeRequest,
    DecodeScheduler,
    TokenOut,
    reservation_bytes,
)
from services.kvpolicy.manifest import (
    Fidelity,
    KVVisibilityPolicyManifest,
    Phase,
    UpdateCadence,
    default_manifests,
)
from services.kvpolicy.retention import append, new_state, step
from services.kvpolicy.retention_contract import (
    KeyformerParams,
    PositionContract,
    RetentionContract,
    RetentionMethod,
    ScissorhandsParams,
    ScoreOwner,
)
from services.model import DecodeCache, SamplingParams, decode_step, load
from services.model.layers import apply_rotary
from services.telemetry import metrics
from services.transfer import ViewLayout

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)
WAIT_S = 30.0
PROMPT, MAX_TOKENS = 16, 12


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(directory, seed=5)
    return load(directory)


@pytest.fixture
def scheduler(loaded):
    started = DecodeScheduler(loaded, SchedulerConfig(max_batch=4, kv_budget_bytes=16 * 1024 * 1024))
    started.start()
    yield started
    started.stop()


def retaining(loaded, base: str, contract: RetentionContract) -> KVVisibilityPolicyManifest:
    """A default manifest of the tiny model with `contract` as its decode-time retention."""
    manifests = default_manifests(loaded.tensor_contract, recent_window=contract.recent_window,
                                  sinks=max(contract.sinks, 1), observation_window=4)
    manifest = manifests[base]
    selection = replace(manifest.selection, phase=Phase.BOTH, update_cadence=UpdateCadence.EVERY_STEP,
                        retention=contract)
    representation = replace(manifest.representation, fidelity=Fidelity.LOSSY_SUBSET)
    return replace(manifest, selection=selection, representation=representation)


CASES = {
    "window": ("window", RetentionContract(RetentionMethod.WINDOW, budget_rows=6, recent_window=6)),
    "sink-recent": ("sink-recent", RetentionContract(RetentionMethod.SINK_RECENT, budget_rows=7, recent_window=5,
                                                     sinks=2)),
    "sink-recent-local": ("sink-recent", RetentionContract(RetentionMethod.SINK_RECENT, budget_rows=7,
                                                           recent_window=5, sinks=2,
                                                           positions=PositionContract.CACHE_LOCAL)),
    "h2o": ("snapkv", RetentionContract(RetentionMethod.H2O, budget_rows=6, recent_window=2)),
    "h2o-max": ("snapkv", RetentionContract(RetentionMethod.H2O, budget_rows=6, recent_window=2,
                                            score_owner=ScoreOwner.KV_HEAD_MAX)),
    "scissorhands": ("snapkv", RetentionContract(RetentionMethod.SCISSORHANDS, budget_rows=6, recent_window=2,
                                                 scissorhands=ScissorhandsParams(history_window=4, drop_batch=2))),
    "keyformer": ("snapkv", RetentionContract(RetentionMethod.KEYFORMER, budget_rows=6, recent_window=2,
                                              keyformer=KeyformerParams(schedule_steps=8, noise_seed=3))),
}


class DenseRetention:
    """The same policy applied densely, independent of the paged store and its capture: plain
    K, V and position tensors per (layer, owner); attention a softmax over every candidate
    row (keys rotated to their slot from stored pre-RoPE keys when cache-local); the pure
    decisions of services.kvpolicy.retention; K, V and positions gathered with `keep`."""

    def __init__(self, loaded, contract: RetentionContract, view, frontier: int) -> None:
        self.model, self.contract, self.frontier, self.steps = loaded.model, contract, frontier, 0
        self.local = contract.positions is PositionContract.CACHE_LOCAL
        self.layers, self.owners = view.num_layers, view.num_kv_heads
        self.group = loaded.config.num_q_heads // self.owners
        self.k, self.v, self.p = [], [], []
        for layer in range(self.layers):
            ks, vs, ps = [], [], []
            for h in range(self.owners):
                rows = view.rows(layer, h)
                k, p = view.packed_k[rows].float(), view.original_position_map[rows].long()
                if self.local:  # post-RoPE at original positions -> pre-RoPE
                    cos, sin = self.model.rope(p, k.dtype)
                    k = apply_rotary(k[:, None], cos, -sin)[:, 0]
                ks.append(k), vs.append(view.packed_v[rows].float()), ps.append(p)
            self.k.append(ks), self.v.append(vs), self.p.append(ps)
        lengths = torch.tensor([len(p) for per_layer in self.p for p in per_layer])
        padded = torch.full((len(lengths), int(lengths.max())), -1, dtype=torch.long)
        for n, p in enumerate(p for per_layer in self.p for p in per_layer):
            padded[n, : len(p)] = p
        self.state = new_state(contract, padded, lengths)

    def step(self, token: int) -> torch.Tensor:
        probs: dict[int, list[torch.Tensor]] = {}
        rotary_at = torch.tensor([0 if self.local else self.frontier])
        logits = self.model(torch.tensor([token]), rotary_at, lambda layer: self._attend(layer, probs))
        self._retain(probs)
        self.frontier += 1
        return logits[0]

    def resident(self) -> list[list[list[int]]]:
        return [[p.tolist() for p in per_layer] for per_layer in self.p]

    def _attend(self, layer: int, probs: dict[int, list[torch.Tensor]]):
        def attend(q, k, v):  # q [1, H_q, d_h]; k, v [1, H_kv, d_h]
            out = torch.empty_like(q)
            probs[layer] = []
            for h in range(self.owners):
                self.k[layer][h] = torch.cat([self.k[layer][h], k[0, h][None]])
                self.v[layer][h] = torch.cat([self.v[layer][h], v[0, h][None]])
                self.p[layer][h] = torch.cat([self.p[layer][h], torch.tensor([self.frontier])])
                keys, n = self.k[layer][h], self.k[layer][h].shape[0]
                if self.local:
                    cos, sin = self.model.rope(torch.arange(n), keys.dtype)
                    keys = apply_rotary(keys[:, None], cos, sin)[:, 0]
                for g in range(self.group):
                    query = q[0, h * self.group + g]
                    if self.local:
                        query = apply_rotary(query[None, None], cos[n - 1:], sin[n - 1:])[0, 0]
                    weights = torch.softmax(keys @ query * self.model.scale, 0)
                    out[0, h * self.group + g] = weights @ self.v[layer][h]
                    probs[layer].append(weights)
            return out
        return attend

    def _retain(self, probs: dict[int, list[torch.Tensor]]) -> None:
        contract, owners = self.contract, self.owners
        candidates = append(contract, self.state, torch.full((self.layers * owners,), self.frontier))
        attn = None
        if contract.method.scores:
            attn = torch.zeros(candidates.positions.shape)
            for layer in range(self.layers):
                for h in range(owners):
                    group = torch.stack(probs[layer][h * self.group:(h + 1) * self.group])  # [G, n]
                    reduced = group.amax(0) if contract.score_owner is ScoreOwner.KV_HEAD_MAX else group.mean(0)
                    attn[layer * owners + h, : reduced.numel()] = reduced
        out = step(contract, candidates, attn, self.steps)
        for n in range(self.layers * owners):
            layer, h = divmod(n, owners)
            keep = out.keep[n, : int(out.lengths[n])]
            self.k[layer][h], self.v[layer][h], self.p[layer][h] = (
                self.k[layer][h][keep], self.v[layer][h][keep], self.p[layer][h][keep])
        self.state, self.steps = out.state, self.steps + 1


class Recorder:
    """A sink for one request's events and an `on_successor` hook recording what it is told."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.published: list = []

    def __call__(self, event) -> None:
        self.events.put(event)

    def drain(self, timeout_s: float = WAIT_S):
        tokens, deadline = [], time.monotonic() + timeout_s
        while True:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if not isinstance(event, TokenOut):
                return tokens, event
            tokens.append(event)


def retaining_request(scheduler, loaded, name: str, case: str, max_tokens: int = MAX_TOKENS, every: int = 1):
    base, contract = CASES[case]
    contract = replace(contract, publish_every_steps=every)
    manifest = retaining(loaded, base, contract)
    prefilled = run_prefill(loaded, prompt_ids(PROMPT, seed=31))
    packed = pack_state(manifest, prefilled, name)
    recorder = Recorder()
    session = RetentionSession(manifest, contract, packed.state, on_successor=recorder.published.append)
    nbytes = reservation_bytes(ViewLayout.of(packed.view), max_tokens, loaded.dtype)
    request = DecodeRequest(
        request_id=name, view=packed.view, frontier=prefilled.length, first_token=prefilled.first_token,
        sampling=SamplingParams(ignore_eos=True), max_tokens=max_tokens, cache_generation=packed.state.cache_generation,
        reservation=scheduler.budget.reserve(nbytes, name), sink=recorder, retention=session,
    )
    return request, recorder, packed, contract


@pytest.mark.parametrize("case", list(CASES))
def test_the_loop_retains_like_the_dense_reference_within_budget_at_every_step(loaded, scheduler, case):
    over_budget = metrics.RETENTION_OVER_BUDGET._value.get()
    observed = metrics.RETENTION_RESIDENT._sum.get(), sum(b.get() for b in metrics.RETENTION_RESIDENT._buckets)
    request, recorder, packed, contract = retaining_request(scheduler, loaded, f"ret-{case}", case)
    scheduler.submit(request)
    tokens, finished = recorder.drain()
    assert isinstance(finished, DecodeFinished), finished
    reference = DenseRetention(loaded, contract, packed.view, PROMPT)
    token, expected, logprobs, resident = packed.prefilled.first_token, [], [], []
    for _ in range(MAX_TOKENS - 1):
        logits = reference.step(token)
        token = int(logits.argmax())
        expected.append(token)
        logprobs.append(float(torch.log_softmax(logits, 0)[token]))
        resident.append(reference.resident())
    assert [t.token_id for t in tokens] == expected
    assert [t.logprob for t in tokens] == pytest.approx(logprobs, abs=1e-5)
    published = recorder.published  # every step (publish_every_steps 1): what each step kept
    assert len(published) == MAX_TOKENS - 1
    for index, state in enumerate(published):
        assert [[list(owner) for owner in layer] for layer in state.selected_positions] == resident[index], index
        assert max(len(owner) for layer in state.selected_positions for owner in layer) <= contract.budget_rows
        assert state.frontier == PROMPT + index + 1
    assert metrics.RETENTION_OVER_BUDGET._value.get() == over_budget
    steps = sum(b.get() for b in metrics.RETENTION_RESIDENT._buckets) - observed[1]
    resident_sum = metrics.RETENTION_RESIDENT._sum.get() - observed[0]
    assert steps == MAX_TOKENS - 1 and resident_sum <= steps * contract.budget_rows  # a sample a step
    ledger = finished.retention
    assert ledger is not None and ledger.resident_max <= contract.budget_rows
    assert (ledger.decode_method, ledger.prompt_method) == (contract.method.value, packed.manifest.selection.method.value)
    assert ledger.layout == "compacted" and ledger.evicted_rows > 0
    assert scheduler.budget.used_bytes == 0


def test_successors_follow_the_cadence_each_the_fenced_successor_of_the_last(loaded, scheduler):
    request, recorder, packed, _ = retaining_request(scheduler, loaded, "cadence", "h2o", max_tokens=11, every=4)
    scheduler.submit(request)
    tokens, finished = recorder.drain()
    assert isinstance(finished, DecodeFinished) and len(tokens) == 10
    published = recorder.published  # 10 steps: after steps 3 and 7 (0-based), then at the end
    assert [s.frontier for s in published] == [PROMPT + 4, PROMPT + 8, PROMPT + 10]
    parent = packed.state
    for state in published:
        assert (state.parent_state_generation, state.state_generation) == (
            parent.state_generation, parent.state_generation + 1)
        assert state.request_generation == parent.request_generation and state.cache_generation > parent.cache_generation
        parent = state
    assert finished.cache_generation == published[-1].cache_generation == packed.state.cache_generation + 10
    assert finished.retention.publications == 3


def test_a_step_taken_back_before_its_commit_leaves_neither_a_row_nor_score_state(loaded):
    _, contract = CASES["h2o"]
    manifest = retaining(loaded, "snapkv", contract)
    packed = pack_state(manifest, run_prefill(loaded, prompt_ids(PROMPT, seed=31)), "undo")
    cache = DecodeCache(loaded.config, loaded.dtype, page_rows=4)
    session = RetentionSession(manifest, contract, packed.state)
    cache.admit_view("undo", packed.view, PROMPT, contract=session.row_contract)
    session.admitted(cache)
    token = packed.prefilled.first_token
    decode_step(loaded.model, cache, [token])
    committed = session.commit(cache, session.decide(cache))
    lengths, scores = cache.lengths("undo"), session.scores
    logits = decode_step(loaded.model, cache, [5])
    session.decide(cache)  # decided, never committed: the step is cancelled
    cache.undo_step()
    assert torch.equal(cache.lengths("undo"), lengths) and session.scores is scores
    assert session.generation == 1 and committed.step == 0
    again = decode_step(loaded.model, cache, [5])  # the step's rerun: the same evidence and logits
    torch.testing.assert_close(again, logits)
    session.commit(cache, session.decide(cache))
    assert session.generation == 2 and int(cache.lengths("undo").max()) <= contract.budget_rows


def test_a_loop_that_dies_mid_generation_leaves_the_last_published_state(loaded):
    dying = DecodeScheduler(loaded, SchedulerConfig(max_batch=1, kv_budget_bytes=16 * 1024 * 1024))
    dying.start()
    try:
        request, recorder, packed, _ = retaining_request(dying, loaded, "dies", "window", max_tokens=4000, every=3)
        dying.submit(request)
        deadline = time.monotonic() + WAIT_S
        while len(recorder.published) < 2 and time.monotonic() < deadline:
            recorder.events.get(timeout=WAIT_S)
        assert len(recorder.published) >= 2
    finally:
        dying.stop()  # the worker goes away mid-generation
    _, failed = recorder.drain()
    assert isinstance(failed, DecodeFailed)
    last = recorder.published[-1]
    # Nothing after the last cadence point reached the policy service: no final publication
    # for a request that did not finish, and every publication is on the cadence.
    assert all((s.frontier - PROMPT) % 3 == 0 for s in recorder.published)
    assert last.state_generation == packed.state.state_generation + len(recorder.published)
    assert request.retention.steps >= last.frontier - PROMPT


@pytest.mark.parametrize("case", ["sink-recent-local", "scissorhands"])
def test_decode_kv_bytes_stay_flat_however_long_the_generation(loaded, case):
    """Once retention first evicts, the request's pages never change: 64 steps on a budget of
    6-7 rows per owner hold the same allocated bytes, never more rows than L x H x budget."""
    _, contract = CASES[case]
    manifest = retaining(loaded, "snapkv" if contract.method.scores else "sink-recent", contract)
    packed = pack_state(manifest, run_prefill(loaded, prompt_ids(PROMPT, seed=31)), "flat")
    cache = DecodeCache(loaded.config, loaded.dtype, page_rows=4)  # rows cross pages
    session = RetentionSession(manifest, contract, packed.state)
    cache.admit_view("flat", packed.view, PROMPT, contract=session.row_contract)
    session.admitted(cache)
    token, allocated = packed.prefilled.first_token, set()
    owners = loaded.config.num_layers * cache.num_owners
    for _ in range(64):
        logits = decode_step(loaded.model, cache, [token])
        session.commit(cache, session.decide(cache))
        ledger = cache.ledger("flat")
        assert ledger.rows <= owners * contract.budget_rows
        if ledger.layout == "compacted":  # from the first eviction on
            allocated.add(ledger.allocated_bytes)
        token = int(logits[0].argmax())
    assert len(allocated) == 1 and cache.pool.pages_in_use == cache.ledger().pages
    assert session.evicted_rows > 50
