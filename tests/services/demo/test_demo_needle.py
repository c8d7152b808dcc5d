"""The synthetic needle language: determinism, exact lengths and the format of every part."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.demo import needle
from services.demo.needle import DocumentMix, NeedleLanguageError, Placement

CUE_WORDS = {"code", "what", "answer", "is", "of", ":", "?"}


def _placement_and_shape() -> st.SearchStrategy:
    return st.tuples(
        st.sampled_from(list(Placement)),
        st.integers(min_value=200, max_value=1200),
        st.floats(min_value=0.0, max_value=1.0),
        st.integers(min_value=0, max_value=2**31),
        st.integers(min_value=0, max_value=6),
    )


def test_vocabulary_starts_with_special_tokens_and_has_no_duplicates() -> None:
    words = needle.vocabulary()
    assert words[:4] == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert len(set(words)) == len(words)
    assert set(needle.NAMES).isdisjoint(needle.FILLER_WORDS)
    assert len(needle.CODES) == 900 and needle.CODES[0] == "100" and needle.CODES[-1] == "999"


@pytest.mark.parametrize("length", range(3, 40))
def test_filler_sentence_has_exact_length_and_no_cue_words(length: int) -> None:
    rng = random.Random(length)
    for _ in range(20):
        sentence = needle.filler_sentence(rng, length)
        assert len(sentence) == length
        assert sentence[-1] == "."
        assert CUE_WORDS.isdisjoint(sentence)
        assert set(sentence) <= set(needle.vocabulary())


def test_filler_rejects_lengths_no_sentence_can_fill() -> None:
    with pytest.raises(NeedleLanguageError, match="length"):
        needle.filler_sentence(random.Random(0), 2)
    with pytest.raises(NeedleLanguageError, match="tokens"):
        needle.filler(random.Random(0), 1)
    assert sum(len(s) for s in needle.filler(random.Random(0), 1000)) == 1000


@settings(max_examples=60, deadline=None)
@given(_placement_and_shape())
def test_prompt_is_exact_deterministic_and_well_formed(case: tuple) -> None:
    placement, tokens, depth, seed, distractors = case
    prompt = needle.build_prompt(tokens, depth, placement, seed, distractors=distractors)
    assert prompt == needle.build_prompt(tokens, depth, placement, seed, distractors=distractors)
    words = list(prompt.words)
    assert len(words) == tokens and words[0] == "<bos>"
    assert prompt.answer not in words[words.index("what") :]
    start = prompt.needle_start
    assert words[start : start + needle.FACT_TOKENS] == needle.fact(prompt.name, prompt.answer)
    assert words[-2:] == needle.answer_cue()
    question_at = len(words) - needle.CUE_TOKENS - needle.QUESTION_TOKENS
    if placement is Placement.BEFORE_FILLER:
        question_at -= needle.DEFAULT_QUESTION_GAP
        assert CUE_WORDS.isdisjoint(words[question_at + needle.QUESTION_TOKENS : -2])
    assert words[question_at : question_at + needle.QUESTION_TOKENS] == needle.question(prompt.name)
    facts = [i for i, word in enumerate(words) if word == "code"][:-1]
    assert len(facts) == distractors + 1
    named = [words[i + 2] for i in facts]
    assert len(set(named)) == len(named) and prompt.name in named
    assert set(words) <= set(needle.vocabulary())


def test_prompts_differ_across_seeds_and_needle_follows_depth() -> None:
    texts = {needle.build_prompt(512, 0.5, Placement.END, seed).text for seed in range(20)}
    assert len(texts) == 20
    starts = [needle.build_prompt(1024, d / 10, Placement.END, 3).needle_start for d in range(11)]
    assert starts == sorted(starts)
    assert starts[0] == 1 and starts[-1] > 1024 - 3 * needle.FACT_TOKENS - 40


def test_placements_share_the_haystack_prefix_for_one_seed() -> None:
    end = needle.build_prompt(512, 0.3, Placement.END, 11, question_gap=64)
    before = needle.build_prompt(512, 0.3, Placement.BEFORE_FILLER, 11, question_gap=64)
    assert (end.name, end.answer) == (before.name, before.answer)
    assert end.text.endswith(f"what is the code of {end.name} ? answer :")
    assert f"what is the code of {before.name} ? answer" not in before.text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"depth": 1.5}, "depth"),
        ({"distractors": -1}, "distractors"),
        ({"context_tokens": 40}, "context_tokens"),
        ({"placement": Placement.BEFORE_FILLER, "question_gap": 2}, "question_gap"),
        ({"placement": Placement.BEFORE_FILLER, "context_tokens": 150}, "context_tokens"),
    ],
)
def test_prompt_arguments_are_validated_by_name(kwargs: dict, field: str) -> None:
    args = {"context_tokens": 512, "depth": 0.5, "placement": Placement.END, "seed": 0} | kwargs
    with pytest.raises(NeedleLanguageError, match=field):
        needle.build_prompt(**args)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(min_value=32, max_value=2048),
    st.floats(min_value=0.0, max_value=0.95),
    st.floats(min_value=0.0, max_value=1.0),
    st.integers(min_value=0, max_value=2**31),
    st.integers(min_value=1, max_value=12),
)
def test_training_sequence_answers_every_question_from_its_fact(
    tokens: int, filler_share: float, before_share: float, seed: int, min_facts: int
) -> None:
    mix = DocumentMix(tokens, filler_share, before_share, gap_min=8, gap_max=64, min_facts=min_facts)
    document = needle.build_training_sequence(mix, random.Random(seed))
    assert document == needle.build_training_sequence(mix, random.Random(seed))
    words = document.words
    assert len(words) == tokens and words[0] == "<bos>"
    codes: dict[str, str] = {}
    for i, word in enumerate(words):
        if word == "is" and words[i - 3 : i - 1] == ("code", "of"):
            assert words[i - 1] not in codes, "names are unique within a document"
            codes[words[i - 1]] = words[i + 1]
    questions = [words[i + 5] for i, word in enumerate(words) if word == "what"]
    assert len(questions) == len(document.answer_positions)
    for name, position in zip(questions, document.answer_positions, strict=True):
        assert words[position - 2 : position] == ("answer", ":")
        assert words[position] == codes[name]
    if questions:
        first_question = words.index("what")
        stated = sum(1 for i in range(first_question) if words[i] == "is" and words[i - 2] == "of")
        assert stated >= min(min_facts, len(codes)), "no question before min_facts facts"


def test_training_mix_is_validated_by_name() -> None:
    with pytest.raises(NeedleLanguageError, match="filler_share"):
        DocumentMix(256, 1.0)
    with pytest.raises(NeedleLanguageError, match="tokens"):
        DocumentMix(8, 0.5)
    with pytest.raises(NeedleLanguageError, match="gap_min"):
        DocumentMix(256, 0.5, gap_min=100, gap_max=50)
