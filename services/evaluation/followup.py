"""`kvrelay eval followup`: a second question about the same compressed context, without
prefilling the context again (issue 19, "Beyond").

A document read once and asked many times is where question-agnostic compression pays: the
context is compressed before any question it will be asked is known. On the RULER-style
multi-key prompts (four needles with different keys; `services.evaluation.ruler`) in the
question-agnostic placement, per prompt and policy, one request goes through two turns:

1. Turn one, as `kvrelay eval recall --suite ruler` runs it: the prefix is prefilled and
   compressed, the cue is decoded over the compressed cache, the answer greedily after it.
2. The follow-up: the end of the assistant's turn, a new user turn asking for the number of
   another of the four keys (a needle turn one did not ask for), the generation prompt and
   the answer prefix are fed through the same decode steps, one token a step (teacher-forced;
   each is appended to the cache and reads it with recall on), and the second answer is
   decoded greedily after them. Nothing is prefilled again: the context's rows are the ones
   the compressed cache kept, and whatever recall brings back.

Policies on the same prefill: the full cache (the ceiling), SnapKV with the omitted rows
irrecoverable, and SnapKV with each recall variant (the served knobs and strategies of the
recall suite, chosen on prompts from `TUNE_SEED`; the prompts here are from `REPORT_SEED`).
Per row: both answers and scores, the follow-up's recalls and recalled rows, the wall time of
its fed tokens and of its answer steps. Per prompt, the time a prefill of the whole
conversation up to the follow-up's cue takes on the full cache: what a server without the
kept context would spend before the follow-up's first token.

Limits: the follow-up's tokens are fed one a decode step (the runtime's decode step takes
one token a request); a chunked append of several tokens over a paged cache would take
fewer, larger steps. One request a batch: the turns of a batch's requests end at different
steps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from statistics import mean

import torch
from rich.console import Console
from tqdm import tqdm

from services.evaluation import ruler
from services.evaluation.generation import forward_for
from services.evaluation.recall_ruler import (
    CODES,
    GREEDY,
    TASKS,
    VALUES,
    RecallRulerConfig,
    RecallRulerRunner,
    RecallVariant,
    SuiteRequest,
    recall_rows,
)
from services.evaluation.ruler_suite import REPORT_SEED, TUNE_SEED
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.model import DecodeCache, LoadedModel, finish_reason, load, sample
from services.model.tokenizer import ChatMessage, TextTokenizer
from services.offload.recall import RecallStatus

MULTIKEY = TASKS[1]  # (niah_multikey, noise)


@dataclass(frozen=True)
class FollowUpConfig:
    """What to run: `prompts` multi-key prompts of `length` tokens, budgets, recall variants."""

    length: int = 4096
    prompts: int = 4
    budgets: tuple[float, ...] = (0.10, 0.25)
    variants: tuple[RecallVariant, ...] = (CODES, VALUES)
    seed: int = REPORT_SEED
    filler_tokens: int = ruler.DEFAULT_FILLER_TOKENS

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ValueError(f"prompts: must be >= 1, got {self.prompts}")

    def suite(self) -> RecallRulerConfig:
        """The recall suite's config of the same prompts (its specs, manifests, requests)."""
        return RecallRulerConfig(lengths=(self.length,), prompts=self.prompts,
                                 budgets=self.budgets, tasks=(MULTIKEY,), variants=self.variants,
                                 presses=(), batch=1, seed=self.seed,
                                 filler_tokens=self.filler_tokens)


@dataclass(frozen=True)
class FollowUp:
    """The follow-up turn of one conversation: the key it asks, the answer it expects, and the
    tokens fed before its answer (the last one is the follow-up's cue)."""

    key: str
    answer: str
    fed: tuple[int, ...]


