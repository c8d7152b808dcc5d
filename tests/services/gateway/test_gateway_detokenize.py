"""Incremental detokenization: the deltas of a token stream concatenate to the decoding of all
its ids, for a word-level tokenizer (spaces between words) and a byte-level BPE whose tokens
split multi-byte characters (text is held back until a character is complete)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.gateway.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer
from services.model import needle


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
