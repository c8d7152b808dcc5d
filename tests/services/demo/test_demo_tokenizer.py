"""The needle tokenizer: one token per word, ``<bos>`` prepended, lossless round trip."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

from services.demo import needle
from services.demo.needle import DocumentMix, Placement
from services.model.default import DEMO_CHECKPOINT


def test_every_word_is_one_token_with_its_vocabulary_index() -> None:
    tokenizer = needle.build_tokenizer()
    words = needle.vocabulary()
    assert tokenizer.get_vocab_size() == len(words)
    for index, word in enumerate(words):
        assert tokenizer.token_to_id(word) == index
    text = " ".join(needle.vocabulary()[4:])
    assert tokenizer.encode(text).ids == [1, *range(4, len(words))]


def test_prompts_and_documents_round_trip(tmp_path: Path) -> None:
    built = needle.build_tokenizer()
    built.save(str(tmp_path / "tokenizer.json"))
    loaded = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    vocab = {word: index for index, word in enumerate(needle.vocabulary())}
    texts = [needle.build_prompt(600, 0.4, p, seed=5).text for p in Placement]
    document = needle.build_training_sequence(DocumentMix(700, 0.5, 0.5), random.Random(2))
    texts.append(" ".join(document.words[1:]))
    for text in texts:
        for tokenizer in (built, loaded):
            ids = tokenizer.encode(text).ids
            assert ids == [vocab["<bos>"], *(vocab[word] for word in text.split())]
            assert tokenizer.decode(ids) == text
            assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos> " + text


def test_unknown_words_map_to_unk_and_punctuation_splits() -> None:
    tokenizer = needle.build_tokenizer()
    assert tokenizer.encode("what is the code of zebedee?").tokens == [
        "<bos>", "what", "is", "the", "code", "of", "<unk>", "?",
    ]


def test_committed_tokenizer_matches_the_language() -> None:
    committed = Tokenizer.from_file(str(DEMO_CHECKPOINT / "tokenizer.json"))
    assert committed.get_vocab() == needle.build_tokenizer().get_vocab()
    text = needle.build_prompt(512, 0.5, Placement.END, seed=9).text
    assert committed.encode(text).ids == needle.build_tokenizer().encode(text).ids
