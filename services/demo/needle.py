"""The synthetic needle language of the bundled demo checkpoint.

Text is whitespace-separated words, one token per word:

- filler sentences: ``the quiet river crosses the old bridge near the hill .``
- needle facts: ``the code of <name> is <number> .``
- questions with an answer cue: ``what is the code of <name> ? answer : <number> .``

Two question placements are used for evaluation:

- ``END`` (a): the question and the cue close the prompt, so an observation window of the last
  few tokens sees the question;
- ``BEFORE_FILLER`` (b): the question is followed by a long stretch of filler and only the cue
  ``answer :`` closes the prompt, so the observation window does not see the question.

Every builder takes an explicit seed or ``random.Random`` and is deterministic. Counts are in
tokens and include ``<bos>``; a prompt never includes the answer.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


STRUCTURE_WORDS: tuple[str, ...] = ("the", "code", "of", "is", "what", "?", "answer", ":", ".")

NAMES: tuple[str, ...] = _words(
    """
    alice bruno carla dmitri elena felix greta hugo irene jonas karin lucas marta nadia oscar
    paula quentin rosa samuel tilda ursula victor wanda xavier yara zoltan amber boris celia
    darius edith fabian gloria henrik ingrid julian kira leon mila nico olga pavel rita stefan
    tamara ulrich vera walter ximena yusuf zara anton bianca cyril daphne emil flora gustav
    helena igor jasmin kasper lena marco nora otto petra raoul selma theo una viktor wilma
    yannick zelda adrian berta conrad dora erik fiona george hanna ivan julia klaus lotte
    magnus nina oliver pia rafael sofia tobias uma valentin willem yvonne zeno agnes basil
    clara dennis esther frida gideon hilda isaak johan katja lars maja nils ophelia philipp
    ruth simon thea uwe vincent wendy yasmin zack arthur bella cosmo delia elias fanny gregor
    heidi ilse jakob kurt linus mona noah odile pablo quinn regina sven tessa udo vito
    """
)

# Codes are the three-digit numbers 100..999, each one word and one token.
CODES: tuple[str, ...] = tuple(str(n) for n in range(100, 1000))

ADJECTIVES: tuple[str, ...] = _words(
    """
    old quiet red green small large bright dark cold warm gentle busy empty narrow wide tall
    slow soft loud calm wild distant ancient silver golden hidden
    """
)
NOUNS: tuple[str, ...] = _words(
    """
    river bridge hill forest village garden tower meadow harbor valley road window lamp boat
    cloud field market orchard mountain lake stone house wall path station
    """
)
PLURAL_NOUNS: tuple[str, ...] = _words(
    """
    birds children farmers sailors travelers horses dogs merchants students painters
    fishermen neighbors
    """
)
TRANSITIVE_VERBS: tuple[str, ...] = _words(
    "cross watch visit pass follow paint remember find leave reach"
)
INTRANSITIVE_VERBS: tuple[str, ...] = _words(
    "rest wait sing walk sleep gather wander talk work laugh"
)
ADVERBS: tuple[str, ...] = _words("slowly quietly often again together early late")
PREPOSITIONS: tuple[str, ...] = _words("near behind beyond under across beside")

FILLER_WORDS: tuple[str, ...] = (
    ADJECTIVES + NOUNS + PLURAL_NOUNS + TRANSITIVE_VERBS + INTRANSITIVE_VERBS + ADVERBS
    + PREPOSITIONS
)

MIN_SENTENCE = 3
MAX_SENTENCE = 14
FACT_TOKENS = 7  # the code of <name> is <number> .
QUESTION_TOKENS = 7  # what is the code of <name> ?
CUE_TOKENS = 2  # answer :
DEFAULT_QUESTION_GAP = 128


class Placement(enum.Enum):
    """Where the question sits relative to the answer cue."""

    END = "end"
    BEFORE_FILLER = "before_filler"


class NeedleLanguageError(ValueError):
    """An argument to a needle-language builder is out of range; the message names it."""


def vocabulary() -> tuple[str, ...]:
    """All words in id order: special tokens first (``<pad>`` = 0, ``<bos>`` = 1, ...)."""
    words = SPECIAL_TOKENS + STRUCTURE_WORDS + NAMES + CODES + FILLER_WORDS
    assert len(set(words)) == len(words), "needle vocabulary has a duplicate word"
    return words


def fact(name: str, code: str) -> list[str]:
    """The needle ``the code of <name> is <code> .``"""
    return ["the", "code", "of", name, "is", code, "."]


def question(name: str) -> list[str]:
    """``what is the code of <name> ?`` (without the answer cue)."""
    return ["what", "is", "the", "code", "of", name, "?"]


def answer_cue() -> list[str]:
    """``answer :``, the words after which the model writes the code."""
    return ["answer", ":"]


def filler_sentence(rng: random.Random, length: int) -> list[str]:
    """A grammatical filler sentence of exactly ``length`` tokens (``length >= 3``), ending in ``.``."""
    if length < MIN_SENTENCE:
        raise NeedleLanguageError(f"length must be >= {MIN_SENTENCE}, got {length}")
    words = _subject(rng, length - 2)
    words += _predicate(rng, length - 1 - len(words))
    words += _modifiers(rng, length - 1 - len(words))
    return words + ["."]


def _subject(rng: random.Random, room: int) -> list[str]:
    if room >= 2 and rng.random() < 0.5:
        return [rng.choice(ADJECTIVES), rng.choice(PLURAL_NOUNS)]
    return [rng.choice(PLURAL_NOUNS)]


def _predicate(rng: random.Random, room: int) -> list[str]:
    if room >= 3 and rng.random() < 0.5:
        return [rng.choice(TRANSITIVE_VERBS), "the", rng.choice(NOUNS)]
    return [rng.choice(INTRANSITIVE_VERBS)]


def _modifiers(rng: random.Random, room: int) -> list[str]:
    """Adverbs and prepositional phrases filling exactly ``room`` tokens."""
    words: list[str] = []
    while room > 0:
        size = rng.choice([n for n in (1, 3, 4) if n <= room])
        if size == 1:
            words.append(rng.choice(ADVERBS))
        elif size == 3:
            words += [rng.choice(PREPOSITIONS), "the", rng.choice(NOUNS)]
        else:
            words += [rng.choice(PREPOSITIONS), "the", rng.choice(ADJECTIVES), rng.choice(NOUNS)]
        room -= size
    return words


def filler(rng: random.Random, tokens: int) -> list[list[str]]:
    """Whole filler sentences totalling exactly ``tokens`` (0 or >= 3)."""
    if tokens < 0 or 0 < tokens < MIN_SENTENCE:
        raise NeedleLanguageError(f"tokens must be 0 or >= {MIN_SENTENCE}, got {tokens}")
    sentences: list[list[str]] = []
    while tokens > 0:
        length = _next_sentence_length(rng, tokens)
        sentences.append(filler_sentence(rng, length))
        tokens -= length
    return sentences


def _next_sentence_length(rng: random.Random, remaining: int) -> int:
    if remaining <= MAX_SENTENCE:
        return remaining
    # Never leave a remainder of 1 or 2 tokens, which no sentence can fill.
    choices = [n for n in range(5, MAX_SENTENCE + 1) if remaining - n >= MIN_SENTENCE]
    return rng.choice(choices)


@dataclass(frozen=True)
class NeedlePrompt:
    """One evaluation prompt: words (starting with ``<bos>``) and the expected code."""

    words: tuple[str, ...]
    answer: str
    name: str
    depth: float
    placement: Placement
    needle_start: int  # token index of the target fact's first word

    @property
    def text(self) -> str:
        """The prompt as text, without ``<bos>`` (the tokenizer adds it)."""
        return " ".join(self.words[1:])


def build_prompt(
    context_tokens: int,
    depth: float,
    placement: Placement,
    seed: int,
    distractors: int = 3,
    question_gap: int = DEFAULT_QUESTION_GAP,
) -> NeedlePrompt:
    """A prompt of exactly ``context_tokens`` tokens asking for one fact.

    The target fact starts at ``depth`` (0 = first, 1 = last) of the haystack, which is all
    tokens before the question; ``distractors`` further facts about other names sit at random
    depths. With ``Placement.BEFORE_FILLER`` the question is followed by ``question_gap`` filler
    tokens before the cue.
    """
    _check_prompt_args(context_tokens, depth, distractors, question_gap, placement)
    rng = random.Random(seed)
    names = rng.sample(NAMES, distractors + 1)
    codes = rng.sample(CODES, distractors + 1)
    gap = question_gap if placement is Placement.BEFORE_FILLER else 0
    closing = question(names[0]) + _filler_words(rng, gap) + answer_cue()
    haystack_filler = (
        context_tokens - 1 - len(closing) - FACT_TOKENS * (distractors + 1)
    )
    sentences = filler(rng, haystack_filler)
    depths = [depth] + [rng.random() for _ in range(distractors)]
    body, starts = _insert_facts(sentences, list(zip(names, codes, strict=True)), depths)
    words = (BOS, *body, *closing)
    assert len(words) == context_tokens
    return NeedlePrompt(words, codes[0], names[0], depth, placement, 1 + starts[0])


def _check_prompt_args(
    context_tokens: int, depth: float, distractors: int, question_gap: int, placement: Placement
) -> None:
    if not 0.0 <= depth <= 1.0:
        raise NeedleLanguageError(f"depth must be in [0, 1], got {depth}")
    if not 0 <= distractors < len(NAMES):
        raise NeedleLanguageError(f"distractors must be in [0, {len(NAMES) - 1}], got {distractors}")
    if placement is Placement.BEFORE_FILLER and question_gap < MIN_SENTENCE:
        raise NeedleLanguageError(f"question_gap must be >= {MIN_SENTENCE}, got {question_gap}")
    gap = question_gap if placement is Placement.BEFORE_FILLER else 0
    fixed = 1 + QUESTION_TOKENS + CUE_TOKENS + gap + FACT_TOKENS * (distractors + 1)
    if context_tokens < fixed + MIN_SENTENCE:
        raise NeedleLanguageError(
            f"context_tokens must be >= {fixed + MIN_SENTENCE} for these arguments, "
            f"got {context_tokens}"
        )


def _filler_words(rng: random.Random, tokens: int) -> list[str]:
    return [word for sentence in filler(rng, tokens) for word in sentence]


def _insert_facts(
    sentences: list[list[str]], facts: list[tuple[str, str]], depths: Sequence[float]
) -> tuple[list[str], list[int]]:
    """Place each fact at the sentence boundary nearest its depth; return words and fact starts."""
    boundaries = [0]
    for sentence in sentences:
        boundaries.append(boundaries[-1] + len(sentence))
    slots: dict[int, list[int]] = {}
    for index, depth in enumerate(depths):
        target = depth * boundaries[-1]
        slot = min(range(len(boundaries)), key=lambda b: abs(boundaries[b] - target))
        slots.setdefault(slot, []).append(index)
    words: list[str] = []
    starts = [0] * len(facts)
    for slot in range(len(boundaries)):
        for index in slots.get(slot, []):
            starts[index] = len(words)
            words += fact(*facts[index])
        if slot < len(sentences):
            words += sentences[slot]
    return words, starts


@dataclass(frozen=True)
class TrainingSequence:
    """A dense training document: words (starting with ``<bos>``) and the answer-token indices."""

    words: tuple[str, ...]
    answer_positions: tuple[int, ...]


@dataclass(frozen=True)
class DocumentMix:
    """How a training document is composed.

    ``filler_share`` is the probability that the next segment is a filler sentence (about the
    share of filler tokens); ``before_filler_share`` is the share of questions asked in placement
    (b), whose gap is drawn from ``[gap_min, gap_max]`` tokens. No question is asked before
    ``min_facts`` facts have been stated: with only one or two candidates, "copy a recent code"
    answers most questions without retrieval, and training stalls on that shortcut.
    """

    tokens: int
    filler_share: float
    before_filler_share: float = 0.0
    gap_min: int = 16
    gap_max: int = 128
    min_facts: int = 1

    def __post_init__(self) -> None:
        if self.min_facts < 1:
            raise NeedleLanguageError(f"min_facts must be >= 1, got {self.min_facts}")
        if self.tokens < 32:
            raise NeedleLanguageError(f"tokens must be >= 32, got {self.tokens}")
        if not 0.0 <= self.filler_share < 1.0:
            raise NeedleLanguageError(f"filler_share must be in [0, 1), got {self.filler_share}")
        if not 0.0 <= self.before_filler_share <= 1.0:
            raise NeedleLanguageError(
                f"before_filler_share must be in [0, 1], got {self.before_filler_share}"
            )
        if not MIN_SENTENCE <= self.gap_min <= self.gap_max:
            raise NeedleLanguageError(
                f"gap_min/gap_max must satisfy {MIN_SENTENCE} <= gap_min <= gap_max, "
                f"got {self.gap_min}/{self.gap_max}"
            )


def build_training_sequence(mix: DocumentMix, rng: random.Random) -> TrainingSequence:
    """Facts, filler and many questions about earlier facts, exactly ``mix.tokens`` long.

    Names are unique within a document, so every question has one right answer; questions pick
    their fact uniformly among those already stated, which spreads the retrieval distance over
    the whole document.
    """
    words: list[str] = [BOS]
    answers: list[int] = []
    stated: list[tuple[str, str]] = []
    unused = rng.sample(NAMES, len(NAMES))
    while True:
        remaining = mix.tokens - len(words)
        segment, answer_offset = _next_segment(mix, rng, stated, unused, remaining)
        if segment is None:
            break
        if answer_offset is not None:
            answers.append(len(words) + answer_offset)
        words += segment
    words += _filler_words(rng, mix.tokens - len(words))
    return TrainingSequence(tuple(words), tuple(answers))


def _next_segment(
    mix: DocumentMix,
    rng: random.Random,
    stated: list[tuple[str, str]],
    unused: list[str],
    remaining: int,
) -> tuple[list[str] | None, int | None]:
    """The next segment and its answer offset, or ``(None, None)`` when the document is full."""
    if rng.random() < mix.filler_share:
        length = rng.randint(5, MAX_SENTENCE)
        segment = filler_sentence(rng, length)
        return (segment, None) if _fits(segment, remaining) else (None, None)
    ready = len(stated) >= mix.min_facts
    if stated and (not unused or (ready and rng.random() < 0.5)):
        return _question_segment(mix, rng, stated, remaining)
    name = unused.pop()
    code = rng.choice(CODES)
    segment = fact(name, code)
    if not _fits(segment, remaining):
        return None, None
    stated.append((name, code))
    return segment, None


def _question_segment(
    mix: DocumentMix, rng: random.Random, stated: list[tuple[str, str]], remaining: int
) -> tuple[list[str] | None, int | None]:
    name, code = rng.choice(stated)
    gap: list[str] = []
    if rng.random() < mix.before_filler_share:
        gap = _filler_words(rng, rng.randint(mix.gap_min, mix.gap_max))
    segment = question(name) + gap + answer_cue() + [code, "."]
    if not _fits(segment, remaining):
        return None, None
    return segment, len(segment) - 2


def _fits(segment: list[str], remaining: int) -> bool:
    """Whether the segment fits and leaves either nothing or room for one filler sentence."""
    rest = remaining - len(segment)
    return rest == 0 or rest >= MIN_SENTENCE


def build_tokenizer() -> Tokenizer:
    """A word-level ``tokenizers`` tokenizer over :func:`vocabulary` that prepends ``<bos>``."""
    vocab = {word: index for index, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return tokenizer
