"""The evaluation harness, driven by rule-based generators instead of a model."""

from __future__ import annotations

from services.demo import needle
from services.demo.evaluate import (
    AccuracyRow,
    EvalConfig,
    answered,
    evaluate,
    held_out_prompts,
    markdown_table,
)
from services.demo.needle import Placement

TOKENIZER = needle.build_tokenizer()


def _solver(ids: list[int]) -> list[int]:
    """Answers from the text alone: the code stated for the name asked last."""
    words = TOKENIZER.decode(ids).split()
    asked = words[max(i for i, w in enumerate(words) if w == "what") + 5]
    stated = next(i for i in range(len(words)) if words[i : i + 5] == ["the", "code", "of", asked, "is"])
    return [TOKENIZER.token_to_id(words[stated + 5]), TOKENIZER.token_to_id(".")]


def test_held_out_prompts_spread_depth_and_share_seeds_across_placements() -> None:
    config = EvalConfig(prompts=5)
    end = held_out_prompts(config, 512, Placement.END)
    before = held_out_prompts(config, 512, Placement.BEFORE_FILLER)
    assert [p.depth for p in end] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert [p.answer for p in end] == [p.answer for p in before]
    assert all(len(p.words) == 512 for p in end + before)


def test_prompts_are_answerable_from_the_text_and_scored_exactly() -> None:
    config = EvalConfig(context_lengths=(256, 512), prompts=6)
    rows = evaluate(config, _solver, TOKENIZER)
    assert [(r.placement, r.context_tokens) for r in rows] == [
        (Placement.END, 256), (Placement.END, 512),
        (Placement.BEFORE_FILLER, 256), (Placement.BEFORE_FILLER, 512),
    ]
    assert all(r.correct == r.total == 6 for r in rows)
    wrong = evaluate(config, lambda ids: [TOKENIZER.token_to_id("100")], TOKENIZER)
    assert sum(r.correct for r in wrong) <= 2


def test_answered_checks_the_first_generated_word() -> None:
    prompt = needle.build_prompt(256, 0.5, Placement.END, seed=4)
    assert answered(prompt, f"{prompt.answer} .")
    assert not answered(prompt, f". {prompt.answer}")
    assert not answered(prompt, "")


def test_markdown_table_has_one_row_per_placement() -> None:
    rows = [
        AccuracyRow(Placement.END, 512, 99, 100, 1.0),
        AccuracyRow(Placement.END, 1024, 97, 100, 1.0),
        AccuracyRow(Placement.BEFORE_FILLER, 512, 50, 100, 1.0),
    ]
    assert markdown_table(rows).splitlines() == [
        "| placement | 512 tokens | 1024 tokens |",
        "| --- | ---: | ---: |",
        "| end | 99.0% (99/100) | 97.0% (97/100) |",
        "| before_filler | 50.0% (50/100) | - |",
    ]
