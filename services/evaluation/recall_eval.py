"""`kvrelay eval recall`: does recalling omitted rows win back what compression lost?

Held-out needle prompts (`services.demo.needle`) of the bundled demo checkpoint, the needle
depth spread evenly over the haystack, in both question placements: (a) `END`, the question
closes the prefilled context, inside SnapKV's observation window; (b) `BEFORE_FILLER`, a
long stretch of filler follows the question, so the window does not see it.

Protocol per prompt. The prompt minus its answer cue (`answer :`) is prefilled once, with
observation capture. Every policy then selects from that one prefill at each budget (a
fraction of the context rows; static windows get the same row count), the retained rows are
packed and admitted to a `DecodeCache` exactly as the decode worker admits a transferred view,
and the two cue tokens are decoded on the decode side, as a follow-up turn would be: the
compressed cache, not the prefill, answers. The answer is the greedy token after the cue;
a prompt counts as answered when it is the needle's code. (Sampling the answer at the end of
prefill, as a single-turn request does, would read it from the full cache under every policy.)

The `-recall` variants of the SnapKV policies carry a `recallable_remote` contract with the
tuned `DEFAULT_RECALL_KNOBS`: their omitted rows go into an in-process `OffloadStore` (the
prefill worker's store), and each cue step runs through `decode_with_recall` with a
`RecallSession` whose fetcher reads that store, the engine the decode worker runs.

Reported per (placement, context, budget, policy): accuracy, agreement with the full cache's
answer, recalled rows and bytes per request (and as a share of the omitted rows), recalls
and fetch latency, decode ms/token (recall included). The goal check: in placement (b) at a
25% budget recall closes >= 90% of the accuracy gap between SnapKV without recall and the
full cache while recalling < 20% of the omitted rows on average.

`--tune` sweeps the recall knobs on prompts drawn from seeds disjoint from the evaluation's
(`TUNE_SEED`), placement (b), 25% budget, SnapKV uniform, and prints the ranking.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from rich.console import Console
from tqdm import tqdm

from services.demo import needle
from services.kvpolicy.compress import Compressed, StateIdentity, compress
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.kvpolicy.state import KVPolicyState
from services.model import (
    DecodeCache,
    LoadedModel,
    PrefillOptions,
    PrefillResult,
    decode_step,
)
from services.model import load as load_model
from services.model import prefill as model_prefill
from services.offload.fetchers import StoreFetcher
from services.offload.plan import offload_plan
from services.offload.recall import (
    DEFAULT_RECALL_KNOBS,
    RecallKnobs,
    RecallOutcome,
    RecallSession,
    RecallStatus,
    decode_with_recall,
    with_recall,
)
from services.offload.store import OffloadStore, OffloadStoreConfig, Refused, StoreKey

EVAL_SEED = 9_000_000  # held-out evaluation prompts
TUNE_SEED = 9_500_000  # knob tuning prompts: disjoint seeds, never evaluated
CUE_TOKENS = needle.CUE_TOKENS
SNAPKV_POLICIES = ("snapkv", "snapkv-pyramid", "snapkv-adakv")
LOSSY_POLICIES = ("window", "sink-recent", *SNAPKV_POLICIES)
RECALL_POLICIES = tuple(f"{name}-recall" for name in SNAPKV_POLICIES)
POLICIES = ("full", *LOSSY_POLICIES, *RECALL_POLICIES)
GOAL_PLACEMENT = needle.Placement.BEFORE_FILLER
GOAL_BUDGET = 0.25
GOAL_GAP_CLOSED = 0.9
GOAL_RECALLED_SHARE = 0.2
STORE_BYTES = 1 << 28


@dataclass(frozen=True)
class RecallEvalConfig:
    """What to evaluate. `prompts` per (placement, context length), depths evenly spread."""

    context_lengths: tuple[int, ...] = (1024, 2048)
    budgets: tuple[float, ...] = (0.10, 0.25, 0.50)
    placements: tuple[needle.Placement, ...] = (
        needle.Placement.END,
        needle.Placement.BEFORE_FILLER,
    )
    policies: tuple[str, ...] = POLICIES
    prompts: int = 64
    knobs: RecallKnobs = DEFAULT_RECALL_KNOBS
    observation_window: int = 16
    sinks: int = 4
    distractors: int = 3
    question_gap: int = needle.DEFAULT_QUESTION_GAP
    seed: int = EVAL_SEED

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if not self.context_lengths or not self.budgets or not self.placements:
            raise ValueError("context_lengths, budgets and placements must not be empty")
        if any(not 0.0 < b < 1.0 for b in self.budgets):
            raise ValueError(f"budgets must be fractions in (0, 1), got {self.budgets}")
        unknown = sorted(set(self.policies) - set(POLICIES))
        if unknown or "full" not in self.policies:
            raise ValueError(f"policies must include full and come from {POLICIES}, got {unknown}")


PRESETS: dict[str, RecallEvalConfig] = {
    "smoke": RecallEvalConfig(context_lengths=(256,), budgets=(0.25,), prompts=2),
    "full": RecallEvalConfig(),
}


@dataclass(frozen=True)
class RequestResult:
    """One prompt decoded under one policy at one budget."""

    placement: str
    context_tokens: int
    budget: float
    policy: str
    depth: float
    answer: int  # greedy token after the cue
    correct: bool
    agrees_with_full: bool
    retained_rows: int  # over every (layer, owner)
    omitted_rows: int
    recalled_rows: int = 0
    recalled_bytes: int = 0
    recalls: int = 0
    fallbacks: int = 0
    fetch_s: tuple[float, ...] = ()  # one per recall
    step_s: tuple[float, ...] = ()  # wall time of every decode step, recall included

    @property
    def recalled_share(self) -> float:
        return self.recalled_rows / self.omitted_rows if self.omitted_rows else 0.0


@dataclass(frozen=True)
class CellSummary:
    """Aggregates over the requests of one (placement, context, budget, policy)."""

    placement: str
    context_tokens: int
    budget: float
    policy: str
    requests: int
    accuracy: float
    agreement: float
    retained_share: float
    recalled_rows: float  # per request
    recalled_bytes: float  # per request
    recalled_share: float  # mean over requests of recalled / omitted rows
    recalls: float  # per request
    fallbacks: int
    fetch_ms: float | None  # mean per recall
    decode_ms_per_token: float


@dataclass(frozen=True)
class GoalRow:
    """The goal check for one SnapKV variant (placement (b), 25% budget, all contexts)."""

    policy: str
    full_accuracy: float
    lossy_accuracy: float
    recall_accuracy: float
    recalled_share: float
    lossy_agreement: float
    recall_agreement: float

    @property
    def gap(self) -> float:
        return self.full_accuracy - self.lossy_accuracy

    @property
    def gap_closed(self) -> float | None:
        """Share of the accuracy gap recall closed; None when there is no gap."""
        return (self.recall_accuracy - self.lossy_accuracy) / self.gap if self.gap > 0 else None

    @property
    def disagreement_fixed(self) -> float | None:
        """Share of SnapKV's answers that differed from the full cache's and recall fixed."""
        missing = 1.0 - self.lossy_agreement
        return (self.recall_agreement - self.lossy_agreement) / missing if missing > 0 else None

    @property
    def met(self) -> bool | None:
        """Whether the goal is met; None when there is no accuracy gap to close (then only
        the recalled share can fail it)."""
        if self.recalled_share >= GOAL_RECALLED_SHARE:
            return False
        closed = self.gap_closed
        return None if closed is None else closed >= GOAL_GAP_CLOSED


@dataclass(frozen=True)
class Prefilled:
    """One prompt's context prefill, shared by every policy and budget."""

    prompt: needle.NeedlePrompt
    result: PrefillResult
    cue: tuple[int, ...]
    answer_id: int

    @property
    def context_tokens(self) -> int:
        return self.result.prompt_length