def follow_up_turn(tokenizer: TextTokenizer, prompt: ruler.RulerPrompt, first: Sequence[int],
                   stop_ids: frozenset[int]) -> FollowUp:
    """The follow-up of `prompt` after turn one's generated tokens `first` (its stop token,
    if it ended on one, last): ask for the first needle turn one did not ask for. The tokens
    to feed are turn one's last token unless it was a stop token (a sampled token is fed by
    the next step, and turn one ended before one), then the chat template's end of the
    assistant turn, the new user turn, the generation prompt and the answer prefix."""
    others = [n for n in prompt.needles if not n.answer]
    if not others:
        raise ValueError(f"prompt {prompt.spec.seed}: no needle besides the asked one "
                         "(a follow-up needs a multi-key prompt)")
    needle = others[0]
    answered = [t for t in first if t not in stop_ids]
    text = tokenizer.decode(answered, skip_special_tokens=True)
    question = ruler.NIAH_QUESTION.format(key=needle.key)
    prefix = ruler.NIAH_ANSWER_PREFIX
    if tokenizer.chat_template is None:
        suffix = f"\n\n{question}\n\n{prefix}"
    else:
        # The template's text between turn one's answer and the follow-up's answer prefix,
        # from a short conversation of the same turns (a later turn's rendering does not
        # depend on an earlier turn's content in the templates this runtime serves; checked).
        asked = tokenizer.render_chat([ChatMessage("user", "U")]) + prefix
        both = tokenizer.render_chat([ChatMessage("user", "U"),
                                      ChatMessage("assistant", prefix + text),
                                      ChatMessage("user", question)]) + prefix
        if not both.startswith(asked + text):
            raise ValueError("the chat template renders turn one differently once a turn "
                             "follows it; a follow-up cannot reuse the turn's cached rows")
        suffix = both[len(asked + text):]
    tail = [] if not first or first[-1] in stop_ids else [first[-1]]
    fed = tuple(tail + tokenizer.encode(suffix, add_special_tokens=False))
    return FollowUp(needle.key, needle.value, fed)


@dataclass(frozen=True)
class FollowUpRow:
    """One prompt under one policy: both turns."""

    policy: str
    budget: float | None
    length: int
    index: int
    seed: int
    first_output: str
    first_score: float
    key: str
    followup_output: str
    followup_score: float
    omitted_rows: int = 0
    recalls: int = 0  # during the follow-up (fed tokens and answer)
    recalled_rows: int = 0
    recalled_bytes: int = 0
    fed_tokens: int = 0
    fed_s: float = 0.0  # wall time of the fed tokens' steps
    answer_step_s: tuple[float, ...] = ()  # the follow-up's answer steps
    reprefill_s: float = 0.0  # the prompt's full prefill of the conversation (same for a prompt)
    followup_first_token: int = -1  # the follow-up answer's first token
    reprefill_first_token: int = -1  # the one that prefill samples (greedy; same for a prompt)


@dataclass
class _Turn:
    tokens: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)


