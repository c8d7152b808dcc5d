"""`kvrelay eval recall --suite ruler`: does recall of omitted rows work on a real model?

RULER-style tasks (`services.evaluation.ruler`) in the question-agnostic placement
`before_filler` (the question is followed by filler, so SnapKV's observation window never
sees it), on a real checkpoint (SmolLM2-135M-Instruct by default). Per prompt: one prefill
of the prefix (the prompt without its cue), then per budget SnapKV uniform selects, packs
and admits the view, the cue is decoded over the compressed cache (teacher-forced) and the
answer greedily after it, as in `ruler_eval`. Policies side by side on the same prefill:

    full              the whole prompt (the ceiling)
    snapkv            SnapKV uniform (GQA mean), omitted rows irrecoverable
    snapkv+<variant>  the same selection with `recallable_remote` omitted rows: paged into
                      an in-process `OffloadStore` (the prefill worker's tier) and recalled
                      by `RecallSession` with the variant's knobs and strategy
    kvpress:<press>   NVIDIA kvpress presses on the same weights (`ruler_kvpress`), same
                      prompts and resident budget; the report keeps the best press per cell

Timing. A cell's prompts decode as one batch per policy (`batch` requests in one
`DecodeCache`, as the decode worker batches; a cell with fewer prompts fills the batch with
repeats of them, which are timed but not reported); the first prompt of every cell also
decodes alone. TPOT is the mean wall time of the answer steps (every step after the cue; at batch
`batch` only the steps where the whole batch is still decoding); the cue step, which
carries the first recall, is reported apart. Timing is wall time on a shared CPU: compare
columns of one run, never across runs.

Seeds: reported prompts from `ruler_suite.REPORT_SEED`; the recall knobs and strategy were
chosen on prompts from `ruler_suite.TUNE_SEED` (`--tune` runs a preset on those instead); the
two ranges never meet.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from tqdm import tqdm

from services.evaluation import ruler
from services.evaluation.generation import CompressedPrompt, compress_prompt, forward_for
from services.evaluation.policies import SnapKVShape, policy_grid
from services.evaluation.ruler_suite import REPORT_SEED, TUNE_SEED
from services.kvpolicy.manifest import (
    AllocationMethod,
    GQAReduction,
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
)
from services.model import DecodeCache, LoadedModel, SamplingParams, finish_reason, load, sample
from services.offload.fetchers import StoreFetcher
from services.offload.plan import offload_plan
from services.offload.recall import (
    CODES_RECALL_KNOBS,
    CODES_STRATEGY,
    DEFAULT_RECALL_KNOBS,
    DEFERRED_AFTER_FIRST,
    SKETCH_STRATEGY,
    VALUES_AHEAD_STRATEGY,
    VALUES_RECALL_KNOBS,
    VALUES_STRATEGY,
    RecallKnobs,
    RecallOutcome,
    RecallSession,
    RecallStatus,
    RecallStrategy,
    decode_with_recall,
    with_recall,
)
from services.offload.store import OffloadStore, OffloadStoreConfig, Refused, StoreKey

if TYPE_CHECKING:
    from services.evaluation.ruler_kvpress import KvpressRunner

GREEDY = SamplingParams()
SHAPE = SnapKVShape(observation_window=32)  # the RULER suite's SnapKV shape
Variant = tuple[ruler.Task, ruler.Haystack]
# The tasks; single needle and multi-key on RULER's noise haystack (where
# SmolLM2-135M's full cache answers), multi-value on prose (RULER's pairing).
TASKS: tuple[Variant, ...] = (
    (ruler.Task.NIAH_SINGLE, ruler.Haystack.NOISE),
    (ruler.Task.NIAH_MULTIKEY, ruler.Haystack.NOISE),
    (ruler.Task.NIAH_MULTIVALUE, ruler.Haystack.PROSE),
)
GOAL_GAP_CLOSED = 0.9
GOAL_RECALLED_SHARE = 0.05
GOAL_TPOT_RATIO = 1.3
_STORE_BYTES = 1 << 32


@dataclass(frozen=True)
class RecallVariant:
    """One recall configuration: the contract's knobs and the engine's strategy."""

    name: str
    knobs: RecallKnobs
    strategy: RecallStrategy = field(default_factory=RecallStrategy)


# The shipped knobs (`DEFAULT_RECALL_KNOBS`: 8-row pages, 8 pages per step, every step),
# recomputing every recalled step as before this issue; then the same knobs with the
# decode worker's strategy (recompute the cue step, later recalls deferred a step); and
# deferred after the first three steps (recall at the first steps after the cue). The
# tuning sweep on prompts from `TUNE_SEED` (report, "Tuning") found these knobs the most
# accurate of the ones tried at 2K; larger pages per step and tighter or midpoint-ranked
# pages did not do better.
TODAY = RecallVariant("today", DEFAULT_RECALL_KNOBS)
DEFERRED = RecallVariant("deferred", DEFAULT_RECALL_KNOBS, DEFERRED_AFTER_FIRST)
DEFERRED_K3 = RecallVariant("deferred-k3", DEFAULT_RECALL_KNOBS, RecallStrategy(recompute_steps=3))
# Row codes (4 bits a key coordinate inside the page's box) travel with the summaries; pages
# ranked by their rows' estimated logits, a step recalls only when some page's estimate
# clears the floor, each ranked page brings its successor (16 pages a step at most: 8 ranked
# and their successors), every second step evaluated (the successors cover the step between),
# the cue step recomputed and later recalls deferred (what the decode worker runs for such a
# manifest, `worker_strategy`). Chosen on prompts from `TUNE_SEED` (tuning.md, "Row codes").
CODES = RecallVariant("codes", CODES_RECALL_KNOBS, CODES_STRATEGY)
# The same, scoring row by row only the pages the page sketch scores best at each evaluated
# step (`SKETCH_STRATEGY`, not served): chosen on prompts from `TUNE_SEED` (tuning.md, "The
# page sketch").
CODES_SKETCH = RecallVariant("codes-sketch", CODES_RECALL_KNOBS, SKETCH_STRATEGY)
# The same, with the omitted-value term: each step's attention also takes the still-omitted
# pages' code-estimated mass carrying their mean values, computed afresh at the evaluated
# steps and reused in between (`VALUES_STRATEGY`, what the decode worker runs for such a
# manifest). Chosen on prompts from `TUNE_SEED` (tuning.md, "The omitted-value term, served").
VALUES = RecallVariant("values", VALUES_RECALL_KNOBS, VALUES_STRATEGY)
# The same, the term of the deferred steps computed beside the evaluated steps on the planner
# thread and read by the steps after them (`VALUES_AHEAD_STRATEGY`).
VALUES_AHEAD = RecallVariant("values-ahead", VALUES_RECALL_KNOBS, VALUES_AHEAD_STRATEGY)


@dataclass(frozen=True)
class RecallRulerConfig:
    """What to run: `prompts` per (task, length), budgets, recall variants, kvpress presses."""

    lengths: tuple[int, ...] = (4096,)
    prompts: int = 8
    budgets: tuple[float, ...] = (0.10, 0.25)
    tasks: tuple[Variant, ...] = TASKS
    variants: tuple[RecallVariant, ...] = (TODAY, DEFERRED, DEFERRED_K3, CODES, VALUES)
    presses: tuple[str, ...] = ("snapkv", "expected_attention")
    kvpress_lengths: tuple[int, ...] = (4096,)
    kvpress_prompts: int = 2  # the cell's first prompts (each press x budget is a prefill)
    batch: int = 8
    seed: int = REPORT_SEED
    filler_tokens: int = ruler.DEFAULT_FILLER_TOKENS

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.batch < 1:
            raise ValueError("prompts and batch must be >= 1")
        if any(not 0.0 < b < 1.0 for b in self.budgets):
            raise ValueError(f"budgets must be fractions in (0, 1), got {self.budgets}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"variant names must be distinct, got {names}")

    def specs(self, task: Variant, length: int, seed: int | None = None) -> list[ruler.PromptSpec]:
        """The cell's prompts, depths stratified over [0, 1) (prompt i in [i/n, (i+1)/n))."""
        base = self.seed if seed is None else seed
        out = []
        for index in range(self.prompts):
            value = base + 1_000_000 * TASKS.index(task) + 10 * length + index
            depth = (index + random.Random(value).random()) / self.prompts
            out.append(ruler.PromptSpec(task[0], task[1], ruler.Placement.BEFORE_FILLER,
                                        length, depth, value, self.filler_tokens))
        return out


