"""`kvrelay eval --suite ruler`, kvrelay's side: every policy from one prefill of each prompt.

Protocol per prompt (`ruler.RulerPrompt`). The prefix (the prompt without its cue: template
tail and answer prefix) is prefilled once with the prefill worker's `forward`, capturing the
SnapKV observation window. Every policy runs score → allocate → select → pack on that one
forward (`generation.compress_prompt`, `shared_forward`); the packed views are admitted to decode
caches as the decode worker admits them; the cue is decoded over each compressed cache
(teacher-forced) and the answer greedily after it, until EOS / end of turn or the task's
token limit. No answer token comes from the full prefill, so each policy's cache answers.

Policies decode side by side, one `DecodeCache` per group (the full cache; the lossy
policies, per budget at long contexts; the recallable ones), which is how the decode worker
batches: a request's attention reads only its own rows (its logits equal a lone decode's up
to fp32 summation order). Recallable policies page their omitted rows with the prefill
worker's `offload_plan` (`services.offload.plan`); `recallable_remote` rows go into an `OffloadStore` read back by
`StoreFetcher`, `recallable_local` rows stay in the decode side's host tier
(`LocalPageFetcher`); every cue and answer step of their group runs `decode_with_recall`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.evaluation import ruler
from services.evaluation.generation import CompressedPrompt, compress_prompt, forward_for
from services.evaluation.policies import PolicyCell, SnapKVShape, policy_grid
from services.kvpolicy.head_profile import HeadProfile
from services.kvpolicy.manifest import AllocationMethod, GQAReduction, RecoverabilityMode
from services.model import (
    DecodeCache,
    LoadedModel,
    PromptForward,
    SamplingParams,
    finish_reason,
    sample,
)
from services.offload.fetchers import LocalPageFetcher, StoreFetcher
from services.offload.plan import offload_plan
from services.offload.recall import (
    DEFAULT_RECALL_KNOBS,
    RECOMPUTE_ALWAYS,
    RecallKnobs,
    RecallSession,
    RecallStatus,
    RecallStrategy,
    decode_with_recall,
    with_recall,
)
from services.offload.store import OffloadStore, OffloadStoreConfig, Refused, StoreKey

RECALL_MODES = (RecoverabilityMode.RECALLABLE_REMOTE, RecoverabilityMode.RECALLABLE_LOCAL)
GREEDY = SamplingParams()
_STORE_BYTES = 1 << 31


@dataclass(frozen=True)
class PolicySet:
    """Which policies every prompt runs (besides `full`, `window` and `sink-recent`)."""

    budgets: tuple[float, ...] = (0.10, 0.25, 0.50)
    allocations: tuple[AllocationMethod, ...] = tuple(AllocationMethod)
    reduction: GQAReduction = GQAReduction.MEAN  # kvpress's GQA rule
    recall_modes: tuple[RecoverabilityMode, ...] = RECALL_MODES  # on SnapKV uniform
    recall_knobs: RecallKnobs = DEFAULT_RECALL_KNOBS
    recall_strategy: RecallStrategy = RECOMPUTE_ALWAYS  # when recalled rows reach attention
    # SnapKV paper's window (32): the answer prefix and template tail take ~12 of its rows,
    # so at the end placement the question's key still falls inside it.
    shape: SnapKVShape = field(default_factory=lambda: SnapKVShape(observation_window=32))
    split_budgets_from: int = 4096  # prompts this long decode each budget in its own batch

    def __post_init__(self) -> None:
        if not self.budgets or any(not 0.0 < b < 1.0 for b in self.budgets):
            raise ValueError(f"budgets: must be fractions in (0, 1), got {self.budgets}")
        if any(m not in RECALL_MODES for m in self.recall_modes):
            raise ValueError(f"recall_modes: must come from {[m.value for m in RECALL_MODES]}")


@dataclass(frozen=True)
class Trial:
    """One prompt under one policy (kvrelay) or press (kvpress); one JSONL line."""

    engine: str  # kvrelay | kvpress
    policy: str  # PolicyCell label (+recall mode), or the press name
    budget: float | None  # None for full caches
    task: str
    haystack: str
    placement: str
    length: int
    index: int
    seed: int
    depth: float
    score: float  # ruler.string_match_all
    output: str
    answers: tuple[str, ...]
    retained_share: float  # rows kept / rows of the full cache (recalled rows not counted)
    recalled_rows: int = 0
    recalls: int = 0

    @property
    def key(self) -> tuple[object, ...]:
        """What identifies a trial across runs (resume)."""
        return trial_key(self.engine, self.policy, self.budget, self.task, self.haystack,
                         self.placement, self.length, self.index)


def trial_key(
    engine: str, policy: str, budget: float | None, task: str, haystack: str, placement: str,
    length: int, index: int,
) -> tuple[object, ...]:
    return (engine, policy, budget, task, haystack, placement, length, index)


@dataclass(frozen=True)
class RulerCell:
    """One policy of the suite: its grid cell and, for recall variants, the mode."""

    cell: PolicyCell
    recall: RecoverabilityMode | None = None

    @property
    def label(self) -> str:
        return self.cell.label if self.recall is None else f"{self.cell.label}+{self.recall.value}"


def suite_cells(
    loaded: LoadedModel, policies: PolicySet, prompt_len: int, profile: HeadProfile | None
) -> list[RulerCell]:
    """`policy_grid` at the suite's reduction, then the recall variants of SnapKV uniform."""
    grid = policy_grid(loaded.tensor_contract, prompt_len, policies.budgets, policies.allocations,
                       (policies.reduction,), profile, policies.shape)
    cells = [RulerCell(cell) for cell in grid]
    for cell in grid:
        if cell.family == "snapkv" and cell.allocation is AllocationMethod.UNIFORM:
            for mode in policies.recall_modes:
                manifest = with_recall(cell.manifest, policies.recall_knobs, mode=mode)
                cells.append(RulerCell(dataclasses.replace(cell, manifest=manifest), mode))
    return cells