class FollowUpRunner:
    """Both turns of one request at a time, over the recall suite's requests (`RecallRulerRunner`:
    the same compression, offload store and recall sessions)."""

    def __init__(self, runner: RecallRulerRunner) -> None:
        self.runner = runner
        self.stop_ids = frozenset(runner.stop_ids)

    @torch.no_grad()
    def converse(self, key: tuple[str, float | None], manifest: KVVisibilityPolicyManifest,
                 prompt: ruler.RulerPrompt, index: int, shared: object
                 ) -> tuple[FollowUpRow, tuple[int, ...]]:
        """Both turns of one request under one policy; the row and the conversation's ids up to
        the follow-up's cue (for the re-prefill timing)."""
        runner = self.runner
        request = runner.request(key, manifest, prompt, index, shared)
        loaded = runner.loaded
        view = request.compressed.view
        limit = prompt.max_new_tokens
        rows = int(view.row_offsets.diff(dim=1).max())
        extra = 64 + 2 * limit  # the follow-up's fed tokens and both answers
        # Room for a few recalls' rows per owner (a private pool grown mid-turn copies pages).
        cache = DecodeCache(loaded.config, loaded.dtype, loaded.device, batch_capacity=1,
                            row_capacity=rows + extra + 4 * recall_rows(request))
        cache.admit_view(request.rid, view, frontier=request.compressed.forward.prompt_len)
        by_id = {request.rid: request}
        try:
            logits = runner.step(cache, [prompt.cue[-1]], by_id)
            first = self._answer(cache, by_id, logits, limit)
            turn = follow_up_turn(runner.tokenizer, prompt, first.tokens, self.stop_ids)
            before = len(request.outcomes)
            started = time.perf_counter()
            for token in turn.fed:
                logits = runner.step(cache, [token], by_id)
            fed_s = time.perf_counter() - started
            second = self._answer(cache, by_id, logits, limit)
            later = [o for o in request.outcomes[before:] if o.status is RecallStatus.RECALLED]
        finally:
            runner.store.release(request.rid)
        tokenizer = runner.tokenizer
        first_text = tokenizer.decode(first.tokens, skip_special_tokens=True)
        second_text = tokenizer.decode(second.tokens, skip_special_tokens=True)
        row = FollowUpRow(
            policy=key[0], budget=key[1], length=prompt.spec.length, index=index,
            seed=prompt.spec.seed, first_output=first_text,
            first_score=ruler.string_match_all(first_text, prompt.answers), key=turn.key,
            followup_output=second_text,
            followup_score=ruler.string_match_all(second_text, [turn.answer]),
            omitted_rows=request.compressed.ledger.omitted_rows, recalls=len(later),
            recalled_rows=sum(o.rows for o in later), recalled_bytes=sum(o.nbytes for o in later),
            fed_tokens=len(turn.fed), fed_s=fed_s, answer_step_s=tuple(second.step_s),
            followup_first_token=second.tokens[0],
        )
        # Turn one's tokens but its last were fed by its steps; the follow-up feeds the rest.
        return row, (*prompt.ids, *first.tokens[:-1], *turn.fed)

    def _answer(self, cache: DecodeCache, by_id: dict[str, SuiteRequest], logits: torch.Tensor,
                limit: int) -> _Turn:
        """Greedy tokens from `logits` until a stop token or `limit`; the last one is not fed."""
        turn = _Turn()
        while True:
            token = int(sample(logits, [GREEDY], [len(turn.tokens)])[0])
            turn.tokens.append(token)
            if finish_reason(token, len(turn.tokens), limit, GREEDY, self.runner.stop_ids) is not None:
                return turn
            started = time.perf_counter()
            logits = self.runner.step(cache, [token], by_id)
            turn.step_s.append(time.perf_counter() - started)


@dataclass(frozen=True)
class FollowUpReport:
    rows: list[FollowUpRow]
    text: str


def run(checkpoint: Path, config: FollowUpConfig, out_dir: Path, threads: int | None = 1,
        console: Console | None = None) -> FollowUpReport:
    """Every policy on every prompt, both turns; report.md, rows.jsonl and followup.png in
    `out_dir`."""
    console = console or Console()
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    loaded = load(checkpoint)
    suite = config.suite()
    runner = RecallRulerRunner(loaded, suite)
    talker = FollowUpRunner(runner)
    tokenizer = loaded.require_tokenizer()
    prompts = [ruler.build_prompt(tokenizer, s) for s in suite.specs(MULTIKEY, config.length)]
    manifests = runner.manifests(config.length)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[FollowUpRow] = []
    with (out_dir / "rows.jsonl").open("w") as sink:
        for index, prompt in enumerate(tqdm(prompts, desc="eval followup", unit="prompt")):
            shared = forward_for(loaded, manifests["snapkv", config.budgets[0]],
                                 list(prompt.prefix), chunk_size=512)
            new: list[FollowUpRow] = []
            conversation: tuple[int, ...] = ()
            for key, manifest in manifests.items():
                row, ids = talker.converse(key, manifest, prompt, index, shared)
                new.append(row)
                if key[0] == "full":
                    conversation = ids
            reprefill, token = _reprefill(loaded, manifests["full", None], conversation)
            for row in new:
                row = replace(row, reprefill_s=reprefill, reprefill_first_token=token)
                sink.write(json.dumps(asdict(row)) + "\n")
                rows.append(row)
            sink.flush()
    if runner.store.used_bytes != 0:
        raise RuntimeError(f"offload store still holds {runner.store.used_bytes} bytes")
    text = render(checkpoint, config, rows, time.perf_counter() - started)
    write_plot(config, rows, out_dir / "followup.png")
    (out_dir / "report.md").write_text(text + "\n![follow-up accuracy per policy](followup.png)\n")
    console.print(text, markup=False, highlight=False, soft_wrap=True)
    return FollowUpReport(rows, text)


