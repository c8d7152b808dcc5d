"""Text <-> token ids through a checkpoint's `tokenizer.json` (HF `tokenizers`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from services.model.errors import InvalidModelConfig, MissingCheckpointFile

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded `tokenizer.json`; encode/decode are the only verbs the workers need."""

    backend: Tokenizer
    path: Path

    @classmethod
    def from_file(cls, path: Path) -> TextTokenizer:
        if not path.is_file():
            raise MissingCheckpointFile(path)
        try:
            return cls(backend=Tokenizer.from_file(str(path)), path=path)
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise InvalidModelConfig(TOKENIZER_FILE, f"cannot be parsed: {error}") from error

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's BOS/template when `add_special_tokens`)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """Id of a token string (e.g. '</s>'), or None when the vocabulary lacks it."""
        return self.backend.token_to_id(token)
