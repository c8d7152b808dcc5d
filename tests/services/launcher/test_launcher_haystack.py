"""The demo's question: a passphrase in whole paragraphs of the Python language reference,
at the asked depth and length, the same for the same seed, graded by the passphrase alone."""

from __future__ import annotations

import pytest

from services.launcher.haystack import NEEDLE, QUESTION, build_question, prose_paragraphs


def words(text: str) -> int:
    return len(text.split())


def test_paragraphs_are_unwrapped_prose_without_code_grammar_or_headings() -> None:
    paragraphs = prose_paragraphs()
    assert len(paragraphs) > 200 and len(set(paragraphs)) == len(paragraphs)
    assert sum(words(p) for p in paragraphs) > 15_000  # a haystack of several thousand tokens
    for paragraph in paragraphs:
        assert "\n" not in paragraph and words(paragraph) >= 25
        assert "::=" not in paragraph and ">>>" not in paragraph and "*****" not in paragraph


def test_the_needle_sits_at_the_depth_inside_a_haystack_of_the_asked_length() -> None:
    question = build_question(words, 2000, 0.25, seed=3)
    (message,) = question.messages
    assert message.role == "user" and message.content.endswith(f"Question: {QUESTION}")
    body = message.content.split("\n\n")[1:-1]  # instruction first, question last
    needle = body.index(NEEDLE.format(answer=question.answer))
    assert len(body) == question.paragraphs + 1 and needle == round(0.25 * question.paragraphs)
    assert 2000 - 400 < question.context_tokens <= 2000  # whole paragraphs, never over
    assert sum(words(p) for p in body if p.startswith("The secret") is False) == question.context_tokens
    assert message.content.count(question.answer) == 1


def test_a_seed_fixes_the_question_and_another_seed_changes_it() -> None:
    assert build_question(words, 1000, 0.5, seed=7) == build_question(words, 1000, 0.5, seed=7)
    other = build_question(words, 1000, 0.5, seed=8)
    assert other.answer != build_question(words, 1000, 0.5, seed=7).answer


def test_an_answer_counts_when_it_states_the_passphrase() -> None:
    question = build_question(words, 500, 0.0, seed=1)
    first, second, digits = question.answer.split("-")
    assert question.correct(f"The secret passphrase of the archive is {question.answer}.")
    assert question.correct(f"{first.upper()} - {second} - {digits}")
    assert not question.correct(f"The passphrase is {first}-{second}.")
    assert not question.correct(f"{first}-{second}-{digits[:-1]}")


@pytest.mark.parametrize(("context", "depth"), [(0, 0.5), (100, 1.5)])
def test_bad_arguments_name_the_field(context: int, depth: float) -> None:
    with pytest.raises(ValueError, match="context_tokens" if context <= 0 else "depth"):
        build_question(words, context, depth, seed=0)
