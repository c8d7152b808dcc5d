"""Incremental detokenization: the deltas of a token stream concatenate to the decoding of all
its ids, for a word-level tokenizer (spaces between words) and a byte-level BPE whose tokens
split multi-byte characters (text is held back until a character is complete) — a small
trained one, and the real SmolLM2 tokenizer of the bundled GGUF over arbitrary text."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.demo import needle
from services.gateway.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer
from services.model.tokenizer import TextTokenizer


def stream(decode, ids: Sequence[int]) -> list[str]:  # type: ignore[no-untyped-def]
    detokenizer = IncrementalDetokenizer(decode)
    return [detokenizer.feed(token) for token in ids]


def test_word_level_deltas_carry_the_spaces() -> None:
    tokenizer = needle.build_tokenizer()
    ids = tokenizer.encode("the code of alice is 417 .", add_special_tokens=False).ids
    eos = tokenizer.token_to_id(needle.EOS)

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    deltas = stream(decode, [*ids[:3], eos, *ids[3:]])
    assert deltas[:3] == ["the", " code", " of"]
    assert deltas[3] == ""  # a special token adds no text
    assert "".join(deltas) == "the code of alice is 417 ." == decode(ids)


def byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["plain ascii words and more words"] * 20, trainer)
    return tokenizer


def test_split_multibyte_characters_are_held_back_until_complete() -> None:
    tokenizer = byte_level_bpe()
    text = "naïve café 東京 words"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text.split())  # the rare characters are split into byte tokens

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids))

    deltas = stream(decode, ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert "" in deltas  # some bytes waited for the rest of their character


# Text a real model writes and reads: words, runs of spaces and newlines, accents, CJK, emoji
# (4-byte, with skin tones, flags and ZWJ families), which SmolLM2's byte-level BPE splits
# across tokens — and any other code point, some of which its vocabulary cannot represent.
PIECES = st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from(
    ["東京", "日本語", "😀", "👍🏽", "🇫🇷", "👨‍👩‍👧", "𝔘", "é", "e\u0301", " Paris", "  ", "\n", "\n\n", "\t"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(PIECES, min_size=1, max_size=24).map("".join))
def test_smollm2_deltas_are_whole_characters_that_add_up(text: str, smollm2_tokenizer: TextTokenizer) -> None:
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    deltas, full = stream(smollm2_tokenizer.decode, ids), smollm2_tokenizer.decode(ids)
    streamed = "".join(deltas)
    if REPLACEMENT_CHAR not in full:  # every character survived tokenization
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
        assert streamed == full
    else:  # bytes that are no UTF-8 (e.g. U+40000: SmolLM2 has no token for byte 0xF1)
        assert full.startswith(streamed) and set(full[len(streamed):]) <= {REPLACEMENT_CHAR}


def test_smollm2_emoji_split_over_tokens_is_held_back_then_whole(smollm2_tokenizer: TextTokenizer) -> None:
    ids = smollm2_tokenizer.encode("ok 👨‍👩‍👧 東京", add_special_tokens=False)
    pieces = [smollm2_tokenizer.decode([token]) for token in ids]
    assert any(REPLACEMENT_CHAR in piece for piece in pieces)  # alone, some tokens are partial bytes
    deltas = stream(smollm2_tokenizer.decode, [*ids, smollm2_tokenizer.token_id("<|im_end|>")])
    assert "" in deltas[:-1] and deltas[-1] == ""  # waited for the rest; the end of turn adds no text
    assert "".join(deltas) == "ok 👨‍👩‍👧 東京"
