"""RULER-style synthetic long-context tasks, built to an exact length in a checkpoint's tokens.

Tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", its `niah` and `variable_tracking` generators, re-stated here):

- `niah_single`: one needle "One of the special magic numbers for {key} is: {7 digits}.";
- `niah_multikey`: four such needles with different keys, one of them asked;
- `niah_multivalue`: four needles with the same key and different numbers, all must be named;
- `variable_tracking`: a chain `VAR A = 12345.`, `VAR B = VAR A.`, ... spread over the
  context; every variable bound to the value must be named.

Haystacks: RULER's repeated noise sentences, or real English prose (whole paragraphs of the
Python language reference every CPython ships, `pydoc_data.topics`, via the demo's
`services.launcher.haystack.prose_paragraphs`; its text follows the interpreter's version).

Layout of the user turn, per question placement (the observation window of a compressing
prefill sees the prompt's last tokens before the answer cue):

    END             instruction, context, question            (question-aware)
    BEFORE_CONTEXT  instruction, question, context            (question-agnostic)
    BEFORE_FILLER   instruction, context, question, filler    (question-agnostic)

The turn goes through the checkpoint's chat template (plain text without one) and an answer
prefix follows the generation prompt. Unlike RULER's ("The special magic number for {key}
mentioned in the provided text is") it never names the key: it closes the prompt, inside any
observation window, so in the question-agnostic placements nothing after the context may
repeat the question. The question ends with its key, so at the end placement an observation
window of 32 tokens (the suite's; the prompt's tail takes about 12) still reaches it. The *cue*
is the prompt's last token: an evaluation prefills the prompt without it, compresses, and
decodes the cue over the compressed cache, so the first answer token (and every later one) is
read from the compressed cache, not from the full prefill.
Full-cache accuracy of SmolLM2-135M-Instruct with this wording matches RULER's on the
tuning seeds (single needle 100% at 1K in every placement).

A prompt has exactly `length` tokens (cue included): whole haystack units, then a prefix of
one more unit cut to the character that makes the count exact. Needles sit between units at
their depth (the share of haystack tokens before them). Everything is a pure function of the
tokenizer, the spec and the seed.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from services.launcher.haystack import prose_paragraphs
from services.model.tokenizer import ChatMessage, TextTokenizer

NOISE_UNIT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_QUESTION = "What is the special magic number for {key}?"
NIAH_ANSWER_PREFIX = "Answer: The special magic number is"


def answer_number(text: str) -> str:
    """The first run of digits in an answer ("" when none): what a needle answer names."""
    found = re.search(r"\d+", text)
    return "" if found is None else found.group(0)
VT_FIRST = "VAR {name} = {value}."
VT_HOP = "VAR {name} = VAR {previous}."
NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize "
    "it. I will quiz you about the numbers afterwards."
)
VT_INSTRUCTION = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text."
)
MULTIKEY_NEEDLES = 4
MULTIVALUE_VALUES = 4
VT_VARIABLES = 5  # one chain, four hops (RULER's default)
DEFAULT_FILLER_TOKENS = 128  # question-to-cue gap in BEFORE_FILLER: far beyond any window
CUE_TOKENS = 1  # decoded over the compressed cache; everything before it is prefilled
_ADJECTIVES = (
    "amber", "ancient", "bold", "brave", "bright", "calm", "clever", "cosmic", "crimson",
    "curious", "daring", "eager", "fancy", "fierce", "gentle", "golden", "grand", "happy",
    "hidden", "humble", "jolly", "lively", "lucky", "merry", "misty", "noble", "quiet",
    "rapid", "rustic", "silent", "silver", "steady", "sunny", "swift", "tender", "vivid",
)
_NOUNS = (
    "anchor", "badger", "beacon", "canyon", "castle", "comet", "compass", "falcon", "forest",
    "garden", "glacier", "harbor", "island", "kettle", "lantern", "meadow", "mirror", "orchard",
    "otter", "pebble", "pepper", "planet", "quarry", "river", "rocket", "saddle", "tiger",
    "tunnel", "valley", "violin", "walnut", "window", "wizard", "zephyr", "harvest", "lagoon",
)


class Task(StrEnum):
    NIAH_SINGLE = "niah_single"
    NIAH_MULTIKEY = "niah_multikey"
    NIAH_MULTIVALUE = "niah_multivalue"
    VARIABLE_TRACKING = "variable_tracking"


class Haystack(StrEnum):
    NOISE = "noise"
    PROSE = "prose"


class Placement(StrEnum):
    END = "end"
    BEFORE_CONTEXT = "before_context"
    BEFORE_FILLER = "before_filler"

    @property
    def question_aware(self) -> bool:
        return self is Placement.END


# Greedy tokens an answer may take (RULER's string match reads them all).
MAX_NEW_TOKENS = {
    Task.NIAH_SINGLE: 12,
    Task.NIAH_MULTIKEY: 12,
    Task.NIAH_MULTIVALUE: 46,  # a bulleted list of four 7-digit numbers takes about 42
    Task.VARIABLE_TRACKING: 30,
}


class PromptSpecInvalid(ValueError):
    """A prompt spec that cannot be built; the message names the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class PromptSpec:
    """What to build: one task instance of `length` tokens, seeded."""

    task: Task
    haystack: Haystack
    placement: Placement
    length: int
    depth: float  # where the asked needle sits (share of the haystack's tokens before it)
    seed: int
    filler_tokens: int = DEFAULT_FILLER_TOKENS

    def __post_init__(self) -> None:
        if not 0.0 <= self.depth <= 1.0:
            raise PromptSpecInvalid("depth", f"{self.depth} is not in [0, 1]")
        if self.length < 128:
            raise PromptSpecInvalid("length", f"{self.length} tokens cannot hold a task")
        if self.filler_tokens < 1:
            raise PromptSpecInvalid("filler_tokens", "must be >= 1")


