"""The recall engine on a tiny random Llama: recalled steps against full-cache decode and a
dense masked-attention reference, fallbacks, cadence, page limits, successor states."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import pytest
import torch
from kv_helpers import symbolic_kv

from services.kvpolicy.compress import StateIdentity
from services.kvpolicy.compress import compress as compress_core
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    TimeoutFallback,
    default_manifests,
)
from services.kvpolicy.packing import PackedKVView, pack
from services.kvpolicy.state import KVPolicyState
from services.model import DecodeCache, PrefillOptions, PrefillResult, decode_step, prefill
from services.model.config import make_tensor_contract, parse_model_config
from services.model.kvcache import StepCapture
from services.model.model import CausalLM
from services.offload import recall as recall_engine
from services.offload.bound import (
    Ranking,
    code_logits,
    live_bias,
    live_grid,
    omitted_value_term,
    owner_readers,
    page_midpoint_logits,
    take_out_pages,
)
from services.offload.errors import BoundInputInvalid, RecallFailed, RecallUnavailable
from services.offload.pages import (
    OmittedRows,
    PageRef,
    PageSummaries,
    RecalledPage,
    gather_omitted,
    summarize_pages,
    with_value_means,
)
from services.offload.recall import (
    RecallKnobs,
    RecallOutcome,
    RecallSession,
    RecallStatus,
    RecallStrategy,
    cache_generation_after,
    decode_with_recall,
    merge_into_cache,
    plan_pool,
    with_recall,
)
from services.offload.store import OffloadStore, OffloadStoreConfig, StoreKey

torch.set_num_threads(1)

PROMPT = 40
OBS_WINDOW = 4
STEPS = 5
ATOL = 2e-5


def tiny_llama(seed: int = 3) -> CausalLM:
    """2 layers, H_q 4 on H_kv 2, d_h 8; q/k weights scaled up so attention is peaked."""
    config = parse_model_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 61,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 128,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "torch_dtype": "float32",
        }
    )
    torch.manual_seed(seed)
    model = CausalLM(config).eval().requires_grad_(False)
    for layer in model.model.blocks():
        layer.self_attn.q_proj.weight.mul_(3.0)
        layer.self_attn.k_proj.weight.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return tiny_llama()


@dataclass(frozen=True)
class Compressed:
    """One prompt prefilled and compressed by SnapKV (25%), with its omitted rows stored."""

    manifest: KVVisibilityPolicyManifest
    result: PrefillResult
    selected: tuple[tuple[tuple[int, ...], ...], ...]
    view: PackedKVView
    summaries: PageSummaries
    rows: OmittedRows
    state: KVPolicyState
    first_token: int


def compress(
    model: CausalLM, knobs: RecallKnobs, seed: int = 0, recallable: bool = True
) -> Compressed:
    tensor = make_tensor_contract(model.config, torch.float32)
    base = default_manifests(tensor, budget_fraction=0.25, observation_window=OBS_WINDOW)["snapkv"]
    manifest = with_recall(base, knobs) if recallable else base
    ids = torch.randint(3, 61, (PROMPT,), generator=torch.Generator().manual_seed(seed))
    result = prefill(model, ids, PrefillOptions(obs_window=OBS_WINDOW))
    packed = compress_core(manifest, result, StateIdentity("req", 1))
    view, state = packed.view, packed.state
    selected = state.selected_positions
    summaries = summarize_pages(result.source_k, selected, knobs.page_size,
                                code_bits=knobs.code_bits or 0)
    rows = gather_omitted(result.source_k, result.source_v, summaries)
    if knobs.value_term:
        summaries = with_value_means(summaries, rows)
    first = int(result.logits.argmax())
    return Compressed(manifest, result, selected, view, summaries, rows, state, first)


class StoreFetcher:
    """Fetches from a real OffloadStore holding the request's omitted rows; counts calls."""

    def __init__(self, rows: OmittedRows) -> None:
        self.store = OffloadStore(OffloadStoreConfig(capacity_bytes=1 << 24, lease_s=60.0))
        self.key = StoreKey("req", 1, 1)
        self.store.put(self.key, rows)
        self.calls: list[tuple[PageRef, ...]] = []

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        self.calls.append(tuple(refs))
        fetched = self.store.fetch(self.key, refs)
        if fetched.missing:
            raise RecallUnavailable(f"{len(fetched.missing)} pages gone")
        return fetched.pages


class FailingFetcher:
    """Raises RecallUnavailable for its first `failures` calls, then fetches."""

    def __init__(self, rows: OmittedRows, failures: int, timed_out: bool = True) -> None:
        self.inner = StoreFetcher(rows)
        self.failures, self.timed_out, self.calls = failures, timed_out, 0

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        self.calls += 1
        if self.calls <= self.failures:
            raise RecallUnavailable("offload tier did not answer", timed_out=self.timed_out)
        return self.inner(refs, timeout_s)


def view_cache(model: CausalLM, compressed: Compressed, request_id: str = "req",
               page_rows: int | None = None) -> DecodeCache:
    extra = {} if page_rows is None else {"page_rows": page_rows}
    cache = DecodeCache(model.config, torch.float32, row_capacity=8, **extra)
    cache.admit_view(request_id, compressed.view, frontier=PROMPT)
    return cache


def dense_cache(model: CausalLM, compressed: Compressed) -> DecodeCache:
    cache = DecodeCache(model.config, torch.float32, row_capacity=8)
    cache.admit_dense("req", compressed.result.source_k, compressed.result.source_v)
    return cache


def greedy(
    model: CausalLM, cache: DecodeCache, first: int, steps: int = STEPS
) -> list[torch.Tensor]:
    """Logits `[V]` of `steps` greedy steps of the cache's single request."""
    token, out = first, []
    for _ in range(steps):
        logits = decode_step(model, cache, [token])[0]
        out.append(logits)
        token = int(logits.argmax())
    return out


def greedy_with_recall(
    model: CausalLM, cache: DecodeCache, session: RecallSession, first: int, steps: int = STEPS
) -> tuple[list[torch.Tensor], list]:
    token, logits_out, outcomes = first, [], []
    for _ in range(steps):
        step = session.decode_step(model, cache, token)
        logits_out.append(step.logits[0])
        outcomes.append(step.outcomes[session.request_id])
        token = int(step.logits[0].argmax())
    return logits_out, outcomes


