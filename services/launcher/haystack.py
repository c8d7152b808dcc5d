"""A needle question over real English prose, for `kvrelay demo`.

The haystack is whole paragraphs of the Python language reference that every CPython ships
(`pydoc_data.topics`, the text behind `help("assignment")`), so the demo needs nothing
downloaded and reads the same on every machine. One sentence (the needle) states a fact that
appears nowhere else; it is placed between two paragraphs at a chosen depth, and the question
comes after the text, as a user would ask it:

    [system prompt of the template] user: "<instruction> <paragraphs ... needle ... paragraphs>
    Question: ..." assistant:

Paragraphs are unwrapped to single lines; grammar productions, code examples, tables and
headings are left out (they are not prose and would make the haystack repetitive).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

from services.model.tokenizer import ChatMessage

# The needle states a fact no paragraph of the reference mentions; the answer is its value.
NEEDLE = 'The secret passphrase of the archive is "{answer}".'
QUESTION = "What is the secret passphrase of the archive? Answer with the passphrase only."
INSTRUCTION = "Read the following text carefully; a question about it follows."
_WORDS = ("violet", "harbor", "amber", "falcon", "cedar", "meadow", "copper", "lantern", "willow",
          "granite", "orchid", "summit", "velvet", "comet", "maple", "silver")
_MIN_WORDS = 25  # shorter paragraphs are mostly captions and one-line notes


@dataclass(frozen=True)
class HaystackQuestion:
    """One question: the chat messages to send, the expected answer and where the needle is.

    `depth` is the fraction of the haystack's paragraphs before the needle; `context_tokens`
    the token count of the haystack alone (the needle and the question add a few dozen)."""

    messages: tuple[ChatMessage, ...]
    answer: str
    depth: float
    context_tokens: int
    paragraphs: int

    def correct(self, text: str) -> bool:
        """Whether a generated answer states the passphrase (case and spacing aside)."""
        return _normalize(self.answer) in _normalize(text)


def passphrase(rng: random.Random) -> str:
    """Two words and four digits, e.g. 'violet-harbor-7281'."""
    first, second = rng.sample(_WORDS, 2)
    return f"{first}-{second}-{rng.randrange(1000, 10000)}"


def build_question(
    count_tokens: Callable[[str], int], context_tokens: int, depth: float, seed: int
) -> HaystackQuestion:
    """A haystack of about `context_tokens` tokens (whole paragraphs, never fewer than two),
    the needle after `depth` of its paragraphs, and the question at the end.

    `count_tokens` measures text with the served checkpoint's tokenizer."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: {depth} is not in [0, 1]")
    if context_tokens <= 0:
        raise ValueError(f"context_tokens: {context_tokens} must be positive")
    rng = random.Random(seed)
    answer = passphrase(rng)
    chosen: list[str] = []
    used = 0
    for paragraph in _shuffled(rng):
        cost = count_tokens(paragraph + "\n\n")
        if len(chosen) >= 2 and used + cost > context_tokens:
            break
        chosen.append(paragraph)
        used += cost
    cut = round(depth * len(chosen))
    text = "\n\n".join([*chosen[:cut], NEEDLE.format(answer=answer), *chosen[cut:]])
    content = f"{INSTRUCTION}\n\n{text}\n\nQuestion: {QUESTION}"
    return HaystackQuestion((ChatMessage("user", content),), answer, depth, used, len(chosen))


def _shuffled(rng: random.Random) -> Iterator[str]:
    paragraphs = list(prose_paragraphs())
    rng.shuffle(paragraphs)
    yield from paragraphs


@cache
def prose_paragraphs() -> tuple[str, ...]:
    """Every prose paragraph of the language reference, unwrapped, in topic order."""
    from pydoc_data.topics import topics

    found: list[str] = []
    for name in sorted(topics):
        found.extend(p for p in _paragraphs(topics[name]) if p not in found)
    return tuple(found)


def _paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or any(_not_prose(line) for line in lines):
            continue
        paragraph = " ".join(line.strip() for line in lines)
        if len(paragraph.split()) >= _MIN_WORDS:
            yield paragraph


def _not_prose(line: str) -> bool:
    """Indented (code, grammar, nested lists), a heading underline, a table or a bullet."""
    return (line[:1].isspace() or re.fullmatch(r"[*=\-+|]+", line.strip()) is not None
            or line.lstrip().startswith(("*", "+", "|", ">>>", "...")))


def _normalize(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())