def _reprefill(loaded: LoadedModel, manifest: KVVisibilityPolicyManifest,
               ids: Sequence[int]) -> tuple[float, int]:
    """Wall time of one chunked prefill of `ids` on the full cache (a server that keeps no
    context prefills the conversation again before the follow-up's first token), and the
    token it samples greedily: the full cache's follow-up, fed over the kept cache, must begin
    with it."""
    started = time.perf_counter()
    forward = forward_for(loaded, manifest, list(ids), chunk_size=512)
    return time.perf_counter() - started, forward.first_token


@dataclass(frozen=True)
class Cell:
    """One policy at one budget over the prompts."""

    policy: str
    budget: float | None
    prompts: int
    first: float  # mean turn-one score
    followup: float  # mean follow-up score
    agrees: float  # share of prompts whose follow-up names the full cache's number
    recalled_share: float  # follow-up recalled rows / omitted rows (0 without recall)
    recalled_kib: float  # per request
    fed_tokens: float
    fed_ms: float  # the fed tokens' steps, per request
    answer_ms: float  # per follow-up answer step
    reprefill_ms: float  # the conversation's full prefill, per prompt


def summarize(rows: Sequence[FollowUpRow]) -> list[Cell]:
    groups: dict[tuple[str, float | None], list[FollowUpRow]] = {}
    full = {r.index: ruler.answer_number(r.followup_output) for r in rows if r.policy == "full"}
    for row in rows:
        groups.setdefault((row.policy, row.budget), []).append(row)
    cells = []
    for (policy, budget), group in groups.items():
        omitted = sum(r.omitted_rows for r in group)
        steps = [s for r in group for s in r.answer_step_s]
        cells.append(Cell(
            policy, budget, len(group), mean(r.first_score for r in group),
            mean(r.followup_score for r in group),
            mean(ruler.answer_number(r.followup_output) == full.get(r.index) != "" for r in group),
            sum(r.recalled_rows for r in group) / omitted if omitted else 0.0,
            mean(r.recalled_bytes for r in group) / 1024, mean(r.fed_tokens for r in group),
            1000 * mean(r.fed_s for r in group), 1000 * mean(steps) if steps else 0.0,
            1000 * mean(r.reprefill_s for r in group)))
    return cells


def gap_closed(cells: Sequence[Cell], policy: str, budget: float) -> float | None:
    """Share of the follow-up's gap between irrecoverable SnapKV and the full cache that
    `policy` closes at `budget` (None: no gap)."""
    by_key = {(c.policy, c.budget): c for c in cells}
    full, lossy, ours = by_key.get(("full", None)), by_key.get(("snapkv", budget)), \
        by_key.get((policy, budget))
    if full is None or lossy is None or ours is None or full.followup <= lossy.followup:
        return None
    return (ours.followup - lossy.followup) / (full.followup - lossy.followup)