PRESETS: dict[str, RecallRulerConfig] = {
    "smoke": RecallRulerConfig(lengths=(256,), prompts=2, budgets=(0.25,),
                               tasks=TASKS[:1], presses=(), batch=2, filler_tokens=32),
    "full": RecallRulerConfig(),
    # What the shared 2-core machine could afford for the report: 4K, the three
    # tasks, four prompts per cell, a batch of 8 filled with repeats, kvpress on one prompt per
    # cell, the worker's strategy without codes, with them, and with the omitted-value term.
    "shared-cpu": RecallRulerConfig(prompts=4, variants=(DEFERRED, CODES, CODES_SKETCH, VALUES),
                                    kvpress_prompts=1),
    # Its 8K part: single needle, two prompts per cell decoded as one batch of 2, no kvpress
    # (a transformers prefill at 8K per press and budget is past what the machine affords).
    "shared-cpu-8k": RecallRulerConfig(lengths=(8192,), prompts=2, tasks=TASKS[:1],
                                       variants=(DEFERRED, CODES, CODES_SKETCH, VALUES),
                                       presses=(), batch=2),
    # The other two tasks at 8K, for the served variants only (codes and values), two prompts
    # per cell as one batch of 2, and kvpress on the first prompt of each cell.
    "shared-cpu-8k-tasks": RecallRulerConfig(lengths=(8192,), prompts=2, tasks=TASKS[1:],
                                             variants=(CODES, VALUES), kvpress_lengths=(8192,),
                                             kvpress_prompts=1, batch=2),
    # The codes ranking with and without the page sketch only (single needle and multi-key
    # at 4K, no kvpress): how the sketch was checked on the tuning prompts (`--tune`).
    "scoring": RecallRulerConfig(prompts=4, tasks=TASKS[:2], variants=(CODES, CODES_SKETCH),
                                 presses=()),
    # The omitted-value term computed on the decode thread by the step that reads it, and
    # computed ahead on the planner thread (4K, the three tasks; and 8K, single needle, three
    # prompts as one batch): how `VALUES_AHEAD` was checked on the tuning prompts (`--tune`).
    "values-ahead": RecallRulerConfig(prompts=4, variants=(VALUES, VALUES_AHEAD), presses=()),
    "values-ahead-8k": RecallRulerConfig(lengths=(8192,), prompts=3, tasks=TASKS[:1],
                                         variants=(VALUES, VALUES_AHEAD), presses=(), batch=3),
}