class MaskedDense:
    """Reference decode: every K/V row kept, a per-(layer, owner) visibility mask hides the
    omitted ones; query heads index their owner explicitly (no grouping reshape)."""

    def __init__(self, model: CausalLM, compressed: Compressed) -> None:
        self.model = model
        result = compressed.result
        self.keys = [result.source_k[layer].clone() for layer in range(2)]  # [H_kv, T, d_h]
        self.values = [result.source_v[layer].clone() for layer in range(2)]
        self.visible = torch.zeros(2, 2, PROMPT, dtype=torch.bool)  # [L, H_owner, T]
        for layer, owners in enumerate(compressed.selected):
            for owner, positions in enumerate(owners):
                self.visible[layer, owner, list(positions)] = True
        self.position = PROMPT
        self.owner_of = torch.tensor(model.config.q_to_kv_head_map)

    def reveal(self, pages: Sequence[PageRef], summaries: PageSummaries) -> None:
        for ref in pages:
            index = summaries.global_index(ref)
            first, count = int(summaries.page_first[index]), int(summaries.page_count[index])
            self.visible[ref.layer, ref.owner, first : first + count] = True

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        self.visible = torch.cat([self.visible, torch.ones(2, 2, 1, dtype=torch.bool)], dim=2)
        logits = self.model(torch.tensor([token]), torch.tensor([self.position]), self._attend)
        self.position += 1
        return logits[0]

    def _attend(self, layer: int):
        def attend(q, k, v):  # q [1, H_q, d_h]; k, v [1, H_kv, d_h]
            self.keys[layer] = torch.cat([self.keys[layer], k[0][:, None]], dim=1)
            self.values[layer] = torch.cat([self.values[layer], v[0][:, None]], dim=1)
            keys = self.keys[layer][self.owner_of]  # [H_q, S, d_h]
            values = self.values[layer][self.owner_of]
            logits = torch.einsum("hd,hsd->hs", q[0], keys) * self.model.scale  # [H_q, S]
            logits = logits.masked_fill(~self.visible[layer][self.owner_of], float("-inf"))
            return torch.einsum("hs,hsd->hd", logits.softmax(-1), values)[None]

        return attend


ALL_AT_ONCE = RecallKnobs(threshold=0.0, page_size=4, max_pages_per_step=10_000, cadence_steps=1)


def test_threshold_zero_recalls_every_page_and_equals_full_cache_decode(model: CausalLM) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    fetch = StoreFetcher(compressed.rows)
    session = RecallSession(
        compressed.manifest, compressed.summaries, fetch, state=compressed.state
    )
    recalled, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token
    )
    full = greedy(model, dense_cache(model, compressed), compressed.first_token)
    assert outcomes[0].status is RecallStatus.RECALLED
    assert outcomes[0].rows == compressed.summaries.omitted_rows > 0
    assert len(outcomes[0].pages) == compressed.summaries.num_pages
    assert session.live_pages == 0
    assert all(o.status is RecallStatus.NOT_DUE for o in outcomes[1:])  # nothing left to recall
    assert [int(x.argmax()) for x in recalled] == [int(x.argmax()) for x in full]
    for ours, reference in zip(recalled, full, strict=True):
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def test_the_public_step_api_drives_one_recall_and_advances_the_generation_at_end_step(
    model: CausalLM,
) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    session = RecallSession(
        compressed.manifest, compressed.summaries, StoreFetcher(compressed.rows), state=compressed.state
    )
    cache = view_cache(model, compressed)
    assert session.due()
    capture = StepCapture()
    decode_step(model, cache, [compressed.first_token], capture)
    plan = session.plan(capture.query(0), capture.log_sum_exp(0), cache)
    assert plan.outcome.status is RecallStatus.BELOW_THRESHOLD
    assert len(plan.pages) == compressed.summaries.num_pages
    result = session.recall(plan, cache)
    assert result.outcome.recalled and len(result.pages) == len(plan.pages)
    successor = result.outcome.successor
    assert successor is not None and session.state == successor
    start = compressed.state.cache_generation
    assert session.cache_generation == start  # only end_step advances it
    assert successor.cache_generation == cache_generation_after(start, recalled=True) == start + 2
    session.end_step(result.outcome)
    assert (session.cache_generation, session.steps) == (successor.cache_generation, 1)
    assert not session.due() and session.skipped().status is RecallStatus.NOT_DUE
    session.end_step(session.skipped())
    assert session.cache_generation == cache_generation_after(start + 2, recalled=False)


def test_full_recall_gate_recalls_everything_past_the_page_limit(model: CausalLM) -> None:
    knobs = RecallKnobs(
        threshold=0.0, page_size=4, max_pages_per_step=1, cadence_steps=1, full_recall_gate=1e-9
    )
    compressed = compress(model, knobs)
    session = RecallSession(
        compressed.manifest,
        compressed.summaries,
        StoreFetcher(compressed.rows),
        state=compressed.state,
    )
    recalled, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token, steps=2
    )
    assert outcomes[0].full_recall and len(outcomes[0].pages) == compressed.summaries.num_pages
    full = greedy(model, dense_cache(model, compressed), compressed.first_token, steps=2)
    torch.testing.assert_close(recalled[1], full[1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("recallable", [False, True])
def test_without_recall_the_output_is_the_lossy_decode(model: CausalLM, recallable: bool) -> None:
    # irrecoverable manifest: disabled session; recallable with a threshold no bound reaches
    knobs = RecallKnobs(threshold=1 - 1e-12, page_size=4, max_pages_per_step=4, cadence_steps=1)
    compressed = compress(model, knobs, recallable=recallable)
    fetch = StoreFetcher(compressed.rows)
    session = RecallSession(
        compressed.manifest, compressed.summaries, fetch, state=compressed.state
    )
    ours, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token
    )
    lossy = greedy(model, view_cache(model, compressed), compressed.first_token)
    expected = RecallStatus.BELOW_THRESHOLD if recallable else RecallStatus.DISABLED
    assert [o.status for o in outcomes] == [expected] * STEPS
    assert fetch.calls == []
    for a, b in zip(ours, lossy, strict=True):
        assert torch.equal(a, b)  # the capture path computes exactly what the plain path does


def test_partial_recall_steps_equal_dense_masked_attention_over_the_new_visible_set(
    model: CausalLM,
) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=3, cadence_steps=1)
    compressed = compress(model, knobs, seed=1)
    fetch = StoreFetcher(compressed.rows)
    session = RecallSession(
        compressed.manifest, compressed.summaries, fetch, state=compressed.state
    )
    ours, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token
    )
    reference = MaskedDense(model, compressed)
    token = compressed.first_token
    for logits, outcome in zip(ours, outcomes, strict=True):
        assert outcome.status is RecallStatus.RECALLED and 0 < len(outcome.pages) <= 3
        reference.reveal(outcome.pages, compressed.summaries)
        torch.testing.assert_close(logits, reference.step(token), atol=ATOL, rtol=0)
        token = int(logits.argmax())
    assert [len(refs) for refs in fetch.calls] == [len(o.pages) for o in outcomes]
    assert session.recalled_rows == sum(o.rows for o in outcomes)


