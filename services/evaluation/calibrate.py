"""`kvrelay calibrate`: HeadKV retrieval-head scores of a checkpoint, written beside it.

Retrieval score (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
Factuality"; the importance HeadKV, Fu et al. 2024, allocates by): while the model answers a
needle question, a head *retrieves* at an answer token when its top attention (argmax over the
context) lands on the needle token being copied. A head's score is the share of answer tokens
at which it retrieves.

In the needle language (`services.model.needle`) the answer is one code token, predicted by the
query at the cue `:` that closes the prompt, and the token being copied is the code inside the
target fact (`the code of <name> is <code> .`). One full-cache prefill with an observation
window of 1 captures exactly that query's attention `[L, H_q, 1, T]`, so every prompt costs one
forward. The answer is teacher-forced (the cue query is the same whatever the model would
generate), so an undertrained checkpoint still gets scores; the share of prompts the model
answers itself is recorded as `answer_accuracy`.

Owners: the score of a K/V head is the mean over the query heads that read it (the manifest's
`q_to_kv_head_map`), i.e. the share of (query head, answer token) pairs of its group that retrieve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from services.evaluation.profile import (
    HeadProfile,
    ProfileProvenance,
    checkpoint_sha256,
    save_profile,
)
from services.kvpolicy.manifest import GQAReduction
from services.kvpolicy.snapkv import reduce_gqa
from services.model import InvalidModelInput, LoadedModel, PrefillOptions, load, needle, prefill

METHOD = "retrieval-top1"
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
    top = result.observation[:, :, -1, :].argmax(dim=-1)  # [L, H_q]
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
    """Retrieval scores of every head over `config`'s prompts; `advance` ticks once per prompt."""
    prompts = calibration_prompts(config)
    shape = (loaded.config.num_layers, loaded.config.num_q_heads)
    hits = torch.zeros(shape, dtype=torch.float64)  # [L, H_q]
    answered = 0
    for prompt in prompts:
        result = prompt_hits(loaded, prompt, config.chunk_size)
        hits += result.hits
        answered += result.answered
        if advance is not None:
            advance()
    query_head = (hits / len(prompts)).to(torch.float32)  # [L, H_q]
    provenance = ProfileProvenance(
        method=METHOD,
        prompts=len(prompts),
        seed=config.seed,
        context_lengths=config.context_lengths,
        placements=tuple(p.value for p in config.placements),
        distractors=config.distractors,
        checkpoint_sha256=checkpoint_digest,
        answer_accuracy=answered / len(prompts),
    )
    kv_head = owner_scores(query_head, loaded.config.q_to_kv_head_map)
    return HeadProfile(kv_head.contiguous(), query_head.contiguous(), provenance)


def run(checkpoint: Path, config: CalibrationConfig, threads: int | None = None) -> HeadProfile:
    """`kvrelay calibrate`: measure, write `headkv_profile.safetensors` beside the checkpoint,
    print the scores and the digests a HeadKV manifest names."""
    if threads is not None:
        torch.set_num_threads(threads)
    console = Console()
    loaded = load(checkpoint)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("calibrating (one prefill per prompt)", total=config.total_prompts)
        profile = calibrate(
            loaded, config, checkpoint_sha256(checkpoint), lambda: progress.advance(task)
        )
    path = save_profile(checkpoint, profile)
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