@dataclass(frozen=True)
class Row:
    """One prompt under one policy at one budget (batch: the decode batch it ran in)."""

    engine: str  # kvrelay | kvpress
    policy: str
    budget: float | None
    task: str
    length: int
    index: int
    seed: int
    batch: int
    score: float
    output: str
    omitted_rows: int = 0
    recalled_rows: int = 0
    recalled_bytes: int = 0
    recalls: int = 0
    fallbacks: int = 0
    fetch_s: tuple[float, ...] = ()
    cue_s: float = 0.0  # the cue step (batch-wide wall time)
    step_s: tuple[float, ...] = ()  # answer steps while the whole batch decoded
    step_cpu_s: tuple[float, ...] = ()  # the same steps' CPU time (every thread of the process)


@dataclass
class SuiteRequest:
    rid: str
    policy: str
    budget: float | None
    prompt: ruler.RulerPrompt
    index: int
    compressed: CompressedPrompt
    session: RecallSession | None
    tokens: list[int] = field(default_factory=list)
    outcomes: list[RecallOutcome] = field(default_factory=list)
    cue_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    step_cpu_s: list[float] = field(default_factory=list)


class RecallRulerRunner:
    """Prefill, compress and decode every policy of the config (this process, CPU)."""

    def __init__(self, loaded: LoadedModel, config: RecallRulerConfig) -> None:
        self.loaded, self.config = loaded, config
        self.store = OffloadStore(OffloadStoreConfig(capacity_bytes=_STORE_BYTES, lease_s=3600.0))
        tokenizer = loaded.require_tokenizer()
        self.tokenizer = tokenizer
        self.stop_ids = tuple(sorted({*loaded.generation_config.eos_token_ids,
                                      *tokenizer.end_of_turn_ids()}))
        self._ids = 0

    def manifests(self, length: int) -> dict[tuple[str, float | None], KVVisibilityPolicyManifest]:
        """(policy, budget) -> manifest: full, then SnapKV uniform and its recall variants."""
        grid = policy_grid(self.loaded.tensor_contract, length, self.config.budgets,
                           (AllocationMethod.UNIFORM,), (GQAReduction.MEAN,), None, SHAPE)
        out: dict[tuple[str, float | None], KVVisibilityPolicyManifest] = {}
        for cell in grid:
            if cell.family == "full":
                out["full", None] = cell.manifest
            elif cell.family == "snapkv":
                out["snapkv", cell.budget] = cell.manifest
                for variant in self.config.variants:
                    recall = with_recall(cell.manifest, variant.knobs,
                                         mode=RecoverabilityMode.RECALLABLE_REMOTE)
                    out[f"snapkv+{variant.name}", cell.budget] = recall
        return out

    @torch.no_grad()
    def run_cell(self, prompts: Sequence[ruler.RulerPrompt], indices: Sequence[int]) -> list[Row]:
        """Every policy on the prompts of one (task, length): batches of `batch`, and the
        first prompt alone (batch-1 timing)."""
        length = prompts[0].spec.length
        manifests = self.manifests(length)
        probe = manifests["snapkv", self.config.budgets[0]]
        shared = [forward_for(self.loaded, probe, list(p.prefix), chunk_size=512) for p in prompts]
        rows: list[Row] = []
        size = self.config.batch
        for key, manifest in manifests.items():
            for start in range(0, len(prompts), size):
                chosen = list(range(start, min(start + size, len(prompts))))
                # A cell with fewer prompts than the batch fills it with repeats of its
                # prompts (timing only: a repeat decodes exactly as its original, and only
                # the originals are reported).
                filled = [chosen[i % len(chosen)] for i in range(size)]
                group = [self.request(key, manifest, prompts[i], indices[i], shared[i])
                         for i in filled]
                rows += self.decode(group)[: len(chosen)]
            if size > 1:  # batch-1 timing of the cell's first prompt
                rows += self.decode([self.request(key, manifest, prompts[0], indices[0],
                                                    shared[0])])
        return rows

    def request(
        self, key: tuple[str, float | None], manifest: KVVisibilityPolicyManifest,
        prompt: ruler.RulerPrompt, index: int, shared: object,
    ) -> SuiteRequest:
        self._ids += 1
        rid = f"e{self._ids}"
        compressed = compress_prompt(self.loaded, manifest, list(prompt.prefix), None,
                                     shared_forward=shared)  # type: ignore[arg-type]
        session = None
        if manifest.recoverability.recallable:
            variant = next(v for v in self.config.variants if key[0] == f"snapkv+{v.name}")
            session = self._session(rid, compressed, variant.strategy)
        return SuiteRequest(rid, key[0], key[1], prompt, index, compressed, session)

    def _session(
        self, rid: str, compressed: CompressedPrompt, strategy: RecallStrategy
    ) -> RecallSession:
        manifest, result = compressed.manifest, compressed.forward.result
        plan = offload_plan(manifest, result.source_k, result.source_v,
                            compressed.selection.positions)
        assert plan is not None, "recall variants carry a recallable manifest"
        state = replace(compressed.compressed.state, request_id=rid)
        key = StoreKey(rid, state.request_generation, state.state_generation)
        stored = self.store.put(key, plan.rows)
        if isinstance(stored, Refused):
            raise RuntimeError(f"offload store refused {rid}: {stored.reason.value}")
        return RecallSession(manifest, plan.summaries, StoreFetcher(self.store, key),
                             state=state, strategy=strategy)

    def decode(self, group: list[SuiteRequest]) -> list[Row]:
        """Teacher-force the cue, then greedy answers, for the whole batch; timed."""
        loaded = self.loaded
        limit = max(r.prompt.max_new_tokens for r in group)
        rows = max(int(r.compressed.view.row_offsets.diff(dim=1).max()) for r in group)
        # Room for one recall's rows per owner besides the view and the answer: the decode
        # worker's pool is fixed and reserves what recall may bring back at accept
        # (`decode_worker.accept.handoff_reservation_bytes`); a private pool grown in the middle
        # of a timed step copies every request's pages (~67 ms once at batch 8, 4K).
        cache = DecodeCache(loaded.config, loaded.dtype, loaded.device, batch_capacity=len(group),
                            row_capacity=rows + limit + 2 + max(map(recall_rows, group)))
        by_id = {r.rid: r for r in group}
        for r in group:
            cache.admit_view(r.rid, r.compressed.view, frontier=r.compressed.forward.prompt_len)
        try:
            cue = group[0].prompt.cue
            started = time.perf_counter()
            logits = self.step(cache, [cue[-1]] * len(group), by_id)
            cue_s = time.perf_counter() - started
            for r in group:
                r.cue_s = cue_s
            while cache.request_ids:
                steps = [len(by_id[rid].tokens) for rid in cache.request_ids]
                chosen = sample(logits, [GREEDY] * len(steps), steps)  # [B]
                for rid, token in zip(list(cache.request_ids), chosen.tolist(), strict=True):
                    request = by_id[rid]
                    request.tokens.append(int(token))
                    if finish_reason(int(token), len(request.tokens), request.prompt.max_new_tokens,
                                     GREEDY, self.stop_ids) is not None:
                        cache.release(rid)
                        del by_id[rid]
                if by_id:
                    full = len(by_id) == len(group)
                    started, cpu = time.perf_counter(), time.process_time()
                    logits = self.step(cache, [by_id[rid].tokens[-1] for rid in cache.request_ids],
                                        by_id)
                    if full:
                        elapsed, used = time.perf_counter() - started, time.process_time() - cpu
                        for r in group:
                            r.step_s.append(elapsed)
                            r.step_cpu_s.append(used)
        finally:
            for r in group:
                self.store.release(r.rid)
        return [self._row(r, len(group)) for r in group]

    def step(self, cache: DecodeCache, tokens: list[int], by_id: dict[str, SuiteRequest]
             ) -> torch.Tensor:
        sessions = {rid: r.session for rid, r in by_id.items() if r.session is not None}
        step = decode_with_recall(self.loaded.model, cache, tokens, sessions)
        for rid, outcome in step.outcomes.items():
            by_id[rid].outcomes.append(outcome)
        return step.logits  # [B, V]

    def _row(self, r: SuiteRequest, batch: int) -> Row:
        spec = r.prompt.spec
        output = self.tokenizer.decode(r.tokens, skip_special_tokens=True)
        recalled = [o for o in r.outcomes if o.status is RecallStatus.RECALLED]
        fell = [o for o in r.outcomes
                if o.status in (RecallStatus.CONTINUED_LOSSY, RecallStatus.FAILED)]
        return Row(
            engine="kvrelay", policy=r.policy, budget=r.budget, task=_task_name(spec),
            length=spec.length, index=r.index, seed=spec.seed, batch=batch,
            score=ruler.string_match_all(output, r.prompt.answers), output=output,
            omitted_rows=r.compressed.ledger.omitted_rows,
            recalled_rows=sum(o.rows for o in recalled),
            recalled_bytes=sum(o.nbytes for o in recalled), recalls=len(recalled),
            fallbacks=len(fell), fetch_s=tuple(o.latency_s for o in recalled),
            cue_s=r.cue_s, step_s=tuple(r.step_s), step_cpu_s=tuple(r.step_cpu_s),
        )


