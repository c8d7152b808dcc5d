"""`kvrelay calibrate`: HeadKV retrieval-head scores of a checkpoint, written beside it.

Retrieval score (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
Factuality"; the importance HeadKV, Fu et al. 2024, allocates by): while the model answers a
needle question, a head *retrieves* at an answer token when its top attention (argmax over the
context) lands on the needle token being copied. A head's score is the share of answer tokens
at which it retrieves.

In the needle language (`services.demo.needle`) the answer is one code token, predicted by the
query at the cue `:` that closes the prompt, and the token being copied is the code inside the
target fact (`the code of <name> is <code> .`). One full-cache prefill with an observation
window of 1 captures exactly that query's attention `[L, H_q, 1, T]`, so every prompt costs one
forward. The answer is teacher-forced (the cue query is the same whatever the model would
generate), so an undertrained checkpoint still gets scores; the share of prompts the model
answers itself is recorded as `answer_accuracy`.

RULER calibration (checkpoints with a real text tokenizer, e.g. SmolLM2): RULER-style
needle prompts (`services.evaluation.ruler`, single and multi-key needles, both haystacks,
question-aware and question-agnostic placements) on seeds disjoint from the suite's. The
answer (the asked needle's digits, after the prompt's answer prefix) is teacher-forced: one
prefill of prompt + answer with an observation window over the answer's queries captures,
for every answer digit, where each head's top attention lands; a hit is the needle's copy
of that digit. `kvrelay calibrate` picks the method by the checkpoint's tokenizer (`auto`).

Owners: the score of a K/V head is the mean over the query heads that read it (the manifest's
`q_to_kv_head_map`), i.e. the share of (query head, answer token) pairs of its group that retrieve.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from services.demo import needle
from services.evaluation import ruler
from services.kvpolicy.head_profile import (
    HeadProfile,
    ProfileProvenance,
    checkpoint_sha256,
    save_profile,
)
from services.kvpolicy.manifest import GQAReduction
from services.kvpolicy.snapkv import reduce_gqa
from services.model import (
    InvalidModelInput,
    LoadedModel,
    PrefillOptions,
    PrefillResult,
    load,
    prefill,
)
from services.model.tokenizer import TextTokenizer

METHOD = "retrieval-top1"
RULER_METHOD = "retrieval-top1-ruler"
RULER_CALIBRATION_SEED = 30_000_000  # away from the suite's tuning and report seeds
RULER_VARIANTS = (
    (ruler.Task.NIAH_SINGLE, ruler.Haystack.NOISE),
    (ruler.Task.NIAH_SINGLE, ruler.Haystack.PROSE),
    (ruler.Task.NIAH_MULTIKEY, ruler.Haystack.PROSE),
)
CODE_OFFSET = 5  # index of <code> in the fact `the code of <name> is <code> .`
CALIBRATION_SEED = 9_000_000  # away from training documents and `kvrelay eval` prompts


@dataclass(frozen=True)
class CalibrationConfig:
    """Which needle prompts calibrate: `prompts` per (context length, placement), the needle
    depth spread evenly over the haystack."""

    context_lengths: tuple[int, ...] = (512, 1024, 2048)
    prompts: int = 16
    placements: tuple[needle.Placement, ...] = tuple(needle.Placement)
    distractors: int = 3
    question_gap: int = needle.DEFAULT_QUESTION_GAP
    seed: int = CALIBRATION_SEED
    chunk_size: int = 512

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ValueError(f"prompts: must be >= 1, got {self.prompts}")
        if not self.context_lengths or not self.placements:
            raise ValueError("context_lengths and placements must not be empty")

    @property
    def total_prompts(self) -> int:
        return self.prompts * len(self.context_lengths) * len(self.placements)


@dataclass(frozen=True)
class PromptHits:
    """One calibration prompt: which query heads' top attention hit the code, and whether the
    full-cache model itself answered with the code."""

    hits: torch.Tensor  # [L, H_q] bool
    answered: bool


def calibration_prompts(config: CalibrationConfig) -> list[needle.NeedlePrompt]:
    """Deterministic prompts for `config.seed`, in (length, placement, depth) order."""
    count = config.prompts
    return [
        needle.build_prompt(
            length,
            depth=index / max(count - 1, 1),
            placement=placement,
            seed=config.seed + 10_000 * length + 1_000 * p + index,
            distractors=config.distractors,
            question_gap=config.question_gap,
        )
        for length in config.context_lengths
        for p, placement in enumerate(config.placements)
        for index in range(count)
    ]


def prompt_hits(
    loaded: LoadedModel, prompt: needle.NeedlePrompt, chunk_size: int = 512
) -> PromptHits:
    """Full-cache prefill of one prompt; the cue query's argmax per (layer, query head)."""
    tokenizer = loaded.require_tokenizer()
    ids = tokenizer.encode(prompt.text)
    position = prompt.needle_start + CODE_OFFSET
    code_id = tokenizer.token_id(prompt.answer)
    if len(ids) != len(prompt.words) or code_id is None or ids[position] != code_id:
        raise InvalidModelInput(
            "tokenizer", "the checkpoint's tokenizer does not speak the needle language"
        )
    result = prefill(loaded.model, ids, PrefillOptions(chunk_size=chunk_size, obs_window=1))
    top = _observation(result)[:, :, -1, :].argmax(dim=-1)  # [L, H_q]
    return PromptHits(top == position, int(result.logits.argmax()) == code_id)


