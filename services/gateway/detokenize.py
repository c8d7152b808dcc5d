"""Incremental detokenization: the text delta each new token adds to the output.

Decoding a growing id list from scratch is quadratic, and decoding one id at a time loses
the spaces and multi-byte characters that depend on neighbours. Like vLLM's detokenizer,
this decodes a short window `ids[prefix:]` and emits what it adds beyond `ids[prefix:read]`,
holding text back while it ends in an incomplete character (U+FFFD). The deltas of a stream
concatenate to the decoding of all its ids, and carry no U+FFFD unless that decoding does
(bytes that are no UTF-8: an unrepresentable input character, or a model writing lone
continuation bytes). The one difference: replacement characters at the very end of a stream
stay held back, as a character that never completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; each call returns the new text (possibly empty)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids[:read] have been emitted

    def feed(self, token_id: int) -> str:
        self._ids.append(token_id)
        emitted = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) <= len(emitted) or window.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return window[len(emitted) :]
