"""Full-cache needle accuracy of a checkpoint (``kvrelay eval-checkpoint``).

Held-out prompts of the needle language (:mod:`services.demo.needle`) at several context
lengths, the needle depth spread evenly from the start to the end of the haystack, in both
question placements. A prompt counts as answered when the first generated word is its code.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.demo import needle

ANSWER_TOKENS = 2  # the code and the full stop after it
HELD_OUT_SEED = 7_000_000  # evaluation prompts use seeds far from the training monitor's

# Prompt token ids -> generated token ids (greedy, full cache).
Generate = Callable[[list[int]], list[int]]


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate: context lengths, prompts per length, placements and prompt shape."""

    context_lengths: tuple[int, ...] = (512, 1024, 2048)
    prompts: int = 100
    placements: tuple[needle.Placement, ...] = (needle.Placement.END, needle.Placement.BEFORE_FILLER)
    distractors: int = 3
    question_gap: int = needle.DEFAULT_QUESTION_GAP
    seed: int = HELD_OUT_SEED

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if not self.context_lengths:
            raise ValueError("context_lengths must not be empty")
        if not self.placements:
            raise ValueError("placements must not be empty")


@dataclass(frozen=True)
class AccuracyRow:
    """Answered prompts for one (placement, context length)."""

    placement: needle.Placement
    context_tokens: int
    correct: int
    total: int
    seconds: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


def held_out_prompts(
    config: EvalConfig, context_tokens: int, placement: needle.Placement
) -> list[needle.NeedlePrompt]:
    """``config.prompts`` prompts with depths evenly spread over [0, 1].

    Both placements share seeds, so they ask the same needles in the same haystacks.
    """
    count = config.prompts
    return [
        needle.build_prompt(
            context_tokens,
            depth=index / max(count - 1, 1),
            placement=placement,
            seed=config.seed + 10_000 * context_tokens + index,
            distractors=config.distractors,
            question_gap=config.question_gap,
        )
        for index in range(count)
    ]


def answered(prompt: needle.NeedlePrompt, generated: str) -> bool:
    """Whether the first generated word is the prompt's code."""
    words = generated.split()
    return bool(words) and words[0] == prompt.answer


def evaluate(config: EvalConfig, generate: Generate, tokenizer: Tokenizer) -> list[AccuracyRow]:
    """Accuracy for every (placement, context length) in ``config``."""
    rows = []
    for placement in config.placements:
        for tokens in config.context_lengths:
            started = time.perf_counter()
            prompts = held_out_prompts(config, tokens, placement)
            correct = sum(
                answered(prompt, tokenizer.decode(generate(tokenizer.encode(prompt.text).ids)))
                for prompt in prompts
            )
            elapsed = time.perf_counter() - started
            rows.append(AccuracyRow(placement, tokens, correct, len(prompts), elapsed))
    return rows


def runtime_generator(path: Path, device: str, dtype: str | None) -> Generate:
    """Greedy full-cache generation with kvrelay's own runtime."""
    from services.model import generate, load

    loaded = load(path, device, dtype)
    return lambda ids: list(generate(loaded, ids, ANSWER_TOKENS))


def reference_generator(path: Path, device: str, dtype: str | None) -> Generate:
    """Greedy full-cache generation with ``transformers`` (the reference implementation)."""
    from transformers import LlamaForCausalLM

    torch_dtype = getattr(torch, dtype) if dtype else torch.float32
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device).eval()

    @torch.no_grad()
    def generate(ids: list[int]) -> list[int]:
        prompt = torch.tensor([ids], device=device)  # [1, T]
        output = model.generate(
            prompt, max_new_tokens=ANSWER_TOKENS, do_sample=False, pad_token_id=0
        )
        return output[0, prompt.shape[1] :].tolist()

    return generate


BACKENDS: dict[str, Callable[[Path, str, str | None], Generate]] = {
    "runtime": runtime_generator,
    "transformers": reference_generator,
}


def markdown_table(rows: Sequence[AccuracyRow]) -> str:
    """Rows as a Markdown table: one line per placement, one column per context length."""
    lengths = sorted({row.context_tokens for row in rows})
    header = "| placement | " + " | ".join(f"{n} tokens" for n in lengths) + " |"
    rule = "| --- |" + " ---: |" * len(lengths)
    lines = [header, rule]
    for placement in dict.fromkeys(row.placement for row in rows):
        cells = {row.context_tokens: row for row in rows if row.placement is placement}
        lines.append(
            f"| {placement.value} | "
            + " | ".join(_cell(cells.get(n)) for n in lengths)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _cell(row: AccuracyRow | None) -> str:
    if row is None:
        return "-"
    return f"{100 * row.accuracy:.1f}% ({row.correct}/{row.total})"


def run(
    checkpoint: Path,
    config: EvalConfig,
    backend: str,
    device: str,
    dtype: str | None,
    markdown: Path | None,
    threads: int | None = None,
) -> list[AccuracyRow]:
    """Evaluate ``checkpoint``, print the table, optionally write it as Markdown."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    rows = evaluate(config, BACKENDS[backend](checkpoint, device, dtype), tokenizer)
    table = markdown_table(rows)
    print(f"full-cache needle accuracy of {checkpoint} ({backend}, {device})")
    print(table, end="")
    print(f"wall time {sum(row.seconds for row in rows):.1f} s")
    if markdown is not None:
        markdown.write_text(
            f"Full-cache needle accuracy of `{checkpoint}` ({backend} backend, {device}), "
            f"{config.prompts} held-out prompts per cell, {config.distractors} distractor facts, "
            f"question gap {config.question_gap} tokens in placement before_filler.\n\n{table}"
        )
    return rows