def owner_scores(query_scores: torch.Tensor, q_to_kv_head_map: tuple[int, ...]) -> torch.Tensor:
    """Per-query-head scores `[L, H_q]` -> per-K/V-head scores `[L, H_kv]` (group mean)."""
    return reduce_gqa(query_scores[..., None], q_to_kv_head_map, GQAReduction.MEAN)[..., 0]


def calibrate(
    loaded: LoadedModel,
    config: CalibrationConfig,
    checkpoint_digest: str,
    advance: Callable[[], None] | None = None,
) -> HeadProfile:
    """Retrieval scores of every head over `config`'s needle-language prompts; `advance`
    ticks once per prompt."""
    prompts = calibration_prompts(config)
    hits = [functools.partial(prompt_hits, loaded, p, config.chunk_size) for p in prompts]
    provenance = ProfileProvenance(
        method=METHOD, prompts=len(prompts), seed=config.seed,
        context_lengths=config.context_lengths,
        placements=tuple(p.value for p in config.placements), distractors=config.distractors,
        checkpoint_sha256=checkpoint_digest, answer_accuracy=0.0,
    )
    return _profile(loaded, hits, provenance, advance)


@dataclass(frozen=True)
class RulerCalibrationConfig:
    """RULER calibration: `prompts` per (length, task variant, placement), depths spread."""

    context_lengths: tuple[int, ...] = (1024, 2048)
    prompts: int = 6
    variants: tuple[tuple[ruler.Task, ruler.Haystack], ...] = RULER_VARIANTS
    placements: tuple[ruler.Placement, ...] = (ruler.Placement.END, ruler.Placement.BEFORE_FILLER)
    seed: int = RULER_CALIBRATION_SEED
    chunk_size: int = 512

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ValueError(f"prompts: must be >= 1, got {self.prompts}")
        if not self.context_lengths or not self.placements or not self.variants:
            raise ValueError("context_lengths, variants and placements must not be empty")
        if any(task not in _SINGLE_ANSWER for task, _ in self.variants):
            raise ValueError("variants: calibration copies one needle value (niah single/multikey)")

    @property
    def total_prompts(self) -> int:
        return (self.prompts * len(self.context_lengths) * len(self.variants)
                * len(self.placements))


_SINGLE_ANSWER = (ruler.Task.NIAH_SINGLE, ruler.Task.NIAH_MULTIKEY)


def ruler_calibration_prompts(
    tokenizer: TextTokenizer, config: RulerCalibrationConfig
) -> list[ruler.RulerPrompt]:
    """Deterministic RULER prompts for `config.seed`, in (length, variant, placement, index)
    order; the depth of prompt i of n is (i + 0.5) / n."""
    count = config.prompts
    return [
        ruler.build_prompt(tokenizer, ruler.PromptSpec(
            task, haystack, placement, length, depth=(index + 0.5) / count,
            seed=config.seed + 100_000 * v + 10 * length + index,
        ))
        for length in config.context_lengths
        for v, (task, haystack) in enumerate(config.variants)
        for placement in config.placements
        for index in range(count)
    ]


def ruler_prompt_hits(
    loaded: LoadedModel, prompt: ruler.RulerPrompt, chunk_size: int = 512
) -> PromptHits:
    """Prefill prompt + teacher-forced answer (the token before the value, then its digits);
    per answer digit, whether each query head's top attention lands on the needle's digit."""
    (start, stop), = [s for s, n in zip(prompt.value_spans, prompt.needles, strict=True)
                      if n.answer]
    forced = prompt.ids[start - 1 : stop]  # the separator token, then the value's tokens
    ids = [*prompt.ids, *forced[:-1]]
    options = PrefillOptions(chunk_size=chunk_size, obs_window=len(forced))
    result = prefill(loaded.model, ids, options)
    top = _observation(result).argmax(dim=-1)  # [L, H_q, W]: W = queries predicting `forced`
    targets = torch.arange(start, stop)  # [n] needle position of each value token
    hits = (top[:, :, 1:] == targets).float().mean(dim=-1)  # [L, H_q] share of value tokens
    return PromptHits(hits, int(result.logits.argmax()) == forced[-1])