def recall_rows(request: SuiteRequest) -> int:
    """Rows one recall may add to an owner of `request` (0 without recall)."""
    contract = request.compressed.manifest.recoverability
    if not contract.recallable:
        return 0
    assert contract.max_pages_per_step is not None and contract.page_size is not None
    return contract.max_pages_per_step * contract.page_size


def _task_name(spec: ruler.PromptSpec) -> str:
    return f"{spec.task.value}/{spec.haystack.value}"


def kvpress_rows(
    press: KvpressRunner, prompt: ruler.RulerPrompt, index: int, presses: Sequence[str],
    budgets: Sequence[float],
) -> list[Row]:
    """Every press at every budget on one prompt (a transformers prefill each)."""
    rows = []
    for name in presses:
        for budget in budgets:
            trial = press.run(prompt, index, name, budget)
            rows.append(Row(engine="kvpress", policy=f"kvpress:{name}", budget=budget,
                            task=_task_name(prompt.spec), length=prompt.spec.length, index=index,
                            seed=prompt.spec.seed, batch=1, score=trial.score,
                            output=trial.output))
    return rows


# --- summary -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """Accuracy and cost of one policy in one (task, length, budget), batch-`batch` runs."""

    task: str
    length: int
    budget: float | None
    policy: str
    requests: int
    accuracy: float
    recalled_share: float  # recalled rows / omitted rows, summed over requests
    recalled_kib: float  # per request
    recalls: float  # per request
    fetch_ms: float | None
    fallbacks: int
    cue_ms: float
    tpot_ms: float | None  # batch `batch`, answer steps with the whole batch decoding
    tpot1_ms: float | None  # the cell's first prompt alone
    cpu_ms: float | None  # CPU time per answer step, batch `batch`
    cpu1_ms: float | None  # CPU time per answer step, batch 1
    # Of the requests whose full-cache answer names a number, the share whose answer names the
    # same one (`ruler.answer_number`): whether the compressed cache answers as the full one
    # does, right or wrong (None: no full-cache answer names a number).
    same_as_full: float | None = None
    full_named: int = 0  # the requests compared