@pytest.mark.parametrize("candidates", [None, 3])
def test_codes_ranked_recalls_equal_dense_masked_attention_and_keep_the_page_cap(
    model: CausalLM, candidates: int | None
) -> None:
    """The codes ranking (pages and their successors) recalls only rows that then decode
    exactly as dense masked attention over the new visible set, at most the cap a step, and
    nothing below its floor; scoring only the page sketch's best `candidates` pages too."""
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=4, cadence_steps=1,
                        code_bits=2)
    compressed = compress(model, knobs, seed=2)
    assert compressed.summaries.row_codes is not None
    strategy = RecallStrategy(ranking=Ranking.CODES, successor_pages=1,
                              sketch_candidates=candidates)
    session = RecallSession(compressed.manifest, compressed.summaries, StoreFetcher(compressed.rows),
                            state=compressed.state, strategy=strategy)
    # 2-row cache pages: a recall opens new pages in the layers it touches and only in those
    # (each layer's attention plan is rebuilt only when that layer changed).
    ours, outcomes = greedy_with_recall(
        model, view_cache(model, compressed, page_rows=2), session, compressed.first_token
    )
    reference = MaskedDense(model, compressed)
    token = compressed.first_token
    assert any(len({ref.layer for ref in o.pages}) < model.config.num_layers for o in outcomes)
    for logits, outcome in zip(ours, outcomes, strict=True):
        assert outcome.status is RecallStatus.RECALLED and 0 < len(outcome.pages) <= 4
        reference.reveal(outcome.pages, compressed.summaries)
        torch.testing.assert_close(logits, reference.step(token), atol=ATOL, rtol=0)
        token = int(logits.argmax())
    # A floor no page's estimate reaches: evaluated, nothing fetched.
    high = RecallStrategy(ranking=Ranking.CODES, min_estimate=50.0, sketch_candidates=candidates)
    quiet = RecallSession(compressed.manifest, compressed.summaries, StoreFetcher(compressed.rows),
                          state=compressed.state, strategy=high)
    _, none = greedy_with_recall(model, view_cache(model, compressed), quiet, compressed.first_token)
    assert all(o.status is RecallStatus.BELOW_THRESHOLD for o in none)


def test_a_sketch_holding_every_page_recalls_what_the_full_scoring_recalls(
    model: CausalLM,
) -> None:
    """As many sketch candidates as pages: the same pages step by step as every row scored
    (the candidates' log-odds are the full scoring's)."""
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=4, cadence_steps=1,
                        code_bits=4)
    compressed = compress(model, knobs, seed=4)
    pages = []
    for candidates in (None, compressed.summaries.num_pages):
        strategy = RecallStrategy(ranking=Ranking.CODES, successor_pages=1,
                                  sketch_candidates=candidates)
        session = RecallSession(compressed.manifest, compressed.summaries,
                                StoreFetcher(compressed.rows), state=compressed.state,
                                strategy=strategy)
        _, outcomes = greedy_with_recall(model, view_cache(model, compressed), session,
                                         compressed.first_token)
        pages.append([o.pages for o in outcomes])
    assert pages[0] == pages[1] and any(pages[0])


def test_cadence_evaluates_every_nth_step_and_respects_the_page_limit(model: CausalLM) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=2, cadence_steps=3)
    compressed = compress(model, knobs)
    fetch = StoreFetcher(compressed.rows)
    session = RecallSession(
        compressed.manifest, compressed.summaries, fetch, state=compressed.state
    )
    _, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token, steps=7
    )
    assert [o.evaluated for o in outcomes] == [True, False, False, True, False, False, True]
    assert [o.step for o in outcomes] == list(range(7))
    assert len(fetch.calls) == 3 and all(len(refs) == 2 for refs in fetch.calls)
    assert session.live_pages == compressed.summaries.num_pages - 6


def test_unavailable_rows_continue_lossy_then_recall_at_a_later_step(model: CausalLM) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    fetch = FailingFetcher(compressed.rows, failures=2)
    session = RecallSession(
        compressed.manifest, compressed.summaries, fetch, state=compressed.state
    )
    ours, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token, steps=4
    )
    assert [o.status for o in outcomes[:3]] == [
        RecallStatus.CONTINUED_LOSSY,
        RecallStatus.CONTINUED_LOSSY,
        RecallStatus.RECALLED,
    ]
    assert outcomes[0].timed_out and outcomes[0].reason == "offload tier did not answer"
    assert outcomes[0].fell_back and outcomes[0].successor is None
    lossy = greedy(model, view_cache(model, compressed), compressed.first_token, steps=2)
    assert torch.equal(ours[0], lossy[0]) and torch.equal(ours[1], lossy[1])
    assert session.state.state_generation == 2 and session.live_pages == 0


def test_fail_request_raises_a_typed_error(model: CausalLM) -> None:
    knobs = replace(ALL_AT_ONCE, fallback=TimeoutFallback.FAIL_REQUEST)
    compressed = compress(model, knobs)
    fetch = FailingFetcher(compressed.rows, failures=1)
    session = RecallSession(
        compressed.manifest, compressed.summaries, fetch, state=compressed.state
    )
    with pytest.raises(RecallFailed) as info:
        session.decode_step(model, view_cache(model, compressed), compressed.first_token)
    assert info.value.timed_out and info.value.request_id == "req"
    assert session.state == compressed.state


def test_an_answer_after_the_deadline_counts_as_a_timeout(model: CausalLM) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    ticks = iter([0.0, 0.5, 0.5])  # the fetch takes 500 ms, the deadline is 200 ms
    session = RecallSession(
        compressed.manifest,
        compressed.summaries,
        StoreFetcher(compressed.rows),
        state=compressed.state,
        clock=lambda: next(ticks),
    )
    step = session.decode_step(model, view_cache(model, compressed), compressed.first_token)
    outcome = step.outcomes["req"]
    assert outcome.status is RecallStatus.CONTINUED_LOSSY and outcome.timed_out
    assert "deadline 200 ms" in (outcome.reason or "") and session.live_pages > 0