def calibrate_ruler(
    loaded: LoadedModel,
    config: RulerCalibrationConfig,
    checkpoint_digest: str,
    advance: Callable[[], None] | None = None,
) -> HeadProfile:
    """Retrieval scores of every head over `config`'s RULER prompts."""
    prompts = ruler_calibration_prompts(loaded.require_tokenizer(), config)
    hits = [functools.partial(ruler_prompt_hits, loaded, p, config.chunk_size) for p in prompts]
    provenance = ProfileProvenance(
        method=RULER_METHOD, prompts=len(prompts), seed=config.seed,
        context_lengths=config.context_lengths,
        placements=tuple(p.value for p in config.placements),
        distractors=ruler.MULTIKEY_NEEDLES - 1, checkpoint_sha256=checkpoint_digest,
        answer_accuracy=0.0,
    )
    return _profile(loaded, hits, provenance, advance)


def _profile(
    loaded: LoadedModel,
    measure: Sequence[Callable[[], PromptHits]],
    provenance: ProfileProvenance,
    advance: Callable[[], None] | None,
) -> HeadProfile:
    """Mean hits over the prompts -> the profile (query heads, and K/V heads by group mean)."""
    shape = (loaded.config.num_layers, loaded.config.num_q_heads)
    hits = torch.zeros(shape, dtype=torch.float64)  # [L, H_q]
    answered = 0
    for one in measure:
        result = one()
        hits += result.hits
        answered += result.answered
        if advance is not None:
            advance()
    query_head = (hits / len(measure)).to(torch.float32)  # [L, H_q]
    kv_head = owner_scores(query_head, loaded.config.q_to_kv_head_map)
    provenance = replace(provenance, answer_accuracy=answered / len(measure))
    return HeadProfile(kv_head.contiguous(), query_head.contiguous(), provenance)


def speaks_needle_language(tokenizer: TextTokenizer) -> bool:
    """Whether the tokenizer is the demo checkpoint's needle language (one token per word)."""
    fact = needle.build_prompt(64, 0.5, needle.Placement.END, seed=0).text
    ids = tokenizer.encode(fact, add_special_tokens=False)
    return len(ids) == len(fact.split()) and tokenizer.token_id(needle.CODES[0]) is not None


def run(
    checkpoint: Path,
    config: CalibrationConfig | RulerCalibrationConfig | None = None,
    threads: int | None = None,
    out: Path | None = None,
) -> HeadProfile:
    """`kvrelay calibrate`: measure (needle language for the demo checkpoint, RULER for text
    tokenizers, unless `config` says which), write the profile beside the checkpoint (or to
    `out`), print the scores and the digests a HeadKV manifest names."""
    if threads is not None:
        torch.set_num_threads(threads)
    console = Console()
    loaded = load(checkpoint)
    if config is None:
        needle_language = speaks_needle_language(loaded.require_tokenizer())
        config = CalibrationConfig() if needle_language else RulerCalibrationConfig()
    digest = checkpoint_sha256(checkpoint)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("calibrating (one prefill per prompt)", total=config.total_prompts)
        tick = lambda: progress.advance(task)  # noqa: E731
        if isinstance(config, RulerCalibrationConfig):
            profile = calibrate_ruler(loaded, config, digest, tick)
        else:
            profile = calibrate(loaded, config, digest, tick)
    path = save_profile(checkpoint, profile, out)
    print_profile(console, profile, path)
    return profile


def print_profile(console: Console, profile: HeadProfile, path: Path) -> None:
    """The score table and both digests."""
    table = Table(title=f"retrieval scores ({profile.provenance.method}) per layer x K/V head")
    table.add_column("layer")
    for head in range(int(profile.kv_head.shape[1])):
        table.add_column(f"kv {head}", justify="right")
    table.add_column("query heads", justify="left")
    for layer, (row, query_row) in enumerate(zip(profile.kv_head, profile.query_head, strict=True)):
        queries = " ".join(f"{float(x):.2f}" for x in query_row)
        table.add_row(str(layer), *(f"{float(x):.3f}" for x in row), queries)
    console.print(table)
    provenance = profile.provenance
    console.print(
        f"{provenance.prompts} prompts, lengths {list(provenance.context_lengths)}, seed "
        f"{provenance.seed}; the full-cache model answered {100 * provenance.answer_accuracy:.1f}%"
    )
    console.print(f"wrote {path}")
    console.print(f"headkv_profile_sha256 (owners = K/V heads, GQA mean/max): {profile.sha256}")
    console.print(
        f"headkv_profile_sha256 (owners = query heads, GQA expand): {profile.query_head_sha256}"
    )


def _observation(result: PrefillResult) -> torch.Tensor:
    """The window's rows themselves `[L, H_q, W, T]` (calibration reads each query's argmax,
    so its prefills keep them: `PrefillOptions.keep_observation`, the default)."""
    if result.observation is None:
        raise InvalidModelInput("prefill.keep_observation", "calibration reads the window's rows")
    return result.observation