@dataclass(frozen=True)
class Needle:
    """One inserted sentence, its depth, the value it carries, whether the question asks for
    it (False for a multi-key prompt's other keys), and its key ("" for variable tracking)."""

    text: str
    depth: float
    value: str
    answer: bool
    key: str = ""


@dataclass(frozen=True)
class RulerPrompt:
    """A built prompt: `ids` (exactly `spec.length` tokens) = prefix `ids[:cue_start]` + cue.

    Token spans are half-open `[start, stop)` into `ids`: each needle sentence, the value
    tokens inside it, the question and the haystack region."""

    spec: PromptSpec
    text: str
    ids: tuple[int, ...]
    cue_start: int
    answers: tuple[str, ...]
    needle_spans: tuple[tuple[int, int], ...]
    value_spans: tuple[tuple[int, int], ...]
    question_span: tuple[int, int]
    context_span: tuple[int, int]
    needles: tuple[Needle, ...]

    @property
    def prefix(self) -> tuple[int, ...]:
        return self.ids[: self.cue_start]

    @property
    def cue(self) -> tuple[int, ...]:
        return self.ids[self.cue_start :]

    @property
    def max_new_tokens(self) -> int:
        return MAX_NEW_TOKENS[self.spec.task]

    def needle_depths(self) -> tuple[float, ...]:
        """Measured depth of each needle: haystack tokens before it / haystack tokens."""
        start, stop = self.context_span
        return tuple((s - start) / (stop - start) for s, _ in self.needle_spans)


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's score: the share of expected values found in the output (case-insensitive)."""
    if not answers:
        raise ValueError("answers: must not be empty")
    text = prediction.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


def build_prompt(tokenizer: TextTokenizer, spec: PromptSpec) -> RulerPrompt:
    """The prompt of `spec` in `tokenizer`'s tokens (through its chat template if it has one)."""
    rng = random.Random(spec.seed)
    needles, question, answer_prefix, instruction = _task(spec, rng)
    units = _Units(spec.haystack, rng)
    filler = _filler(spec, tokenizer) if spec.placement is Placement.BEFORE_FILLER else ""
    layout = _Layout(tokenizer, spec, instruction, question, answer_prefix, needles, filler)
    return layout.locate(layout.fit(units))


# --- tasks -------------------------------------------------------------------------------


def _task(spec: PromptSpec, rng: random.Random) -> tuple[tuple[Needle, ...], str, str, str]:
    """(needles, question, answer prefix, instruction) of one task instance."""
    if spec.task is Task.VARIABLE_TRACKING:
        return _variable_tracking(spec, rng)
    keys = _distinct(rng, MULTIKEY_NEEDLES, lambda: f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}")
    count = MULTIVALUE_VALUES if spec.task is Task.NIAH_MULTIVALUE else 1
    values = _distinct(rng, MULTIKEY_NEEDLES + count, lambda: str(rng.randrange(10**6, 10**7)))
    key = keys[0]
    if spec.task is Task.NIAH_MULTIVALUE:
        needles = [
            Needle(NIAH_NEEDLE.format(key=key, value=v), (spec.depth + j / count) % 1.0, v, True,
                   key)
            for j, v in enumerate(values[:count])
        ]
        question = f"What are all the special magic numbers for {key}?"
        prefix = "Answer: The special magic numbers are"
        return tuple(needles), question, prefix, NIAH_INSTRUCTION
    needles = [Needle(NIAH_NEEDLE.format(key=key, value=values[0]), spec.depth, values[0], True,
                      key)]
    if spec.task is Task.NIAH_MULTIKEY:
        needles += [
            Needle(NIAH_NEEDLE.format(key=k, value=v), rng.random(), v, False, k)
            for k, v in zip(keys[1:], values[1:MULTIKEY_NEEDLES], strict=True)
        ]
    return tuple(needles), NIAH_QUESTION.format(key=key), NIAH_ANSWER_PREFIX, NIAH_INSTRUCTION