def render(checkpoint: Path, config: FollowUpConfig, rows: Sequence[FollowUpRow],
           seconds: float) -> str:
    """The Markdown report of a run's rows."""
    cells = summarize(rows)
    seeds = (f"Tuning prompts (seed {TUNE_SEED})." if config.seed == TUNE_SEED else
             f"Prompts from seed {config.seed} (reported); the recall knobs and strategies are "
             f"the recall suite's, chosen on prompts from seed {TUNE_SEED} (disjoint).")
    lines = [
        f"# Follow-up turns over a compressed context: `{checkpoint.name}`",
        "",
        f"`kvrelay eval followup`: {config.prompts} multi-key prompts of {config.length} tokens "
        "(four needles with different keys, the question followed by filler so SnapKV's window "
        "never sees it). Turn one asks one key; the follow-up asks another needle's key in a "
        "new user turn, fed through decode steps over the same cache (no second prefill), with "
        f"recall on. {seeds} Wall time {seconds:.0f} s, one torch thread, batch 1.",
        "",
        "| policy | budget | turn one | follow-up | gap closed | names the full cache's number "
        "| recalled % of omitted "
        "| recalled KiB | fed tokens | fed ms | answer ms/step | full re-prefill ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in cells:
        closed = None if c.budget is None or c.policy in ("full", "snapkv") else \
            gap_closed(cells, c.policy, c.budget)
        lines.append(
            f"| {c.policy} | {'-' if c.budget is None else f'{c.budget:.0%}'} "
            f"| {c.first:.0%} | {c.followup:.0%} "
            f"| {'-' if closed is None else f'{closed:.0%}'} | {c.agrees:.0%} "
            f"| {c.recalled_share:.2%} "
            f"| {c.recalled_kib:.0f} | {c.fed_tokens:.0f} | {c.fed_ms:.0f} | {c.answer_ms:.1f} "
            f"| {c.reprefill_ms:.0f} |")
    full = [r for r in rows if r.policy == "full"]
    agree = sum(r.followup_first_token == r.reprefill_first_token for r in full)
    lines += [
        "",
        f"The full cache's follow-up, fed over the cache turn one left, begins with the token a "
        f"prefill of the whole conversation samples in {agree} of {len(full)} prompts.",
        "",
        "Turn one and the follow-up are scored by RULER's string match (the share of expected "
        "values in the output). *Gap closed*: of the follow-up's gap between irrecoverable "
        "SnapKV and the full cache. *Names the full cache's number*: the follow-up's first "
        "number is the full cache's follow-up's, right or wrong (where the full cache itself "
        "often names another key's number, this says whether the compressed cache still reads "
        "the context as the full one does). *Fed ms*: the follow-up's tokens fed one a decode step "
        "(the end of the assistant's turn, the new user turn, the generation prompt and the "
        "answer prefix); *full re-prefill ms*: one chunked prefill of the whole conversation up "
        "to the follow-up's cue on the full cache, what a server that keeps no context spends "
        "before the follow-up's first token.",
        "",
        "Per prompt (follow-up output):",
        "",
        "| prompt | key | " + " | ".join(_label(c) for c in cells) + " |",
        "| ---: | --- | " + " | ".join("---" for _ in cells) + " |",
    ]
    for index in sorted({r.index for r in rows}):
        mine = {(r.policy, r.budget): r for r in rows if r.index == index}
        key = next(iter(mine.values())).key
        lines.append(f"| {index} | {key} | " + " | ".join(
            _cell_text(mine.get((c.policy, c.budget))) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _label(cell: Cell) -> str:
    return cell.policy if cell.budget is None else f"{cell.policy} {cell.budget:.0%}"


def _cell_text(row: FollowUpRow | None) -> str:
    if row is None:
        return "-"
    text = row.followup_output.strip().replace("|", "/").replace("\n", " ")[:24]
    return f"{'✓' if row.followup_score == 1.0 else '✗'} `{text}`"


def write_plot(config: FollowUpConfig, rows: Sequence[FollowUpRow], path: Path) -> Path:
    """Turn-one and follow-up accuracy, and agreement with the full cache's follow-up, per
    policy and budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = summarize(rows)
    labels = [_label(c) for c in cells]
    figure, axes = plt.subplots(figsize=(max(6, 1.1 * len(cells)), 4))
    positions = range(len(cells))
    axes.bar([p - 0.27 for p in positions], [c.first for c in cells], 0.27, label="turn one")
    axes.bar(list(positions), [c.followup for c in cells], 0.27, label="follow-up")
    axes.bar([p + 0.27 for p in positions], [c.agrees for c in cells], 0.27,
             label="follow-up names the full cache's number")
    axes.set_xticks(list(positions))
    axes.set_xticklabels(labels, rotation=30, ha="right", fontsize="small")
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("share of prompts")
    axes.set_title(f"follow-up turns, multi-key {config.length} tokens, {config.prompts} prompts")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def load_rows(path: Path) -> list[FollowUpRow]:
    """The rows a run wrote (`rows.jsonl`)."""
    rows = []
    for line in path.read_text().splitlines():
        data = json.loads(line)
        data["answer_step_s"] = tuple(data["answer_step_s"])
        rows.append(FollowUpRow(**data))
    return rows