def summarize(rows: Sequence[Row], batch: int) -> list[Cell]:
    """One cell per (task, length, budget, policy) over the batch runs (kvpress: batch 1)."""
    groups: dict[tuple[str, int, float | None, str], list[Row]] = {}
    alone: dict[tuple[str, int, float | None, str], list[Row]] = {}
    named = {(r.task, r.length, r.index): ruler.answer_number(r.output) for r in rows
             if r.engine == "kvrelay" and r.policy == "full" and (r.batch > 1 or batch == 1)}
    for r in rows:
        key = (r.task, r.length, r.budget, r.policy)
        if r.engine == "kvpress" or r.batch > 1 or batch == 1:
            groups.setdefault(key, []).append(r)
        if r.batch == 1:
            alone.setdefault(key, []).append(r)
    cells = []
    for key, members in groups.items():
        fetch = [s for r in members for s in r.fetch_s]
        steps = [s for r in members[:1] for s in r.step_s]  # batch-wide: one request's view
        single = [s for r in alone.get(key, [])[:1] for s in r.step_s]
        cpu = [s for r in members[:1] for s in r.step_cpu_s]
        cpu1 = [s for r in alone.get(key, [])[:1] for s in r.step_cpu_s]
        omitted = sum(r.omitted_rows for r in members)
        compared = [ruler.answer_number(r.output) == named[r.task, r.length, r.index]
                    for r in members if named.get((r.task, r.length, r.index))]
        cells.append(Cell(
            task=key[0], length=key[1], budget=key[2], policy=key[3], requests=len(members),
            accuracy=mean(r.score for r in members),
            recalled_share=sum(r.recalled_rows for r in members) / omitted if omitted else 0.0,
            recalled_kib=mean(r.recalled_bytes for r in members) / 1024,
            recalls=mean(r.recalls for r in members),
            fetch_ms=1000 * mean(fetch) if fetch else None,
            fallbacks=sum(r.fallbacks for r in members),
            cue_ms=1000 * mean(r.cue_s for r in members[:1]),
            tpot_ms=1000 * mean(steps) if steps and members[0].engine == "kvrelay" else None,
            tpot1_ms=1000 * mean(single) if single and members[0].engine == "kvrelay" else None,
            cpu_ms=1000 * mean(cpu) if cpu else None,
            cpu1_ms=1000 * mean(cpu1) if cpu1 else None,
            same_as_full=mean(compared) if compared else None, full_named=len(compared),
        ))
    return cells


