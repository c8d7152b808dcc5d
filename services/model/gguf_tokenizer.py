"""The tokenizer stored in GGUF metadata, rebuilt as an HF `tokenizers.Tokenizer`.

Only `tokenizer.ggml.model == "gpt2"` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen2) is
supported. The vocabulary is `tokenizer.ggml.tokens` (id = index), the merge ranks
`tokenizer.ggml.merges`; control tokens (token_type 3) become special added tokens and
user-defined ones (4) plain added tokens, both matched in the text before BPE, as llama.cpp does.
`tokenizer.ggml.pre` picks the pre-tokenizer split llama.cpp applies.

BOS follows the metadata: `encode(text)` prepends it only when `tokenizer.ggml.add_bos_token`
is true. transformers (5.2) prepends BOS to every GGUF tokenizer regardless, so the two agree
on `add_special_tokens=False` ids, not on the defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from services.model.errors import InvalidModelConfig
from services.model.gguf_metadata import GGUFMetadata
from services.model.tokenizer import TextTokenizer

PREFIX = "tokenizer.ggml."
CONTROL, USER_DEFINED = 3, 4
# llama.cpp's pre-tokenizer families (llama-vocab.cpp): the GPT-2 split, the GPT-2 split after
# isolating every digit, and the Llama 3 / Qwen2 splits (digits in runs of <= 3 / one by one).
_GPT2 = ("default", "gpt-2", "gpt2")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_REGEX_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
PRE_TOKENIZERS = _GPT2 + _DIGITS_THEN_GPT2 + tuple(_REGEX_SPLITS)


class GGUFTokenizerError(InvalidModelConfig):
    """The GGUF metadata does not describe a tokenizer this runtime can build."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, f"cannot build the tokenizer: {reason}")


def gguf_tokenizer(metadata: GGUFMetadata, path: Path) -> TextTokenizer | None:
    """The file's tokenizer, or None when the metadata carries none (no tokenizer.ggml.model)."""
    model = metadata.value(PREFIX + "model", required=False)
    if model is None:
        return None
    if model != "gpt2":
        raise GGUFTokenizerError(
            PREFIX + "model", f"{model!r} is not supported (only 'gpt2' byte-level BPE)"
        )
    tokens = _strings(metadata, PREFIX + "tokens")
    backend = byte_level_bpe(
        tokens,
        _merges(metadata),
        _token_types(metadata, len(tokens)),
        unk_token=_token(metadata, tokens, "unknown_token_id"),
        pre=metadata.string(PREFIX + "pre", "default"),
        add_prefix_space=bool(metadata.value(PREFIX + "add_space_prefix", False)),
    )
    template = metadata.value("tokenizer.chat_template", required=False)
    if template is not None and not isinstance(template, str):
        raise InvalidModelConfig("tokenizer.chat_template", "must be a string")
    return TextTokenizer(
        backend=backend,
        path=path,
        chat_template=template,
        bos_token=_token(metadata, tokens, "bos_token_id"),
        eos_token=_token(metadata, tokens, "eos_token_id"),
        add_bos=bool(metadata.value(PREFIX + "add_bos_token", False)),
    )


def byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[tuple[str, str]],
    token_types: Sequence[int],
    unk_token: str | None = None,
    pre: str = "default",
    add_prefix_space: bool = False,
) -> Tokenizer:
    """Byte-level BPE over `tokens` (id = index) with llama.cpp's `pre` split."""
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=list(merges), unk_token=unk_token))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre, add_prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tokens[i], special=kind == CONTROL, normalized=False)
        for i, kind in enumerate(token_types) if kind in (CONTROL, USER_DEFINED)
    ]
    tokenizer.add_special_tokens([token for token in added if token.special])
    tokenizer.add_tokens([token for token in added if not token.special])
    return tokenizer


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=add_prefix_space, trim_offsets=False, use_regex=pre not in _REGEX_SPLITS
    )
    if pre in _GPT2:
        return byte_level
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_SPLITS:
        split = pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    raise GGUFTokenizerError(
        PREFIX + "pre", f"pre-tokenizer {pre!r} is not one of {', '.join(PRE_TOKENIZERS)}"
    )


def _strings(metadata: GGUFMetadata, key: str) -> list[str]:
    values = metadata.value(key, required=False)
    if not values:
        raise GGUFTokenizerError(key, "missing or empty")
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise GGUFTokenizerError(key, "must be an array of strings")
    return values


def _merges(metadata: GGUFMetadata) -> list[tuple[str, str]]:
    merges = []
    for index, merge in enumerate(_strings(metadata, PREFIX + "merges")):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise GGUFTokenizerError(f"{PREFIX}merges[{index}]", f"{merge!r} is not 'left right'")
        merges.append((pair[0], pair[1]))
    return merges


def _token_types(metadata: GGUFMetadata, count: int) -> list[int]:
    key = PREFIX + "token_type"
    types = metadata.value(key, required=False)
    if types is None:
        return [1] * count
    if not isinstance(types, list) or len(types) != count:
        raise GGUFTokenizerError(key, f"must hold one type per token ({count})")
    return [int(t) for t in types]


def _token(metadata: GGUFMetadata, tokens: Sequence[str], name: str) -> str | None:
    """The token string of a `tokenizer.ggml.<name>` id, None when the key is absent."""
    index = metadata.optional_integer(PREFIX + name)
    if index is None:
        return None
    if not 0 <= index < len(tokens):
        raise GGUFTokenizerError(PREFIX + name, f"id {index} is outside the {len(tokens)} tokens")
    return tokens[index]
