"""`kvrelay eval`: needle retrieval accuracy of every policy of the sweep on one checkpoint.

Protocol. The first output token is sampled at prefill from full attention, so a question
answered by that token would never see compression. Each needle prompt is therefore split
before its answer cue: the prefix (haystack and question; in placement `before_filler` the
question is followed by filler) goes through the prefill stages under the policy, then the
cue `answer :` is decoded over the packed view (teacher-forced, as the decode worker would
process it) and the answer is the greedy token after `:`. A trial is correct when that token
is the needle's code. One prompt forward (with the observation window every SnapKV manifest
of the sweep shares) serves all policies; score → allocate → select → pack → decode runs per
policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from services.demo import needle
from services.demo.evaluate import HELD_OUT_SEED
from services.evaluation.generation import admit, compress_prompt, feed, forward_for
from services.evaluation.policies import PolicyCell, SnapKVShape, policy_grid
from services.kvpolicy.head_profile import HeadProfile
from services.kvpolicy.manifest import AllocationMethod, GQAReduction
from services.model import InvalidModelInput, LoadedModel, PromptForward

CUE_TOKENS = needle.CUE_TOKENS


@dataclass(frozen=True)
class SweepConfig:
    """What `kvrelay eval` measures: `prompts_per_cell` prompts per (length, placement, depth),
    each under every policy of `policy_grid`."""

    context_lengths: tuple[int, ...] = (512, 1024, 2048)
    depths: tuple[float, ...] = (0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95)
    budgets: tuple[float, ...] = (0.10, 0.25, 0.50)
    allocations: tuple[AllocationMethod, ...] = tuple(AllocationMethod)
    reductions: tuple[GQAReduction, ...] = tuple(GQAReduction)
    placements: tuple[needle.Placement, ...] = tuple(needle.Placement)
    prompts_per_cell: int = 4
    shape: SnapKVShape = field(default_factory=SnapKVShape)
    distractors: int = 3
    question_gap: int = needle.DEFAULT_QUESTION_GAP
    seed: int = HELD_OUT_SEED + 500_000
    chunk_size: int = 512

    def __post_init__(self) -> None:
        if self.prompts_per_cell < 1:
            raise ValueError(f"prompts_per_cell: must be >= 1, got {self.prompts_per_cell}")
        for name in ("context_lengths", "depths", "budgets", "placements"):
            if not getattr(self, name):
                raise ValueError(f"{name}: must not be empty")
        if any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths: must be in [0, 1], got {self.depths}")
        if any(not 0.0 < b <= 1.0 for b in self.budgets):
            raise ValueError(f"budgets: must be in (0, 1], got {self.budgets}")

    @property
    def total_prompts(self) -> int:
        cells = len(self.context_lengths) * len(self.placements) * len(self.depths)
        return cells * self.prompts_per_cell


@dataclass(frozen=True)
class Trial:
    """One prompt under one policy."""

    policy: str  # PolicyCell.label
    budget: float | None
    placement: needle.Placement
    context_tokens: int
    depth: float
    answer: int  # greedy token after the cue
    correct: bool
    retained_rows: int
    full_rows: int


def sweep_prompts(config: SweepConfig, length: int) -> list[needle.NeedlePrompt]:
    """The prompts of one context length, in (placement, depth, index) order. Both placements
    share seeds: the same needles in the same haystacks, only the question moves."""
    return [
        needle.build_prompt(
            length,
            depth=depth,
            placement=placement,
            seed=config.seed + 10_000 * length + 100 * d + index,
            distractors=config.distractors,
            question_gap=config.question_gap,
        )
        for placement in config.placements
        for d, depth in enumerate(config.depths)
        for index in range(config.prompts_per_cell)
    ]


def split_cue(loaded: LoadedModel, prompt: needle.NeedlePrompt) -> tuple[list[int], list[int], int]:
    """Token ids of the prefix, of the cue `answer :`, and the code's id."""
    tokenizer = loaded.require_tokenizer()
    ids = tokenizer.encode(prompt.text)
    code = tokenizer.token_id(prompt.answer)
    cue = tokenizer.encode(" ".join(needle.answer_cue()), add_special_tokens=False)
    if code is None or ids[-CUE_TOKENS:] != cue:
        raise InvalidModelInput(
            "tokenizer", "the checkpoint's tokenizer does not speak the needle language"
        )
    return ids[:-CUE_TOKENS], cue, code


def answer_under(
    loaded: LoadedModel,
    cell: PolicyCell,
    prefix: Sequence[int],
    cue: Sequence[int],
    shared: PromptForward,
    profile: HeadProfile | None,
) -> tuple[int, int]:
    """The greedy answer after the cue, decoded over the prefix packed under `cell`'s manifest,
    and the rows that view retains."""
    compressed = compress_prompt(loaded, cell.manifest, prefix, profile, shared_forward=shared)
    cache = admit(loaded, compressed, extra_rows=len(cue))
    logits = feed(loaded, cache, cue)  # [V]
    return int(logits.argmax()), compressed.ledger.visible_rows


def evaluate_prompt(
    loaded: LoadedModel,
    config: SweepConfig,
    prompt: needle.NeedlePrompt,
    profile: HeadProfile | None,
) -> list[Trial]:
    """Every policy of the sweep on one prompt (one shared forward)."""
    prefix, cue, code = split_cue(loaded, prompt)
    cells = policy_grid(
        loaded.tensor_contract, len(prefix), config.budgets, config.allocations,
        config.reductions, profile, config.shape,
    )
    probe = next((c.manifest for c in cells if c.family == "snapkv"), cells[0].manifest)
    shared = forward_for(loaded, probe, prefix, chunk_size=config.chunk_size)
    full_rows = loaded.config.num_layers * loaded.config.num_kv_heads * len(prefix)
    trials = []
    for cell in cells:
        answer, rows = answer_under(loaded, cell, prefix, cue, shared, profile)
        trials.append(
            Trial(cell.label, cell.budget, prompt.placement, len(prompt.words), prompt.depth,
                  answer, answer == code, rows, full_rows)
        )
    return trials


@torch.no_grad()
def run_sweep(
    loaded: LoadedModel,
    config: SweepConfig,
    profile: HeadProfile | None,
    advance: Callable[[int], None] | None = None,
) -> list[Trial]:
    """All trials of `config`; `advance(context_tokens)` ticks once per prompt."""
    trials: list[Trial] = []
    for length in config.context_lengths:
        for prompt in sweep_prompts(config, length):
            trials += evaluate_prompt(loaded, config, prompt, profile)
            if advance is not None:
                advance(length)
    return trials