def _pct(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def report_tables(cells: Sequence[Cell], variants: Sequence[str], batch: int) -> str:
    """Accuracy (with gap closed and best kvpress press), recall cost, TPOT, goal verdicts."""
    by = {(c.task, c.length, c.budget, c.policy): c for c in cells}
    keys = sorted({(c.task, c.length, c.budget) for c in cells if c.budget is not None})
    acc = ["| task | length | budget | full | snapkv | "
           + " | ".join(f"+{v}" for v in variants) + " | gap closed ("
           + ", ".join(variants) + ") | full cache's number named (snapkv, "
           + ", ".join(variants) + ") | best kvpress |",
           "| --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in variants)
           + " | ---: | ---: | --- |"]
    cost = [f"| task | length | budget | variant | recalled % of omitted | recalled KiB/req "
            f"| recalls/req | fetch ms | fallbacks | cue ms (b{batch}) | TPOT b1 ms snapkv / "
            f"recall: wall (ratio), CPU (ratio) | TPOT b{batch} ms snapkv / recall: wall "
            f"(ratio), CPU (ratio) | full TPOT b1 / b{batch} |",
            "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: |"]
    for task, length, budget in keys:
        full, lossy = by.get((task, length, None, "full")), by.get((task, length, budget, "snapkv"))
        if full is None or lossy is None:
            continue
        recall = [by.get((task, length, budget, f"snapkv+{v}")) for v in variants]
        presses = [c for c in cells if (c.task, c.length, c.budget) == (task, length, budget)
                   and c.policy.startswith("kvpress:")]
        best = max(presses, key=lambda c: c.accuracy, default=None)
        closed = [_gap_closed(full.accuracy, lossy.accuracy, c.accuracy if c else None)
                  for c in recall]
        acc.append(
            f"| {task} | {length} | {budget:.0%} | {_pct(full.accuracy)} | {_pct(lossy.accuracy)} | "
            + " | ".join(_pct(c.accuracy) if c else "-" for c in recall) + " | "
            + ", ".join("no gap" if x is None else _pct(x) for x in closed) + " | "
            + ", ".join(_pct(c.same_as_full) if c else "-" for c in (lossy, *recall)) + " | "
            + (f"{best.policy.removeprefix('kvpress:')} {_pct(best.accuracy)}" if best else "-")
            + " |")
        for name, c in zip(variants, recall, strict=True):
            if c is None:
                continue
            cost.append(
                f"| {task} | {length} | {budget:.0%} | {name} | {_pct(c.recalled_share, 2)} "
                f"| {c.recalled_kib:.0f} | {c.recalls:.1f} | {_ms(c.fetch_ms) if c.fetch_ms is None else f'{c.fetch_ms:.1f}'} "
                f"| {c.fallbacks} | {_ms(c.cue_ms)} "
                f"| {_pair(lossy.tpot1_ms, c.tpot1_ms)}, {_pair(lossy.cpu1_ms, c.cpu1_ms)} "
                f"| {_pair(lossy.tpot_ms, c.tpot_ms)}, {_pair(lossy.cpu_ms, c.cpu_ms)} "
                f"| {_ms(full.tpot1_ms)} / {_ms(full.tpot_ms)} |")
    return ("### Accuracy (RULER string match)\n\n" + "\n".join(acc)
            + "\n\n### Recall cost and decode time\n\n" + "\n".join(cost) + "\n")


def _gap_closed(full: float, lossy: float, recall: float | None) -> float | None:
    if recall is None or full <= lossy:
        return None
    return (recall - lossy) / (full - lossy)


def _pair(lossy: float | None, recall: float | None) -> str:
    return f"{_ms(lossy)} / {_ms(recall)} ({_ratio(recall, lossy)})"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or not den else f"{num / den:.2f}x"


def goal_lines(cells: Sequence[Cell], variant: str) -> list[str]:
    """The issue's goals for one variant, each with its verdict from this run's cells."""
    by = {(c.task, c.length, c.budget, c.policy): c for c in cells}
    recall = [c for c in cells if c.policy == f"snapkv+{variant}"]
    closed, shares, ahead = [], [], []
    ratios1, ratios_b, cpu1, cpu_b = [], [], [], []
    for c in recall:
        full, lossy = by.get((c.task, c.length, None, "full")), by.get(
            (c.task, c.length, c.budget, "snapkv"))
        if full is None or lossy is None:
            continue
        gap = _gap_closed(full.accuracy, lossy.accuracy, c.accuracy)
        if gap is not None:
            closed.append((gap, f"{c.task} {c.length} {c.budget:.0%}"))
        shares.append(c.recalled_share)
        if c.tpot1_ms and lossy.tpot1_ms:
            ratios1.append(c.tpot1_ms / lossy.tpot1_ms)
        if c.tpot_ms and lossy.tpot_ms:
            ratios_b.append(c.tpot_ms / lossy.tpot_ms)
        if c.cpu1_ms and lossy.cpu1_ms:
            cpu1.append(c.cpu1_ms / lossy.cpu1_ms)
        if c.cpu_ms and lossy.cpu_ms:
            cpu_b.append(c.cpu_ms / lossy.cpu_ms)
        presses = [p.accuracy for p in cells if (p.task, p.length, p.budget) ==
                   (c.task, c.length, c.budget) and p.policy.startswith("kvpress:")]
        if presses:
            ahead.append(c.accuracy > max(presses) or c.accuracy == full.accuracy)
    met_gap = [g for g, _ in closed if g >= GOAL_GAP_CLOSED]
    named = [(c.same_as_full, c.full_named) for c in recall if c.same_as_full is not None]
    return [
        f"- gap closed >= {GOAL_GAP_CLOSED:.0%}: {len(met_gap)} of {len(closed)} cells with a gap "
        f"({', '.join(f'{n}: {_pct(g)}' for g, n in closed) or 'none'})",
        f"- recalled <= {GOAL_RECALLED_SHARE:.0%} of omitted rows: "
        f"{sum(s <= GOAL_RECALLED_SHARE for s in shares)} of {len(shares)} cells "
        f"(largest {_pct(max(shares, default=None), 2)})",
        f"- TPOT <= {GOAL_TPOT_RATIO}x irrecoverable (wall time per answer step): batch 1 "
        f"{sum(r <= GOAL_TPOT_RATIO for r in ratios1)} of {len(ratios1)} cells "
        f"(worst {max(ratios1, default=0):.2f}x), batch b "
        f"{sum(r <= GOAL_TPOT_RATIO for r in ratios_b)} of {len(ratios_b)} "
        f"(worst {max(ratios_b, default=0):.2f}x)",
        f"- CPU time per answer step against irrecoverable (every thread: the planner's and "
        f"the fetches' too): batch 1 {_span(cpu1)}, batch b {_span(cpu_b)}",
        f"- ahead of the best kvpress press (or at the full cache): {sum(ahead)} of {len(ahead)} "
        "cells",
        f"- names the number the full cache names, right or wrong (not a goal): "
        f"{sum(round(share * n) for share, n in named)} of {sum(n for _, n in named)} requests",
    ]


def _span(ratios: Sequence[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "-"


@dataclass(frozen=True)
class RecallRulerReport:
    rows: list[Row]
    cells: list[Cell]
    markdown: str


def run(
    checkpoint: Path,
    config: RecallRulerConfig,
    out_dir: Path,
    threads: int | None = 1,
    kvpress: bool = True,
    console: Console | None = None,
) -> RecallRulerReport:
    """Run the config, write report.md and rows.jsonl into `out_dir`, print the report."""
    console = console or Console()
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    loaded = load(checkpoint)
    runner = RecallRulerRunner(loaded, config)
    press = _kvpress(loaded, checkpoint) if kvpress and config.presses else None
    tokenizer = loaded.require_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    sink = (out_dir / "rows.jsonl").open("w")
    rows: list[Row] = []
    cells = [(t, n) for n in config.lengths for t in config.tasks]
    try:
        for task, length in tqdm(cells, desc="eval recall (ruler)", unit="cell"):
            specs = config.specs(task, length)
            prompts = [ruler.build_prompt(tokenizer, s) for s in specs]
            new = runner.run_cell(prompts, list(range(len(prompts))))
            if press is not None and length in config.kvpress_lengths:
                for index, prompt in enumerate(prompts[: config.kvpress_prompts]):
                    new += kvpress_rows(press, prompt, index, config.presses, config.budgets)
            for row in new:
                sink.write(json.dumps(asdict(row)) + "\n")
            sink.flush()
            rows += new
    finally:
        sink.close()
    if runner.store.used_bytes != 0:
        raise RuntimeError(f"offload store still holds {runner.store.used_bytes} bytes")
    summary = summarize(rows, config.batch)
    text = _report(checkpoint, config, summary, time.perf_counter() - started, press is not None)
    (out_dir / "report.md").write_text(text)
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    return RecallRulerReport(rows, summary, text)


def load_rows(path: Path) -> list[Row]:
    """The rows a run wrote (`rows.jsonl`), e.g. to render its report again."""
    rows = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        for name in ("fetch_s", "step_s", "step_cpu_s"):
            data[name] = tuple(data[name])
        rows.append(Row(**data))
    return rows


def render(
    checkpoint: Path, config: RecallRulerConfig, rows: Sequence[Row], seconds: float,
    kvpress: bool,
) -> str:
    """The Markdown report of a run's rows."""
    return _report(checkpoint, config, summarize(rows, config.batch), seconds, kvpress)


def _seeds(seed: int) -> str:
    if seed == TUNE_SEED:
        return (f"Tuning prompts (seed {TUNE_SEED}, `--tune`): the prompts knobs are chosen "
                f"on, never the reported ones (seed {REPORT_SEED}).")
    return (f"Prompts from seed {seed} (reported); knobs chosen on prompts from seed "
            f"{TUNE_SEED} (disjoint).")


def _kvpress(loaded: LoadedModel, checkpoint: Path) -> KvpressRunner:
    from services.evaluation.ruler_kvpress import KvpressRunner

    return KvpressRunner(loaded, checkpoint, SHAPE)


def _report(
    checkpoint: Path, config: RecallRulerConfig, cells: Sequence[Cell], seconds: float,
    kvpress: bool,
) -> str:
    names = [v.name for v in config.variants]
    variants = "\n".join(f"- `{v.name}`: {v.knobs}, {v.strategy}" for v in config.variants)
    goals = "\n".join(f"#### `{name}`\n\n" + "\n".join(goal_lines(cells, name)) + "\n"
                      for name in names)
    return (
        f"# Recall on a real model: `{checkpoint.name}`, RULER-style tasks\n\n"
        f"`kvrelay eval recall --suite ruler`: {config.prompts} prompts per (task, length), "
        f"placement `before_filler` ({config.filler_tokens} filler tokens after the question: "
        f"SnapKV's {SHAPE.observation_window}-token window never sees it), lengths "
        f"{', '.join(map(str, config.lengths))}, budgets "
        f"{', '.join(f'{b:.0%}' for b in config.budgets)} of the context rows. "
        f"{_seeds(config.seed)} Decode batch {config.batch} (the cell's prompts together, "
        f"repeated to fill it when fewer; repeats are timed, not reported) and the "
        f"first prompt alone (batch 1); {torch.get_num_threads()} torch thread(s) on a shared "
        f"CPU, {seconds:.0f} s wall. kvpress: "
        f"{', '.join(config.presses) if kvpress else 'not run'} at lengths "
        f"{', '.join(map(str, config.kvpress_lengths)) if kvpress else '-'}, on the first "
        f"{config.kvpress_prompts} prompts of each cell.\n\n"
        f"Recall variants:\n\n{variants}\n\nHow the knobs and strategies were chosen, what "
        f"else was tried and why the bound misses on this model: `tuning.md` (tuning "
        f"prompts only).\n\n## Goals (this run)\n\n{goals}\n"
        f"## Results\n\n{report_tables(cells, names, config.batch)}"
    )