def test_rows_that_do_not_match_their_summary_are_never_merged(model: CausalLM) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    honest = StoreFetcher(compressed.rows)

    def shifted(refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        pages = list(honest(refs, timeout_s))
        pages[0] = replace(pages[0], positions=pages[0].positions + 1)
        return pages

    session = RecallSession(
        compressed.manifest, compressed.summaries, shifted, state=compressed.state
    )
    step = session.decode_step(model, view_cache(model, compressed), compressed.first_token)
    assert step.outcomes["req"].status is RecallStatus.CONTINUED_LOSSY
    assert "do not match" in (step.outcomes["req"].reason or "") and not step.recomputed


def test_successor_states_chain_from_the_parent_with_the_recalled_positions(
    model: CausalLM,
) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=2, cadence_steps=1)
    compressed = compress(model, knobs)
    published: list[KVPolicyState] = []
    session = RecallSession(
        compressed.manifest,
        compressed.summaries,
        StoreFetcher(compressed.rows),
        state=compressed.state,
        on_successor=published.append,
    )
    _, outcomes = greedy_with_recall(
        model, view_cache(model, compressed), session, compressed.first_token, steps=2
    )
    parent = compressed.state
    for step, (outcome, state) in enumerate(zip(outcomes, published, strict=True)):
        assert outcome.successor == state
        assert state.state_generation == parent.state_generation + 1
        assert state.parent_state_generation == parent.state_generation
        assert state.frontier == PROMPT + step + 1  # the step's own token is visible
        # cache generations: 1 at prefill, +1 per decoded step, +1 per recall
        assert state.cache_generation == 1 + 2 * (step + 1)
        for ref in outcome.pages:
            index = compressed.summaries.global_index(ref)
            first, count = (
                int(compressed.summaries.page_first[index]),
                int(compressed.summaries.page_count[index]),
            )
            visible = set(state.selected_positions[ref.layer][ref.owner])
            assert set(range(first, first + count)) <= visible
            assert not set(range(first, first + count)) & set(
                parent.selected_positions[ref.layer][ref.owner]
            )
        added = {
            (layer, owner, p)
            for layer, owners in enumerate(state.selected_positions)
            for owner, positions in enumerate(owners)
            for p in positions
        } - {
            (layer, owner, p)
            for layer, owners in enumerate(parent.selected_positions)
            for owner, positions in enumerate(owners)
            for p in positions
        }
        assert len(added) == outcome.rows + 2 * 2 * (state.frontier - parent.frontier)
        parent = state
    assert session.state == published[-1] and session.cache_generation == 1 + 2 * 2


@pytest.mark.parametrize("error", [RuntimeError("STALE"), RecallUnavailable("policy down")])
def test_a_rejected_successor_merges_nothing(model: CausalLM, error: Exception) -> None:
    compressed = compress(model, ALL_AT_ONCE)

    def reject(state: KVPolicyState) -> None:
        raise error

    session = RecallSession(
        compressed.manifest,
        compressed.summaries,
        StoreFetcher(compressed.rows),
        state=compressed.state,
        on_successor=reject,
    )
    cache = view_cache(model, compressed)
    step = decode_with_recall(model, cache, [compressed.first_token], {"req": session})
    lossy = greedy(model, view_cache(model, compressed), compressed.first_token, steps=1)
    expected = (
        RecallStatus.CONTINUED_LOSSY
        if isinstance(error, RecallUnavailable)
        else RecallStatus.FAILED
    )
    assert step.outcomes["req"].status is expected and not step.recomputed
    assert torch.equal(step.logits[0], lossy[0])
    assert (
        session.state == compressed.state and session.live_pages == compressed.summaries.num_pages
    )
    assert int(cache.lengths("req").sum()) == compressed.view.total_rows + 2 * 2


def test_batch_recall_recomputes_without_changing_the_other_requests(model: CausalLM) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    other = compress(model, ALL_AT_ONCE, seed=5)
    session = RecallSession(
        compressed.manifest,
        compressed.summaries,
        StoreFetcher(compressed.rows),
        state=compressed.state,
    )
    cache = view_cache(model, other, request_id="other")
    cache.admit_view("req", compressed.view, frontier=PROMPT)
    tokens = [other.first_token, compressed.first_token]
    step = decode_with_recall(model, cache, tokens, {"req": session})
    assert step.recomputed and step.outcomes["req"].status is RecallStatus.RECALLED
    alone = greedy(model, view_cache(model, other, request_id="other"), other.first_token, 1)
    full = greedy(model, dense_cache(model, compressed), compressed.first_token, 1)
    torch.testing.assert_close(step.logits[0], alone[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(step.logits[1], full[0], atol=ATOL, rtol=0)
    assert cache.frontier().tolist() == [PROMPT + 1, PROMPT + 1]


def test_recalled_rows_land_at_their_original_positions() -> None:
    layers, heads, tokens, head_dim = 2, 2, 12, 4
    k, v = symbolic_kv(layers, heads, tokens, head_dim)  # [L, H_kv, T, d_h]
    selected = [[[0, 1, 5, 11], [0, 3, 4, 11]], [[0, 2, 9, 11], [0, 6, 7, 11]]]
    summaries = summarize_pages(k, selected, page_size=3)
    fetch = StoreFetcher(gather_omitted(k, v, summaries))
    pages = fetch([summaries.page_ref(i) for i in range(summaries.num_pages)], timeout_s=1.0)
    config = tiny_llama().config
    cache = DecodeCache(replace(config, head_dim=head_dim), torch.float32, row_capacity=4)
    cache.admit_view("req", pack(k, v, selected), frontier=tokens)
    merge_into_cache(cache, "req", pages)
    for layer in range(layers):
        for head in range(heads):
            keys, values, positions = cache.rows("req", layer, head)
            assert sorted(positions.tolist()) == list(range(tokens))
            for key, value, t in zip(keys, values, positions.tolist(), strict=True):
                assert torch.equal(key, k[layer, head, t]) and torch.equal(value, v[layer, head, t])


# --- deferred recall: fetched in the background, applied before the next step ------------

DEFERRED = RecallStrategy(recompute_steps=0)


class GatedFetcher:
    """A store fetcher whose answers wait for `gate` (bounded), recording the fetch threads."""

    def __init__(self, rows: OmittedRows, gate: threading.Event | None = None) -> None:
        self.inner = StoreFetcher(rows)
        self.gate = gate
        self.threads: list[str] = []

    def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        self.threads.append(threading.current_thread().name)
        if self.gate is not None:
            assert self.gate.wait(timeout=10.0), "the test never opened the gate"
        return self.inner(refs, timeout_s)


def deferred_session(
    compressed: Compressed, fetch: object, **kwargs: object
) -> RecallSession:
    return RecallSession(
        compressed.manifest, compressed.summaries, fetch,  # type: ignore[arg-type]
        state=compressed.state, strategy=kwargs.pop("strategy", DEFERRED), **kwargs,  # type: ignore[arg-type]
    )


def test_deferred_rows_answer_the_next_step_without_recomputing(model: CausalLM) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=3, cadence_steps=1)
    compressed = compress(model, knobs, seed=1)
    fetch = GatedFetcher(compressed.rows)
    session = deferred_session(compressed, fetch)
    cache = view_cache(model, compressed)
    reference = MaskedDense(model, compressed)
    token, asked = compressed.first_token, ()
    for index in range(STEPS):
        step = decode_with_recall(model, cache, [token], {"req": session})
        outcome = step.outcomes["req"]
        assert not step.recomputed
        if index == 0:
            assert outcome.status is RecallStatus.FETCHING and outcome.pages == ()
        else:  # the pages asked for at the previous step are in before this one ran
            assert outcome.status is RecallStatus.RECALLED and outcome.pages == asked
            reference.reveal(outcome.pages, compressed.summaries)
        assert 0 < len(outcome.fetching) <= 3
        asked = outcome.fetching
        torch.testing.assert_close(step.logits[0], reference.step(token), atol=ATOL, rtol=0)
        token = int(step.logits[0].argmax())
    assert all(name.startswith("recall") for name in fetch.threads)  # never the decode thread
    assert session.pending


def test_deferred_codes_recalls_open_pages_in_some_layers_and_equal_dense_attention(
    model: CausalLM,
) -> None:
    """Deferred merges (no undo between them) into 2-row cache pages open new pages in the
    layers they touch only; every step still equals dense masked attention, so each touched
    layer's attention plan was rebuilt and the others' were rightly kept."""
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=3, cadence_steps=1,
                        code_bits=2)
    compressed = compress(model, knobs, seed=3)
    strategy = RecallStrategy(recompute_steps=0, ranking=Ranking.CODES, successor_pages=1)
    session = deferred_session(compressed, GatedFetcher(compressed.rows), strategy=strategy)
    cache = view_cache(model, compressed, page_rows=2)
    reference = MaskedDense(model, compressed)
    token, asked, touched = compressed.first_token, (), []
    for index in range(STEPS):
        step = decode_with_recall(model, cache, [token], {"req": session})
        outcome = step.outcomes["req"]
        if index:
            assert outcome.pages == asked
            reference.reveal(outcome.pages, compressed.summaries)
            touched.append({ref.layer for ref in outcome.pages})
        asked = outcome.fetching
        torch.testing.assert_close(step.logits[0], reference.step(token), atol=ATOL, rtol=0)
        token = int(step.logits[0].argmax())
    assert any(0 < len(layers) < model.config.num_layers for layers in touched)