def _variable_tracking(
    spec: PromptSpec, rng: random.Random
) -> tuple[tuple[Needle, ...], str, str, str]:
    names = _distinct(rng, VT_VARIABLES, lambda: "".join(rng.choices(string.ascii_uppercase, k=5)))
    value = str(rng.randrange(10_000, 100_000))
    # The chain keeps its order; `depth` shifts it within the first 1/n of the context.
    depths = [(j + spec.depth) / VT_VARIABLES for j in range(VT_VARIABLES)]
    needles = [Needle(VT_FIRST.format(name=names[0], value=value), depths[0], names[0], True)]
    needles += [
        Needle(VT_HOP.format(name=names[j], previous=names[j - 1]), depths[j], names[j], True)
        for j in range(1, VT_VARIABLES)
    ]
    # RULER's wording ("Find all variables that are assigned the value ...", answer prefix
    # "... they are:") gets 0% from SmolLM2-135M with the full cache (it copies the
    # haystack); this one, chosen on tuning seeds, names part of the chain.
    question = (f"Question: Which variables are assigned the value {value}, directly or through "
                "other variables, in the text above? Name all of them.")
    prefix = f"Answer: The {VT_VARIABLES} variables are named"
    return tuple(needles), question, prefix, VT_INSTRUCTION


def _distinct(rng: random.Random, count: int, draw: Callable[[], str]) -> list[str]:
    chosen: list[str] = []
    while len(chosen) < count:
        candidate = draw()
        if candidate not in chosen:
            chosen.append(candidate)
    return chosen


# --- haystack ----------------------------------------------------------------------------


class _Units:
    """The haystack units of one prompt, drawn on demand (noise repeats; prose is shuffled
    whole paragraphs, never repeated within a prompt while any are left)."""

    def __init__(self, haystack: Haystack, rng: random.Random) -> None:
        self.haystack = haystack
        self.separator = " " if haystack is Haystack.NOISE else "\n\n"
        self._rng = rng
        self._drawn: list[str] = []
        self._pool: list[str] = []

    def __getitem__(self, index: int) -> str:
        while len(self._drawn) <= index:
            self._drawn.append(self._next())
        return self._drawn[index]

    def _next(self) -> str:
        if self.haystack is Haystack.NOISE:
            return NOISE_UNIT
        if not self._pool:
            self._pool = list(prose_paragraphs())
            self._rng.shuffle(self._pool)
        return self._pool.pop()


def _filler(spec: PromptSpec, tokenizer: TextTokenizer) -> str:
    """The shortest run of whole words, from a unit stream of its own (seed + 1), that takes
    at least `filler_tokens` tokens."""
    own = _Units(spec.haystack, random.Random(spec.seed + 1))
    units: list[str] = []
    while _count(tokenizer, own.separator.join(units)) < spec.filler_tokens:
        units.append(own[len(units)])
    words = own.separator.join(units).split(" ")
    low, high = 0, len(words)  # fewer than `low` words are short, `high` words are enough
    while high - low > 1:
        middle = (low + high) // 2
        enough = _count(tokenizer, " ".join(words[:middle])) >= spec.filler_tokens
        low, high = (low, middle) if enough else (middle, high)
    return " ".join(words[:high])