@dataclass
class _Request:
    """One policy's decode of one prompt (mutable while its group decodes)."""

    rid: str
    cell: RulerCell
    compressed: CompressedPrompt
    session: RecallSession | None
    tokens: list[int] = field(default_factory=list)
    recalled_rows: int = 0
    recalls: int = 0


class RulerRunner:
    """Runs every policy of `policies` on prompts of one checkpoint, in this process."""

    def __init__(
        self,
        loaded: LoadedModel,
        policies: PolicySet,
        profile: HeadProfile | None,
        chunk_size: int = 512,
    ) -> None:
        self.loaded, self.policies, self.profile = loaded, policies, profile
        self.chunk_size = chunk_size
        self.store = OffloadStore(OffloadStoreConfig(capacity_bytes=_STORE_BYTES, lease_s=3600.0))
        tokenizer = loaded.require_tokenizer()
        self.tokenizer = tokenizer
        self.stop_ids = tuple(sorted({*loaded.generation_config.eos_token_ids,
                                      *tokenizer.end_of_turn_ids()}))

    @torch.no_grad()
    def run_prompt(
        self, prompt: ruler.RulerPrompt, index: int, policies: PolicySet | None = None
    ) -> list[Trial]:
        """Every policy (of `policies`, default the runner's) on `prompt`: one prefill, then
        compress and decode per policy."""
        prefix = list(prompt.prefix)
        cells = suite_cells(self.loaded, policies or self.policies, len(prefix), self.profile)
        probe = next((c.cell.manifest for c in cells if c.cell.family == "snapkv"),
                     cells[0].cell.manifest)
        shared = forward_for(self.loaded, probe, prefix, chunk_size=self.chunk_size)
        requests = [self._request(f"r{i}", cell, prefix, shared) for i, cell in enumerate(cells)]
        try:
            for group in self._groups(requests, len(prefix)):
                self._decode(group, prompt)
        finally:
            for request in requests:
                self.store.release(request.rid)
        return [self._trial(prompt, index, request) for request in requests]

    def _request(
        self, rid: str, cell: RulerCell, prefix: list[int], shared: PromptForward
    ) -> _Request:
        compressed = compress_prompt(self.loaded, cell.cell.manifest, prefix, self.profile,
                                     shared_forward=shared)
        session = self._session(rid, compressed) if cell.recall is not None else None
        return _Request(rid, cell, compressed, session)

    def _session(self, rid: str, compressed: CompressedPrompt) -> RecallSession:
        """Page the omitted rows (prefill side) and open the decode side's recall session."""
        manifest, result = compressed.manifest, compressed.forward.result
        plan = offload_plan(manifest, result.source_k, result.source_v,
                            compressed.selection.positions)
        assert plan is not None, "recall cells carry a recallable manifest"
        state = dataclasses.replace(compressed.compressed.state, request_id=rid)
        strategy = self.policies.recall_strategy
        if plan.mode is RecoverabilityMode.RECALLABLE_LOCAL:
            return RecallSession(manifest, plan.summaries, LocalPageFetcher(plan.rows),
                                 state=state, strategy=strategy)
        key = StoreKey(rid, state.request_generation, state.state_generation)
        stored = self.store.put(key, plan.rows)
        if isinstance(stored, Refused):
            raise RuntimeError(f"offload store refused {rid}: {stored.reason.value}")
        return RecallSession(manifest, plan.summaries, StoreFetcher(self.store, key),
                             state=state, strategy=strategy)

    def _groups(self, requests: Sequence[_Request], prompt_len: int) -> list[list[_Request]]:
        """Decode batches: full alone, recallable together, lossy together (or per budget)."""
        split = prompt_len >= self.policies.split_budgets_from
        groups: dict[tuple[object, ...], list[_Request]] = {}
        for request in requests:
            cell = request.cell
            key = ("full",) if cell.cell.family == "full" else (
                cell.recall is not None, cell.cell.budget if split else None)
            groups.setdefault(key, []).append(request)
        return list(groups.values())

    def _decode(self, group: list[_Request], prompt: ruler.RulerPrompt) -> None:
        """Teacher-force the cue, then greedy answers, for every request of the batch."""
        loaded, cue, limit = self.loaded, prompt.cue, prompt.max_new_tokens
        rows = max(int(r.compressed.view.row_offsets.diff(dim=1).max()) for r in group)
        cache = DecodeCache(loaded.config, loaded.dtype, loaded.device,
                            batch_capacity=len(group), row_capacity=rows + len(cue) + limit + 1)
        by_id = {r.rid: r for r in group}
        for r in group:
            cache.admit_view(r.rid, r.compressed.view, frontier=r.compressed.forward.prompt_len)
        logits = torch.empty(0)
        for token in cue:
            logits = self._step(cache, [token] * len(group), by_id)
        while cache.request_ids:
            steps = [len(by_id[rid].tokens) for rid in cache.request_ids]
            chosen = sample(logits, [GREEDY] * len(steps), steps)  # [B]
            for rid, token in zip(list(cache.request_ids), chosen.tolist(), strict=True):
                request = by_id[rid]
                request.tokens.append(int(token))
                if finish_reason(int(token), len(request.tokens), limit, GREEDY,
                                 self.stop_ids) is not None:
                    cache.release(rid)
                    del by_id[rid]
            if cache.request_ids:
                logits = self._step(cache, [by_id[rid].tokens[-1] for rid in cache.request_ids],
                                    by_id)

    def _step(self, cache: DecodeCache, tokens: list[int], by_id: dict[str, _Request]
              ) -> torch.Tensor:
        """One batched decode step (with recall for the requests that have a session)."""
        sessions = {rid: r.session for rid, r in by_id.items() if r.session is not None}
        step = decode_with_recall(self.loaded.model, cache, tokens, sessions)
        for rid, outcome in step.outcomes.items():
            if outcome.status is RecallStatus.RECALLED:
                by_id[rid].recalls += 1
                by_id[rid].recalled_rows += outcome.rows
        return step.logits  # [B, V]

    def _trial(self, prompt: ruler.RulerPrompt, index: int, request: _Request) -> Trial:
        spec, cell = prompt.spec, request.cell
        output = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
        ledger = request.compressed.ledger
        return Trial(
            engine="kvrelay", policy=cell.label, budget=cell.cell.budget, task=spec.task.value,
            haystack=spec.haystack.value, placement=spec.placement.value, length=spec.length,
            index=index, seed=spec.seed, depth=spec.depth,
            score=ruler.string_match_all(output, prompt.answers), output=output,
            answers=prompt.answers,
            retained_share=ledger.visible_rows / max(ledger.visible_rows + ledger.omitted_rows, 1),
            recalled_rows=request.recalled_rows, recalls=request.recalls,
        )


MAX_PROMPTS_PER_CELL = 10


def prompt_seed(
    base: int, task: ruler.Task, haystack: ruler.Haystack, length: int, index: int
) -> int:
    """The seed of prompt `index` of one (task, haystack, length). Both placements share it:
    the same needles in the same haystack, only the question moves."""
    if not 0 <= index < MAX_PROMPTS_PER_CELL:
        raise ValueError(f"index: must be in [0, {MAX_PROMPTS_PER_CELL}), got {index}")
    task_index, haystack_index = list(ruler.Task).index(task), list(ruler.Haystack).index(haystack)
    return base + 1_000_000 * task_index + 100_000 * haystack_index + 10 * length + index