def test_a_deferred_successor_names_the_cache_once_its_rows_are_in(model: CausalLM) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=2, cadence_steps=1)
    compressed = compress(model, knobs)
    published: list[KVPolicyState] = []
    session = deferred_session(compressed, GatedFetcher(compressed.rows), on_successor=published.append)
    cache = view_cache(model, compressed)
    token, start = compressed.first_token, compressed.state.cache_generation
    outcomes = []
    for _ in range(3):
        step = decode_with_recall(model, cache, [token], {"req": session})
        outcomes.append(step.outcomes["req"])
        token = int(step.logits[0].argmax())
    assert [o.status for o in outcomes] == [RecallStatus.FETCHING, *[RecallStatus.RECALLED] * 2]
    assert [o.successor for o in outcomes[1:]] == published and len(published) == 2
    for index, state in enumerate(published, start=1):
        # applied before step `index` ran; its row is in once that step is: frontier and
        # generation match the cache after that step (+1 per step, +1 per recall)
        assert state.frontier == PROMPT + index + 1
        assert state.cache_generation == start + (index + 1) + index
        assert state.state_generation == compressed.state.state_generation + index
    assert session.cache_generation == published[-1].cache_generation
    assert session.state == published[-1]
    assert int(cache.frontier()[0]) == PROMPT + 3


@pytest.mark.parametrize("fallback", list(TimeoutFallback))
def test_rows_not_back_by_the_deadline_take_the_fallback_and_are_never_merged(
    model: CausalLM, fallback: TimeoutFallback
) -> None:
    knobs = replace(ALL_AT_ONCE, timeout_ms=50, fallback=fallback)
    compressed = compress(model, knobs)
    gate = threading.Event()
    fetch = GatedFetcher(compressed.rows, gate)
    session = deferred_session(compressed, fetch)
    cache = view_cache(model, compressed)
    try:
        first = decode_with_recall(model, cache, [compressed.first_token], {"req": session})
        assert first.outcomes["req"].status is RecallStatus.FETCHING
        token = int(first.logits[0].argmax())
        second = decode_with_recall(model, cache, [token], {"req": session})
    finally:
        gate.set()  # the late answer arrives after the step gave up on it
    outcome = second.outcomes["req"]
    expected = (
        RecallStatus.CONTINUED_LOSSY
        if fallback is TimeoutFallback.CONTINUE_LOSSY
        else RecallStatus.FAILED
    )
    assert outcome.status is expected and outcome.timed_out
    assert "recall deadline" in (outcome.reason or "") and outcome.successor is None
    assert session.state == compressed.state
    assert session.live_pages == compressed.summaries.num_pages  # nothing merged
    lossy = greedy(model, view_cache(model, compressed), compressed.first_token, steps=2)
    assert torch.equal(second.logits[0], lossy[1])
    if fallback is TimeoutFallback.CONTINUE_LOSSY:
        assert outcome.fetching  # asked again at once
    else:
        assert not outcome.fetching and not session.pending  # a failed request asks nothing


def test_a_deferred_fetch_left_when_the_request_ends_is_abandoned(model: CausalLM) -> None:
    # The request ends (its last step started a fetch that no step will collect): a fetch
    # still queued is cancelled, and nothing is ever merged into the session.
    compressed = compress(model, ALL_AT_ONCE)
    fetch = GatedFetcher(compressed.rows)
    busy = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="recall-test") as pool:
        pool.submit(busy.wait, 10.0)  # the only fetch thread is taken: the fetch queues
        session = deferred_session(compressed, fetch, executor=pool)
        cache = view_cache(model, compressed)
        step = decode_with_recall(model, cache, [compressed.first_token], {"req": session})
        assert step.outcomes["req"].status is RecallStatus.FETCHING and session.pending
        session.abandon()
        assert not session.pending
        busy.set()
    assert fetch.threads == []  # cancelled before it ran
    assert session.state == compressed.state
    assert session.live_pages == compressed.summaries.num_pages


def test_a_deferred_fetch_that_fails_continues_lossy_and_asks_again(model: CausalLM) -> None:
    compressed = compress(model, ALL_AT_ONCE)
    session = deferred_session(compressed, FailingFetcher(compressed.rows, failures=1))
    cache = view_cache(model, compressed)
    token, statuses = compressed.first_token, []
    for _ in range(3):
        step = decode_with_recall(model, cache, [token], {"req": session})
        statuses.append(step.outcomes["req"].status)
        token = int(step.logits[0].argmax())
    assert statuses == [
        RecallStatus.FETCHING, RecallStatus.CONTINUED_LOSSY, RecallStatus.RECALLED
    ]
    assert session.live_pages == 0 and session.state.state_generation == 2


def test_deferred_fetches_of_a_batch_run_side_by_side(model: CausalLM) -> None:
    one, two = compress(model, ALL_AT_ONCE), compress(model, ALL_AT_ONCE, seed=5)
    both = threading.Barrier(2, timeout=10.0)  # each fetch returns only once both started

    class Meeting(GatedFetcher):
        def __call__(self, refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
            both.wait()
            return super().__call__(refs, timeout_s)

    sessions = {
        "req": deferred_session(one, Meeting(one.rows)),
        "other": RecallSession(
            two.manifest, two.summaries, Meeting(two.rows),
            state=replace(two.state, request_id="other"), strategy=DEFERRED,
        ),
    }
    cache = view_cache(model, one)
    cache.admit_view("other", two.view, frontier=PROMPT)
    cache.admit_view("plain", two.view, frontier=PROMPT)  # no session: never waits for recall
    tokens = [one.first_token, two.first_token, two.first_token]
    decode_with_recall(model, cache, tokens, sessions)
    step = decode_with_recall(model, cache, tokens, sessions)
    assert {rid: o.status for rid, o in step.outcomes.items()} == {
        "req": RecallStatus.RECALLED, "other": RecallStatus.RECALLED,
    }
    alone = view_cache(model, two, request_id="plain")  # the same two tokens, no recall
    decode_step(model, alone, [two.first_token])
    expected = decode_step(model, alone, [two.first_token])[0]
    torch.testing.assert_close(step.logits[2], expected, atol=ATOL, rtol=0)


CODES_INLINE = RecallStrategy(recompute_steps=1, ranking=Ranking.CODES, successor_pages=1)
CODES_KNOBS = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=3, cadence_steps=1,
                          code_bits=2)