def _count(tokenizer: TextTokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0


# --- layout and exact fit ----------------------------------------------------------------


class _Layout:
    """Renders a context into the full prompt text and measures it in tokens."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        spec: PromptSpec,
        instruction: str,
        question: str,
        answer_prefix: str,
        needles: tuple[Needle, ...],
        filler: str,
    ) -> None:
        self.tokenizer, self.spec = tokenizer, spec
        self.instruction, self.question, self.answer_prefix = instruction, question, answer_prefix
        self.needles = tuple(sorted(needles, key=lambda n: n.depth))
        self.filler = filler

    def user_text(self, context: str) -> str:
        parts = {
            Placement.END: (self.instruction, context, self.question),
            Placement.BEFORE_CONTEXT: (self.instruction, self.question, context),
            Placement.BEFORE_FILLER: (self.instruction, context, self.question, self.filler),
        }[self.spec.placement]
        return "\n\n".join(parts)

    def render(self, context: str) -> str:
        """The whole prompt text: chat turn (or plain text), then the answer prefix."""
        user = self.user_text(context)
        if self.tokenizer.chat_template is None:
            return f"{user}\n\n{self.answer_prefix}"
        return self.tokenizer.render_chat([ChatMessage("user", user)]) + self.answer_prefix

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=self.tokenizer.chat_template is None)

    def context(self, units: _Units, count: int, partial: str, glue: str | None = None) -> str:
        """`count` whole units plus `partial` (after `glue`, default the unit separator), the
        needles between units at their depths."""
        pieces = [units[i] for i in range(count)]
        for offset, needle in enumerate(self.needles):
            pieces.insert(round(needle.depth * count) + offset, needle.text)
        text = units.separator.join(pieces)
        if not partial:
            return text
        return f"{text}{units.separator if glue is None else glue}{partial}" if text else partial

    def length(self, units: _Units, count: int, partial: str = "", glue: str | None = None) -> int:
        return len(self.encode(self.render(self.context(units, count, partial, glue))))

    def fit(self, units: _Units) -> str:
        """The context whose prompt has exactly `spec.length` tokens."""
        target = self.spec.length
        if self.length(units, 0) > target:
            raise PromptSpecInvalid("length", f"{target} tokens cannot hold the task's text")
        whole = self._whole_units(units, target)
        # A cut can fall where one more character adds two tokens; then another unit (or
        # one unit fewer, with a longer partial) gives a different boundary. When the
        # separator itself costs more tokens than are missing (prose: "\n\n" + a character
        # is 3), the partial continues the last unit after a space instead.
        for glue in (None, " "):
            for count in (whole, whole - 1):
                for shift in range(4):
                    source = units.separator.join((units[count + shift],
                                                   units[count + shift + 1]))
                    partial = self._partial(units, max(count, 0), source, target, glue)
                    if partial is not None:
                        return self.context(units, max(count, 0), partial, glue)
        raise PromptSpecInvalid("length", f"no cut of the haystack gives exactly {target} tokens")

    def _whole_units(self, units: _Units, target: int) -> int:
        """The most whole units whose prompt fits in `target` tokens (doubling, then bisection)."""
        high = 1
        while self.length(units, high) <= target:
            high *= 2
        low = high // 2 if high > 1 else 0
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.length(units, middle) <= target else (low, middle)
        return low

    def _partial(
        self, units: _Units, count: int, source: str, target: int, glue: str | None
    ) -> str | None:
        """A prefix of `source` that completes `count` units to exactly `target`, if any."""
        low, high = 0, len(source)  # a prefix of `low` chars fits in `target`, of `high` not
        if self.length(units, count, source, glue) <= target:
            return None
        while high - low > 1:
            middle = (low + high) // 2
            fits = self.length(units, count, source[:middle], glue) <= target
            low, high = (middle, high) if fits else (low, middle)
        return source[:low] if self.length(units, count, source[:low], glue) == target else None

    def locate(self, context: str) -> RulerPrompt:
        """Token ids of the prompt around `context`, and the spans of its parts."""
        text = self.render(context)
        ids = self.encode(text)
        assert len(ids) == self.spec.length, "fit() returned a context of another length"
        spans = _Spans(self.tokenizer, text, ids)
        user = self.user_text(context)
        user_at = text.index(user)
        context_at = user_at + user.index(context) if context else user_at
        needle_spans, value_spans = [], []
        for needle in self.needles:
            start = text.index(needle.text, context_at)
            needle_spans.append(spans.of(start, start + len(needle.text)))
            value_at = text.index(needle.value, start)
            value_spans.append(spans.of(value_at, value_at + len(needle.value)))
        question_at = text.index(self.question, user_at)
        return RulerPrompt(
            spec=self.spec,
            text=text,
            ids=tuple(ids),
            cue_start=len(ids) - CUE_TOKENS,
            answers=tuple(n.value for n in self.needles if n.answer),
            needle_spans=tuple(needle_spans),
            value_spans=tuple(value_spans),
            question_span=spans.of(question_at, question_at + len(self.question)),
            context_span=spans.of(context_at, context_at + len(context)),
            needles=self.needles,
        )


class _Spans:
    """Character offsets -> token indices of `ids` (the encoding of `text`)."""

    def __init__(self, tokenizer: TextTokenizer, text: str, ids: list[int]) -> None:
        special = tokenizer.chat_template is None
        encoding = tokenizer.backend.encode(text, add_special_tokens=special)
        self._shift = len(ids) - len(encoding.ids)  # a BOS TextTokenizer prepended itself
        assert self._shift in (0, 1) and list(encoding.ids) == ids[self._shift :]
        self._offsets = encoding.offsets

    def token_at(self, char: int) -> int:
        """The first token that ends after `char` (the token holding it, or the next one)."""
        for index, (_, stop) in enumerate(self._offsets):
            if stop > char:
                return index + self._shift
        return len(self._offsets) + self._shift

    def of(self, start: int, stop: int) -> tuple[int, int]:
        """Tokens overlapping characters `[start, stop)`."""
        return self.token_at(start), self.token_at(stop - 1) + 1