@dataclass
class _Decoded:
    answer: int
    step_s: list[float] = field(default_factory=list)
    recalled_rows: int = 0
    recalled_bytes: int = 0
    recalls: int = 0
    fallbacks: int = 0
    fetch_s: list[float] = field(default_factory=list)


class Evaluator:
    """Runs policies over prefilled prompts of one checkpoint (CPU, one process)."""

    def __init__(self, loaded: LoadedModel, config: RecallEvalConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.store = OffloadStore(OffloadStoreConfig(capacity_bytes=STORE_BYTES, lease_s=600.0))
        self._requests = itertools.count(1)
        self._manifests: dict[tuple[float, int], dict[str, KVVisibilityPolicyManifest]] = {}

    def prefill(self, prompt: needle.NeedlePrompt) -> Prefilled:
        """Prefill the prompt without its answer cue, capturing the observation window."""
        tokenizer = self.loaded.require_tokenizer()
        ids = tokenizer.encode(prompt.text)
        answer = tokenizer.token_id(prompt.answer)
        assert answer is not None, f"code {prompt.answer} is not a token"
        options = PrefillOptions(obs_window=self.config.observation_window)
        result = model_prefill(self.loaded.model, ids[:-CUE_TOKENS], options)
        return Prefilled(prompt, result, tuple(ids[-CUE_TOKENS:]), answer)

    def manifests(
        self, budget: float, context_tokens: int
    ) -> dict[str, KVVisibilityPolicyManifest]:
        """Every policy at `budget` (built once per budget and context length)."""
        key = (budget, context_tokens)
        if key not in self._manifests:
            self._manifests[key] = policy_manifests(
                self.loaded.tensor_contract, self.config, budget, context_tokens
            )
        return self._manifests[key]

    def run(
        self,
        prefilled: Prefilled,
        policy: str,
        manifest: KVVisibilityPolicyManifest,
        full_answer: int | None,
        budget: float,
    ) -> RequestResult:
        """Select, pack, admit and decode the cue under one policy."""
        T = prefilled.context_tokens
        request_id = f"eval-{next(self._requests)}"
        compressed = compress(manifest, prefilled.result, StateIdentity(request_id, 1))
        retained = compressed.view.total_rows
        total = manifest.tensor.num_layers * manifest.num_owners * T
        decoded = self._decode(prefilled, manifest, compressed)
        full = decoded.answer if full_answer is None else full_answer
        return RequestResult(
            placement=prefilled.prompt.placement.value,
            context_tokens=T,
            budget=budget,
            policy=policy,
            depth=prefilled.prompt.depth,
            answer=decoded.answer,
            correct=decoded.answer == prefilled.answer_id,
            agrees_with_full=decoded.answer == full,
            retained_rows=retained,
            omitted_rows=total - retained,
            recalled_rows=decoded.recalled_rows,
            recalled_bytes=decoded.recalled_bytes,
            recalls=decoded.recalls,
            fallbacks=decoded.fallbacks,
            fetch_s=tuple(decoded.fetch_s),
            step_s=tuple(decoded.step_s),
        )

    def _decode(
        self, prefilled: Prefilled, manifest: KVVisibilityPolicyManifest, compressed: Compressed
    ) -> _Decoded:
        request_id = compressed.state.request_id
        result, loaded = prefilled.result, self.loaded
        owner_map = manifest.expanded_owner_map
        cache = DecodeCache(
            loaded.config,
            loaded.dtype,
            loaded.device,
            batch_capacity=1,
            row_capacity=result.prompt_length + CUE_TOKENS + 1,
            owner_to_kv_head=owner_map,
        )
        cache.admit_view(request_id, compressed.view, frontier=result.prompt_length)
        session = None
        if manifest.recoverability.recallable:
            session = self._session(manifest, result, compressed.state)
        try:
            return self._cue_steps(cache, prefilled.cue, request_id, session)
        finally:
            self.store.release(request_id)

    def _session(
        self, manifest: KVVisibilityPolicyManifest, result: PrefillResult, state: KVPolicyState
    ) -> RecallSession:
        """Omitted rows into the store (the prefill worker's side) and the decode side's session."""
        plan = offload_plan(manifest, result.source_k, result.source_v, state.selected_positions)
        assert plan is not None, "a recallable manifest always pages its omitted rows"
        key = StoreKey(state.request_id, state.request_generation, state.state_generation)
        stored = self.store.put(key, plan.rows)
        if isinstance(stored, Refused):
            raise RuntimeError(f"offload store refused {state.request_id}: {stored.reason.value}")
        return RecallSession(manifest, plan.summaries, StoreFetcher(self.store, key), state=state)

    def _cue_steps(
        self, cache: DecodeCache, cue: Sequence[int], request_id: str, session: RecallSession | None
    ) -> _Decoded:
        model = self.loaded.model
        decoded = _Decoded(answer=-1)
        logits = torch.empty(0)
        for token in cue:
            started = time.perf_counter()
            if session is None:
                logits = decode_step(model, cache, [token])
            else:
                step = decode_with_recall(model, cache, [token], {request_id: session})
                logits = step.logits
                _count(decoded, step.outcomes[request_id])
            decoded.step_s.append(time.perf_counter() - started)
        decoded.answer = int(logits[0].argmax())
        return decoded


def _count(decoded: _Decoded, outcome: RecallOutcome) -> None:
    if outcome.status is RecallStatus.RECALLED:
        decoded.recalls += 1
        decoded.recalled_rows += outcome.rows
        decoded.recalled_bytes += outcome.nbytes
        decoded.fetch_s.append(outcome.latency_s)
    elif outcome.fell_back or outcome.status is RecallStatus.FAILED:
        decoded.fallbacks += 1


def policy_manifests(
    tensor: TensorContract, config: RecallEvalConfig, budget: float, context_tokens: int
) -> dict[str, KVVisibilityPolicyManifest]:
    """Every policy at `budget` of the context rows: SnapKV's capacity is
    ceil(budget * T) per owner, and the static windows keep as many rows."""
    rows = math.ceil(budget * context_tokens)
    window = config.observation_window

    def defaults(recent: int, sinks: int) -> dict[str, KVVisibilityPolicyManifest]:
        return default_manifests(
            tensor,
            budget_fraction=budget,
            observation_window=window,
            recent_window=recent,
            sinks=sinks,
        )

    out = defaults(rows - config.sinks, config.sinks)
    out["window"] = defaults(rows, config.sinks)["window"]
    for name in SNAPKV_POLICIES:
        out[f"{name}-recall"] = with_recall(out[name], config.knobs)
    return out


def eval_prompts(
    config: RecallEvalConfig, context_tokens: int, placement: needle.Placement, seed: int
) -> list[needle.NeedlePrompt]:
    """`config.prompts` prompts, depths evenly spread over [0, 1]; both placements share
    seeds, so they ask the same needles in the same haystacks."""
    count = config.prompts
    return [
        needle.build_prompt(
            context_tokens,
            depth=index / max(count - 1, 1),
            placement=placement,
            seed=seed + 10_000 * context_tokens + index,
            distractors=config.distractors,
            question_gap=config.question_gap,
        )
        for index in range(count)
    ]


def evaluate_prompt(evaluator: Evaluator, prompt: needle.NeedlePrompt) -> list[RequestResult]:
    """Every policy and budget of the evaluator's config on one prompt (one prefill)."""
    config = evaluator.config
    prefilled = evaluator.prefill(prompt)
    results: list[RequestResult] = []
    full: RequestResult | None = None
    for budget in config.budgets:
        manifests = evaluator.manifests(budget, prefilled.context_tokens)
        if full is None:
            full = evaluator.run(prefilled, "full", manifests["full"], None, budget)
        results.append(replace(full, budget=budget))  # the full cache is every budget's ceiling
        for policy in config.policies:
            if policy != "full":
                results.append(
                    evaluator.run(prefilled, policy, manifests[policy], full.answer, budget)
                )
    return results


def evaluate(evaluator: Evaluator, seed: int | None = None) -> list[RequestResult]:
    """All cells of the evaluator's config, with a progress bar over prompts."""
    config = evaluator.config
    cells = [(p, n) for p in config.placements for n in config.context_lengths]
    results: list[RequestResult] = []
    with tqdm(total=len(cells) * config.prompts, desc="eval recall", unit="prompt") as bar:
        for placement, tokens in cells:
            for prompt in eval_prompts(
                config, tokens, placement, config.seed if seed is None else seed
            ):
                results += evaluate_prompt(evaluator, prompt)
                bar.update()
    return results


def summarize(results: Iterable[RequestResult]) -> list[CellSummary]:
    """One summary per (placement, context, budget, policy), in first-seen order."""
    groups: dict[tuple[str, int, float, str], list[RequestResult]] = {}
    for r in results:
        groups.setdefault((r.placement, r.context_tokens, r.budget, r.policy), []).append(r)
    return [_cell(key, rows) for key, rows in groups.items()]


def _cell(key: tuple[str, int, float, str], rows: list[RequestResult]) -> CellSummary:
    placement, tokens, budget, policy = key
    fetches = [s for r in rows for s in r.fetch_s]
    steps = [s for r in rows for s in r.step_s]
    return CellSummary(
        placement=placement,
        context_tokens=tokens,
        budget=budget,
        policy=policy,
        requests=len(rows),
        accuracy=mean(r.correct for r in rows),
        agreement=mean(r.agrees_with_full for r in rows),
        retained_share=mean(r.retained_rows / (r.retained_rows + r.omitted_rows) for r in rows),
        recalled_rows=mean(r.recalled_rows for r in rows),
        recalled_bytes=mean(r.recalled_bytes for r in rows),
        recalled_share=mean(r.recalled_share for r in rows),
        recalls=mean(r.recalls for r in rows),
        fallbacks=sum(r.fallbacks for r in rows),
        fetch_ms=1000 * mean(fetches) if fetches else None,
        decode_ms_per_token=1000 * mean(steps),
    )


def goal_rows(results: Sequence[RequestResult]) -> list[GoalRow]:
    """The goal check per SnapKV variant: placement (b), 25% budget, contexts pooled."""
    cell = [r for r in results if r.placement == GOAL_PLACEMENT.value and r.budget == GOAL_BUDGET]

    def of(policy: str) -> list[RequestResult]:
        return [r for r in cell if r.policy == policy]

    rows = []
    for name in SNAPKV_POLICIES:
        lossy, recalled, full = of(name), of(f"{name}-recall"), of("full")
        if lossy and recalled and full:
            rows.append(
                GoalRow(
                    policy=name,
                    full_accuracy=mean(r.correct for r in full),
                    lossy_accuracy=mean(r.correct for r in lossy),
                    recall_accuracy=mean(r.correct for r in recalled),
                    recalled_share=mean(r.recalled_share for r in recalled),
                    lossy_agreement=mean(r.agrees_with_full for r in lossy),
                    recall_agreement=mean(r.agrees_with_full for r in recalled),
                )
            )
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def markdown_tables(cells: Sequence[CellSummary]) -> str:
    """One table per placement: a row per (context, budget, policy)."""
    header = (
        "| context | budget | policy | accuracy | agrees w/ full | recalled rows/req "
        "| recalled KiB/req | recalled % of omitted | recalls/req | fetch ms | decode ms/token "
        "| fallbacks |\n"
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    )
    out = []
    for placement in dict.fromkeys(c.placement for c in cells):
        lines = [
            f"| {c.context_tokens} | {c.budget:.0%} | {c.policy} | {_pct(c.accuracy)} "
            f"| {_pct(c.agreement)} | {c.recalled_rows:.1f} | {c.recalled_bytes / 1024:.1f} "
            f"| {_pct(c.recalled_share) if c.policy.endswith('-recall') else '-'} "
            f"| {c.recalls:.2f} | {'-' if c.fetch_ms is None else f'{c.fetch_ms:.3f}'} "
            f"| {c.decode_ms_per_token:.2f} | {c.fallbacks} |"
            for c in cells
            if c.placement == placement
        ]
        out.append(f"### placement `{placement}`\n\n{header}" + "\n".join(lines) + "\n")
    return "\n".join(out)


def goal_markdown(rows: Sequence[GoalRow]) -> str:
    """The goal check as a table plus one verdict line."""
    lines = [
        "| SnapKV variant | full | SnapKV | SnapKV + recall | gap closed | recalled % of omitted "
        "| answers differing from full fixed | goal met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        closed = "no gap" if row.gap_closed is None else _pct(row.gap_closed)
        lines.append(
            f"| {row.policy} | {_pct(row.full_accuracy)} | {_pct(row.lossy_accuracy)} "
            f"| {_pct(row.recall_accuracy)} | {closed} | {_pct(row.recalled_share)} "
            f"| {_pct(row.disagreement_fixed)} | {_verdict(row.met)} |"
        )
    verdict = (
        f"**Goal {_overall(rows)}**: placement `{GOAL_PLACEMENT.value}`, {GOAL_BUDGET:.0%} "
        f"budget: recall closes >= {GOAL_GAP_CLOSED:.0%} of the accuracy gap between SnapKV "
        f"and the full cache while recalling < {GOAL_RECALLED_SHARE:.0%} of the omitted rows."
    )
    return "\n".join(lines) + "\n\n" + verdict + "\n"


def _verdict(met: bool | None) -> str:
    return "undetermined (no gap)" if met is None else "yes" if met else "no"


def _overall(rows: Sequence[GoalRow]) -> str:
    """met: every variant has a gap and meets it; not met: one fails; else undetermined."""
    verdicts = [row.met for row in rows]
    if not verdicts:
        return "not evaluated (this run has no SnapKV variant with recall there)"
    if False in verdicts:
        return "not met"
    if None in verdicts:
        return "undetermined: a variant has no accuracy gap to close (full <= SnapKV)"
    return "met"


# A recall variant is drawn dashed in its SnapKV variant's colour.
_COLORS = {
    "full": "black",
    "window": "C0",
    "sink-recent": "C1",
    "snapkv": "C2",
    "snapkv-pyramid": "C3",
    "snapkv-adakv": "C4",
}
_MARKERS = ("o", "s", "^", "D")


def write_plot(cells: Sequence[CellSummary], path: Path) -> bool:
    """Accuracy vs budget per policy (a panel per placement and context) and the recalled
    share of omitted rows; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    placements = list(dict.fromkeys(c.placement for c in cells))
    contexts = sorted({c.context_tokens for c in cells})
    fig, axes = plt.subplots(
        len(placements),
        len(contexts) + 1,
        figsize=(4.2 * (len(contexts) + 1), 3.4 * len(placements) + 0.8),
        squeeze=False,
    )
    for row, placement in enumerate(placements):
        for col, tokens in enumerate(contexts):
            ax = axes[row][col]
            _plot_lines(ax, cells, placement, tokens, "accuracy", _MARKERS[0])
            ax.set_title(f"{placement}, {tokens} tokens: accuracy", fontsize=9)
            ax.set_ylim(-3, 103)
        share = axes[row][len(contexts)]
        for index, tokens in enumerate(contexts):
            marker = _MARKERS[index % len(_MARKERS)]
            _plot_lines(share, cells, placement, tokens, "recalled_share", marker)
        share.set_title(
            f"{placement}: recalled % of omitted rows ({'/'.join(_MARKERS[: len(contexts)])}"
            f" = {'/'.join(map(str, contexts))})",
            fontsize=9,
        )
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_lines(
    ax: Any, cells: Sequence[CellSummary], placement: str, tokens: int, metric: str, marker: str
) -> None:
    """One line per policy over the budgets (recall variants only for the recalled share)."""
    chosen = [c for c in cells if c.placement == placement and c.context_tokens == tokens]
    for policy in dict.fromkeys(c.policy for c in chosen):
        recall = policy.endswith("-recall")
        if metric == "recalled_share" and not recall:
            continue
        points = sorted((c.budget, getattr(c, metric)) for c in chosen if c.policy == policy)
        ax.plot(
            [100 * b for b, _ in points],
            [100 * v for _, v in points],
            "--" if recall else "-",
            marker=marker,
            color=_COLORS[policy.removesuffix("-recall")],
            label=policy,
        )
    ax.set_xlabel("budget (% of context rows)", fontsize=8)
    ax.set_ylabel("%", fontsize=8)
    ax.grid(alpha=0.3)


@dataclass(frozen=True)
class RecallReport:
    results: list[RequestResult]
    cells: list[CellSummary]
    goal: list[GoalRow]
    markdown: str
    png: Path | None


def run(
    checkpoint: Path,
    config: RecallEvalConfig,
    out_dir: Path,
    threads: int | None = None,
    console: Console | None = None,
) -> RecallReport:
    """Evaluate, print the tables and the goal check, write report.md, results.json, recall.png."""
    console = console or Console()
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(checkpoint)
    evaluator = Evaluator(loaded, config)
    started = time.perf_counter()
    results = evaluate(evaluator)
    elapsed = time.perf_counter() - started
    if evaluator.store.used_bytes != 0:
        raise RuntimeError(f"offload store still holds {evaluator.store.used_bytes} bytes")
    cells, goal = summarize(results), goal_rows(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "recall.png"
    wrote_png = write_plot(cells, png)
    text = _report(checkpoint, config, cells, goal, elapsed, wrote_png)
    (out_dir / "report.md").write_text(text)
    (out_dir / "results.json").write_text(
        json.dumps({"config": _plain(config), "results": [asdict(r) for r in results]}, indent=1)
    )
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    if not wrote_png:
        console.print("matplotlib is not installed: no PNG written (pip install matplotlib)")
    return RecallReport(results, cells, goal, text, png if wrote_png else None)


def _report(
    checkpoint: Path,
    config: RecallEvalConfig,
    cells: Sequence[CellSummary],
    goal: Sequence[GoalRow],
    elapsed: float,
    wrote_png: bool,
) -> str:
    knobs = config.knobs
    return (
        f"# Recall evaluation of `{checkpoint}`\n\n"
        f"{config.prompts} held-out needle prompts per (placement, context), depths evenly "
        f"spread, {config.distractors} distractor facts, question gap {config.question_gap} "
        f"tokens in `before_filler`; SnapKV observation window {config.observation_window}; "
        f"the answer cue is decoded on the compressed cache. Recall knobs: threshold "
        f"{knobs.threshold}, page size {knobs.page_size}, at most {knobs.max_pages_per_step} "
        f"pages per step, every {knobs.cadence_steps} step(s), timeout {knobs.timeout_ms} ms "
        f"({knobs.fallback.value}); rows fetched from an in-process offload store. "
        f"Wall time {elapsed:.0f} s, {torch.get_num_threads()} torch thread(s).\n\n"
        f"## Goal check\n\n{goal_markdown(goal)}\n## Results\n\n{markdown_tables(cells)}\n"
        + ("![recall](recall.png)\n" if wrote_png else "")
    )


def _plain(config: RecallEvalConfig) -> dict[str, object]:
    plain = asdict(config)
    plain["placements"] = [p.value for p in config.placements]
    plain["knobs"]["fallback"] = config.knobs.fallback.value
    return plain


# --- tuning ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TuneConfig:
    """The knob sweep: SnapKV uniform, placement (b), 25% budget, seeds `TUNE_SEED`."""

    context_tokens: int = 1024
    prompts: int = 32
    # Quest-style bounds are loose (the demo model's owners sit at log-odds 1 to 15), so
    # only thresholds close to 1 separate owners; page size x pages/step caps the rows.
    thresholds: tuple[float, ...] = (0.9, 0.99, 0.999, 0.9999)
    page_sizes: tuple[int, ...] = (8, 16, 32)
    max_pages: tuple[int, ...] = (8, 16, 32, 64)
    cadences: tuple[int, ...] = (1, 2)

    def grid(self) -> Iterator[RecallKnobs]:
        for threshold, page, pages, cadence in itertools.product(
            self.thresholds, self.page_sizes, self.max_pages, self.cadences
        ):
            yield RecallKnobs(threshold, page, pages, cadence)


@dataclass(frozen=True)
class TuneRow:
    knobs: RecallKnobs
    goal: GoalRow

    @property
    def rank_key(self) -> tuple[float, float, float]:
        closed = self.goal.gap_closed
        return (
            closed if closed is not None else 1.0,
            self.goal.recall_agreement,
            -self.goal.recalled_share,
        )


def tune(evaluator: Evaluator, config: TuneConfig) -> list[TuneRow]:
    """Every knob combination on the tuning prompts; best first (goal-eligible rows first:
    gap closed, then agreement with the full cache, then fewer recalled rows)."""
    knobs = list(config.grid())
    results: dict[RecallKnobs | str, list[RequestResult]] = {}
    prompts = eval_prompts(
        replace(evaluator.config, prompts=config.prompts),
        config.context_tokens,
        GOAL_PLACEMENT,
        TUNE_SEED,
    )
    for prompt in tqdm(prompts, desc="tune recall", unit="prompt"):
        prefilled = evaluator.prefill(prompt)
        manifests = evaluator.manifests(GOAL_BUDGET, prefilled.context_tokens)
        full = evaluator.run(prefilled, "full", manifests["full"], None, GOAL_BUDGET)
        results.setdefault("full", []).append(full)
        lossy = evaluator.run(prefilled, "snapkv", manifests["snapkv"], full.answer, GOAL_BUDGET)
        results.setdefault("snapkv", []).append(lossy)
        for knob in knobs:
            manifest = with_recall(manifests["snapkv"], knob)
            results.setdefault(knob, []).append(
                evaluator.run(prefilled, "snapkv-recall", manifest, full.answer, GOAL_BUDGET)
            )
    rows = [
        TuneRow(k, goal_rows(results["full"] + results["snapkv"] + results[k])[0]) for k in knobs
    ]
    return sorted(
        rows, key=lambda r: (r.goal.recalled_share < GOAL_RECALLED_SHARE, r.rank_key), reverse=True
    )


def run_tune(
    checkpoint: Path,
    config: TuneConfig,
    threads: int | None = None,
    console: Console | None = None,
    top: int = 15,
) -> list[TuneRow]:
    """Sweep, print the best `top` knob combinations as Markdown, and the choice."""
    console = console or Console()
    if threads is not None:
        torch.set_num_threads(threads)
    evaluator = Evaluator(load_model(checkpoint), RecallEvalConfig())
    rows = tune(evaluator, config)
    lines = [
        f"knob sweep: {config.prompts} tuning prompts (seeds from {TUNE_SEED}), "
        f"{config.context_tokens} tokens, placement {GOAL_PLACEMENT.value}, "
        f"{GOAL_BUDGET:.0%} budget, snapkv uniform",
        "| threshold | page size | pages/step | cadence | accuracy | gap closed "
        "| agrees w/ full | recalled % of omitted |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows[:top]:
        k, g = row.knobs, row.goal
        closed = "no gap" if g.gap_closed is None else _pct(g.gap_closed)
        lines.append(
            f"| {k.threshold} | {k.page_size} | {k.max_pages_per_step} | {k.cadence_steps} "
            f"| {_pct(g.recall_accuracy)} | {closed} | {_pct(g.recall_agreement)} "
            f"| {_pct(g.recalled_share)} |"
        )
    if rows:
        g = rows[0].goal
        lines.append(
            f"baselines: full {_pct(g.full_accuracy)}, snapkv {_pct(g.lossy_accuracy)} "
            f"(agrees with full {_pct(g.lossy_agreement)}); best: {rows[0].knobs}"
        )
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)
    return rows