Steps = list[tuple[torch.Tensor, RecallOutcome]]


def inline_and_beside(model: CausalLM, compressed: Compressed, monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[Steps, Steps, list[tuple[str, bool]]]:
    """The same decode planned on the decode thread and beside the step: each run's (logits,
    outcome) a step, and every layer scoring's thread and whether it read code logits."""
    scored: list[tuple[str, bool]] = []
    scorer = recall_engine.layer_page_lse

    def recording(*args: object, **kwargs: object) -> torch.Tensor:
        scored.append((threading.current_thread().name, kwargs.get("logits") is not None))
        return scorer(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(recall_engine, "layer_page_lse", recording)
    started = recall_engine.start_layer_page_lse

    def starting(*args: object, **kwargs: object) -> object:
        scored.append(("started on " + threading.current_thread().name, True))
        return started(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(recall_engine, "start_layer_page_lse", starting)
    runs = {}
    for background in (False, True):
        strategy = replace(CODES_INLINE, plan_in_background=background)
        session = deferred_session(compressed, GatedFetcher(compressed.rows), strategy=strategy)
        cache = view_cache(model, compressed, page_rows=2)
        token, steps = compressed.first_token, []
        for _ in range(STEPS):
            step = decode_with_recall(model, cache, [token], {"req": session})
            steps.append((step.logits[0], step.outcomes["req"]))
            token = int(step.logits[0].argmax())
        runs[background] = steps
    # The last step's layers are scored on the planner thread after the step returns (its
    # plan is collected by a step this run never makes): what it queued is done before this.
    recall_engine.plan_pool().submit(lambda: None).result(timeout=10.0)
    return runs[False], runs[True], scored


def test_plans_made_beside_the_step_recall_what_the_decode_thread_would(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scored layer by layer on the planner thread as the step runs, chosen and fetched there:
    the same pages land before the same steps, so every step's logits are the same to the bit;
    only the step that asked reports PLANNING instead of FETCHING with its pages."""
    compressed = compress(model, CODES_KNOBS, seed=3)
    inline, beside, scored = inline_and_beside(model, compressed, monkeypatch)
    for index, ((want, asked), (got, outcome)) in enumerate(zip(inline, beside, strict=True)):
        assert torch.equal(got, want)
        if index == 0:  # the cue step recomputes on the decode thread in both
            assert outcome.status is asked.status is RecallStatus.RECALLED
        elif index == 1:
            assert asked.status is RecallStatus.FETCHING and asked.fetching
            assert outcome.status is RecallStatus.PLANNING and not outcome.fetching
        else:
            assert outcome.status is asked.status is RecallStatus.RECALLED
            assert outcome.pages == asked.pages == inline[index - 1][1].fetching
            assert outcome.rows == asked.rows and outcome.successor == asked.successor
    layers = model.config.num_layers
    assert len(scored) == layers * (STEPS - 1)  # every deferred step, layer by layer
    assert all(name.startswith("recall-plan") and not logits for name, logits in scored)


def test_a_value_terms_plan_beside_the_step_scores_its_logits_and_recalls_the_same(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the omitted-value term computed as each layer attends, that layer is scored from
    the term's code logits (never the table again) on the kernel's own thread, started from
    the decode thread as the step runs: every step's logits equal the plan made on the decode
    thread, to the bit, and the same pages land before the same steps."""
    compressed = compress(model, replace(CODES_KNOBS, code_bits=4, value_term=True), seed=3)
    assert compressed.summaries.page_value_mean is not None
    inline, beside, scored = inline_and_beside(model, compressed, monkeypatch)
    recalled = 0
    for index, ((want, asked), (got, outcome)) in enumerate(zip(inline, beside, strict=True)):
        assert torch.equal(got, want)
        if index >= 2:
            assert outcome.pages == asked.pages and outcome.status is asked.status
            recalled += outcome.status is RecallStatus.RECALLED
    assert recalled > 0
    assert len(scored) == model.config.num_layers * (STEPS - 1)
    assert all(name == f"started on {threading.current_thread().name}" for name, _ in scored)


@pytest.mark.parametrize("fallback", list(TimeoutFallback))
def test_a_plan_not_done_by_the_deadline_takes_the_fallback(
    model: CausalLM, fallback: TimeoutFallback
) -> None:
    """The recall deadline counts from the plan's start: a planner thread that is late (here,
    taken by other work) makes the rows unavailable, never a stalled step."""
    knobs = replace(CODES_KNOBS, timeout_ms=50, fallback=fallback)
    compressed = compress(model, knobs, seed=3)
    strategy = replace(CODES_INLINE, recompute_steps=0, plan_in_background=True)
    session = deferred_session(compressed, GatedFetcher(compressed.rows), strategy=strategy)
    cache = view_cache(model, compressed, page_rows=2)
    gate = threading.Event()
    busy = plan_pool().submit(gate.wait, 10.0)  # the plan queues behind this
    try:
        first = decode_with_recall(model, cache, [compressed.first_token], {"req": session})
        assert first.outcomes["req"].status is RecallStatus.PLANNING and session.pending
        token = int(first.logits[0].argmax())
        second = decode_with_recall(model, cache, [token], {"req": session})
    finally:
        gate.set()
        busy.result(timeout=10.0)
    outcome = second.outcomes["req"]
    expected = (RecallStatus.CONTINUED_LOSSY if fallback is TimeoutFallback.CONTINUE_LOSSY
                else RecallStatus.FAILED)
    assert outcome.status is expected and outcome.timed_out
    assert "recall deadline" in (outcome.reason or "")
    assert session.live_pages == compressed.summaries.num_pages  # nothing merged
    lossy = greedy(model, view_cache(model, compressed, page_rows=2), compressed.first_token,
                   steps=2)
    assert torch.equal(second.logits[0], lossy[1])


def test_recompute_steps_then_deferred_and_the_deferred_page_cap(model: CausalLM) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=4, cadence_steps=1)
    compressed = compress(model, knobs)
    strategy = RecallStrategy(recompute_steps=1, deferred_pages=1)
    session = deferred_session(compressed, GatedFetcher(compressed.rows), strategy=strategy)
    cache = view_cache(model, compressed)
    token, outcomes, recomputed = compressed.first_token, [], []
    for _ in range(3):
        step = decode_with_recall(model, cache, [token], {"req": session})
        outcomes.append(step.outcomes["req"])
        recomputed.append(step.recomputed)
        token = int(step.logits[0].argmax())
    assert recomputed == [True, False, False]
    assert outcomes[0].status is RecallStatus.RECALLED and len(outcomes[0].pages) == 4
    assert len(outcomes[1].fetching) == 1 and outcomes[1].status is RecallStatus.FETCHING
    assert outcomes[2].status is RecallStatus.RECALLED and len(outcomes[2].pages) == 1


def test_midpoint_ranking_through_the_session_fetches_what_the_estimate_ranks_first(
    model: CausalLM,
) -> None:
    knobs = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=2, cadence_steps=1)
    compressed = compress(model, knobs)
    strategy = RecallStrategy(ranking=Ranking.MIDPOINT)
    session = deferred_session(compressed, GatedFetcher(compressed.rows), strategy=strategy)
    cache = view_cache(model, compressed)
    capture = StepCapture()
    decode_step(model, cache, [compressed.first_token], capture)
    plan = session.plan(capture.query(0), capture.log_sum_exp(0), cache)
    summaries = compressed.summaries
    estimate = page_midpoint_logits(summaries, capture.query(0), cache.head_to_owner, cache.scale)
    layer_of = summaries.page_segment // summaries.num_owners
    odds = (estimate + summaries.page_count.double().log()[:, None]
            - capture.log_sum_exp(0).double()[layer_of]).amax(dim=1)
    best = torch.sort(odds, descending=True, stable=True).indices[:2].tolist()
    assert [summaries.global_index(ref) for ref in plan.pages] == best


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"recompute_steps": -1}, "recompute_steps"), ({"deferred_pages": 0}, "deferred_pages"),
     ({"min_estimate": -3.0}, "min_estimate")],
)
def test_strategy_rejects_bad_settings(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(BoundInputInvalid) as info:
        RecallStrategy(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


VALUES = RecallKnobs(threshold=0.0, page_size=2, max_pages_per_step=2, cadence_steps=2,
                     code_bits=4, value_term=True)


def test_pages_taken_out_in_place_leave_the_bias_and_grid_of_the_pages_still_live(
        model: CausalLM) -> None:
    """`take_out_pages` (the value term's recount after a recall) leaves, bit for bit, the
    `live_bias` and `live_grid` of the live pages less those taken out, over two recalls."""
    compressed = compress(model, replace(CODES_KNOBS, code_bits=4, value_term=True), seed=3)
    summaries = compressed.summaries
    live = torch.ones(summaries.num_pages, dtype=torch.bool)
    bias, grid = live_bias(summaries, live), live_grid(summaries, live)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        gone = live & (torch.rand(summaries.num_pages, generator=gen) < 0.3)
        take_out_pages(summaries, gone, bias, grid)
        live &= ~gone
        assert torch.equal(bias, live_bias(summaries, live))
        assert torch.equal(grid, live_grid(summaries, live))


def test_the_value_term_leaves_with_the_pages_it_covers(model: CausalLM) -> None:
    """Every page recalled at the first step: nothing stays omitted, no term, and the decode
    is the full cache's."""
    knobs = replace(ALL_AT_ONCE, code_bits=4, value_term=True)
    compressed = compress(model, knobs)
    assert compressed.summaries.page_value_mean is not None
    session = RecallSession(compressed.manifest, compressed.summaries,
                            StoreFetcher(compressed.rows), state=compressed.state,
                            strategy=RecallStrategy(ranking=Ranking.CODES))
    cache = view_cache(model, compressed)
    recalled, outcomes = greedy_with_recall(model, cache, session, compressed.first_token)
    assert outcomes[0].rows == compressed.summaries.omitted_rows and session.live_pages == 0
    assert not cache.has_omitted_term("req")
    full = greedy(model, dense_cache(model, compressed), compressed.first_token)
    for ours, reference in zip(recalled, full, strict=True):
        torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def test_the_value_term_is_fresh_when_due_and_reused_between(model: CausalLM) -> None:
    """The cache asks the term layer by layer with the layer's query: at a fresh step it
    is `omitted_value_term` of those queries (and its code logits are what the recall plan
    reads), at a step between refreshes each layer's last term, and once pages leave the
    live set the next step is fresh without them."""
    compressed = compress(model, VALUES, seed=1)
    session = RecallSession(compressed.manifest, compressed.summaries,
                            StoreFetcher(compressed.rows), state=compressed.state,
                            strategy=RecallStrategy(ranking=Ranking.CODES, term_refresh_steps=2))
    term = session.value_term
    assert term is not None
    cache = view_cache(model, compressed)
    summaries = compressed.summaries
    term.bind(cache.head_to_owner, cache.scale)
    gen = torch.Generator().manual_seed(5)
    queries = torch.randn(2, 4, 8, generator=gen)  # [L, H_q, d_h]
    term.begin_step(fresh=True)
    parts = [term(layer, queries[layer]) for layer in range(2)]
    logits = code_logits(summaries, queries, cache.head_to_owner, scale=cache.scale)
    whole = omitted_value_term(summaries, logits)
    for layer, part in enumerate(parts):
        assert part is not None
        torch.testing.assert_close(part[0], whole.log_mass[layer], atol=1e-4, rtol=0)
        torch.testing.assert_close(part[1], whole.value[layer], atol=1e-4, rtol=0)
    step_logits = term.step_logits()
    assert step_logits is not None
    torch.testing.assert_close(step_logits.logits, logits.logits, atol=1e-4, rtol=0)
    term.begin_step(fresh=False)  # between refreshes: the last term, whatever the query
    stale = term(0, torch.randn(4, 8, generator=gen))
    assert stale is not None and stale[0] is parts[0][0] and stale[1] is parts[0][1]
    assert term.step_logits() is None
    session._live[:3] = False  # three pages recalled: taken out of the term at once, with the
    term.begin_step(fresh=False)  # masses the term's query gave them
    again = term(0, torch.randn(4, 8, generator=gen))
    assert again is not None and again[0] is not parts[0][0]
    fewer = omitted_value_term(summaries, logits, session._live)
    torch.testing.assert_close(again[0], fewer.log_mass[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(again[1], fewer.value[0], atol=1e-4, rtol=0)
    # The pages came from layer 0 only: layer 1's term is left as it was, not recomputed.
    assert set((summaries.page_segment[:3] // summaries.num_owners).tolist()) == {0}
    kept = term(1, torch.randn(4, 8, generator=gen))
    assert kept is not None and kept[0] is parts[1][0] and kept[1] is parts[1][1]
    session._live[:] = False
    term.begin_step(fresh=True)
    assert term(0, queries[0]) is None
    # Through the session: attached to the cache at the first step.
    fresh = RecallSession(compressed.manifest, summaries, StoreFetcher(compressed.rows),
                          state=compressed.state,
                          strategy=RecallStrategy(ranking=Ranking.CODES, min_estimate=50.0))
    cache = view_cache(model, compressed)
    step = fresh.decode_step(model, cache, compressed.first_token)
    assert cache.has_omitted_term("req") and not step.recomputed
    assert step.outcomes["req"].status is RecallStatus.BELOW_THRESHOLD


def test_a_term_refreshed_on_recall_reads_the_new_query(model: CausalLM) -> None:
    compressed = compress(model, VALUES, seed=1)
    strategy = RecallStrategy(ranking=Ranking.CODES, term_refresh_steps=2,
                              term_refresh_on_recall=True)
    session = RecallSession(compressed.manifest, compressed.summaries,
                            StoreFetcher(compressed.rows), state=compressed.state, strategy=strategy)
    term = session.value_term
    assert term is not None
    cache = view_cache(model, compressed)
    term.bind(cache.head_to_owner, cache.scale)
    gen = torch.Generator().manual_seed(6)
    first, second = torch.randn(2, 2, 4, 8, generator=gen)  # [L, H_q, d_h] each
    term.begin_step(fresh=True)
    _ = [term(layer, first[layer]) for layer in range(2)]
    session._live[:3] = False
    term.begin_step(fresh=False)
    got = term(0, second[0])
    assert got is not None
    logits = code_logits(compressed.summaries, second, cache.head_to_owner, scale=cache.scale)
    want = omitted_value_term(compressed.summaries, logits, session._live)
    torch.testing.assert_close(got[0], want.log_mass[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1], want.value[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_the_value_term_brings_the_decode_closer_to_the_full_cache(model: CausalLM,
                                                                  seed: int) -> None:
    """Teacher-forced on the full cache's tokens, without any recall (a floor nothing clears):
    with the term the logits are nearer the full cache's, at the first step and over all."""
    compressed = compress(model, VALUES, seed=seed)
    floor = RecallStrategy(ranking=Ranking.CODES, min_estimate=50.0)
    full = greedy(model, dense_cache(model, compressed), compressed.first_token, steps=8)
    tokens = [compressed.first_token] + [int(x.argmax()) for x in full[:-1]]
    session = RecallSession(compressed.manifest, compressed.summaries,
                            StoreFetcher(compressed.rows), state=compressed.state, strategy=floor)
    with_term, without = view_cache(model, compressed), view_cache(model, compressed)
    errors = []
    for token, reference in zip(tokens, full, strict=True):
        ours = session.decode_step(model, with_term, token).logits[0]
        lossy = decode_step(model, without, [token])[0]
        errors.append((float((ours - reference).norm()), float((lossy - reference).norm())))
    assert session.recalled_rows == 0
    assert errors[0][0] < 0.8 * errors[0][1]
    assert sum(e[0] for e in errors) < 0.8 * sum(e[1] for e in errors)


def test_recalled_values_that_do_not_average_to_the_page_mean_are_never_merged(
    model: CausalLM,
) -> None:
    compressed = compress(model, replace(ALL_AT_ONCE, code_bits=4, value_term=True))
    honest = StoreFetcher(compressed.rows)

    def shifted(refs: Sequence[PageRef], timeout_s: float) -> Sequence[RecalledPage]:
        pages = list(honest(refs, timeout_s))
        pages[0], pages[1] = replace(pages[0], v=pages[1].v[: pages[0].v.shape[0]]), pages[1]
        return pages

    session = RecallSession(compressed.manifest, compressed.summaries, shifted,
                            state=compressed.state, strategy=RecallStrategy(ranking=Ranking.CODES))
    step = session.decode_step(model, view_cache(model, compressed), compressed.first_token)
    assert step.outcomes["req"].status is RecallStatus.CONTINUED_LOSSY
    assert "average" in (step.outcomes["req"].reason or "")


def test_terms_computed_ahead_serve_the_next_step_and_come_from_the_planner_thread(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`term_ahead`: at every deferred step each layer's term is the one the planner thread
    computed from the previous evaluated step's query of that layer (every step here, and
    nothing recalled), and the decode thread computes none after the cue step."""
    knobs = replace(VALUES, cadence_steps=1)
    compressed = compress(model, knobs, seed=1)
    strategy = RecallStrategy(recompute_steps=1, ranking=Ranking.CODES, min_estimate=1e9,
                              plan_in_background=True, term_ahead=True)
    session = deferred_session(compressed, GatedFetcher(compressed.rows), strategy=strategy)
    computed_on: list[tuple[int, str]] = []
    compute = recall_engine.layer_value_term
    steps: list[int] = [0]

    def recorded(name: str) -> None:
        computing = getattr(recall_engine, name)

        def recording(*args: object, **kwargs: object) -> object:
            computed_on.append((steps[0], threading.current_thread().name))
            return computing(*args, **kwargs)

        monkeypatch.setattr(recall_engine, name, recording)

    recorded("layer_value_term")  # the planner's (`AheadTerms`)
    recorded("start_layer_value_terms")  # the decode step's
    seen: dict[tuple[int, int], tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]] = {}
    start = recall_engine.ValueTermSource.start_layer_parts

    def asked(layer: int, calls: Sequence[tuple[object, torch.Tensor]]
              ) -> Callable[[], list[tuple[torch.Tensor, torch.Tensor] | None]]:
        wait = start(layer, calls)  # type: ignore[arg-type]

        def waited() -> list[tuple[torch.Tensor, torch.Tensor] | None]:
            parts = wait()
            for (_, query), part in zip(calls, parts, strict=True):
                seen[steps[0], layer] = (query.clone(), part)
            return parts

        return waited

    monkeypatch.setattr(recall_engine.ValueTermSource, "start_layer_parts", staticmethod(asked))
    cache = view_cache(model, compressed)
    token = compressed.first_token
    for index in range(STEPS):
        steps[0] = index
        step = decode_with_recall(model, cache, [token], {"req": session})
        assert not step.outcomes["req"].recalled or index == 0
        token = int(step.logits[0].argmax())
    assert session.live_pages == compressed.summaries.num_pages  # the floor recalls nothing
    assert {name for step, name in computed_on if step > 0} == {"recall-plan_0"}
    summaries, term = compressed.summaries, session.value_term
    assert term is not None
    readers = owner_readers(summaries, cache.head_to_owner)
    bias = live_bias(summaries, torch.ones(summaries.num_pages, dtype=torch.bool))
    for index in range(2, STEPS):  # step 1 reads the cue step's own terms
        for layer in range(model.config.num_layers):
            query, _ = seen[index - 1, layer]
            part = seen[index, layer][1]
            want = compute(summaries, layer, query, readers, bias, cache.scale)
            assert part is not None
            assert torch.equal(part[0], want.log_mass) and torch.equal(part[1], want.value)
