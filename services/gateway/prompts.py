"""Where a request's prompt is validated and tokenized: off the event loop when it is big.

Tokenizing half a megabyte of text takes a few hundred milliseconds; on the event loop that
stalls every other request the gateway serves. So a prompt longer than `INLINE_CHARS` is first
checked for size on the loop (cheap: characters and UTF-8 bytes against the context length,
INVALID_ARGUMENT naming the field) and then validated on one of a few threads (the tokenizer
releases the GIL there); short prompts are validated inline, never queued behind big ones.
At most `max_waiting` big prompts wait for a thread; more are refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from services.gateway.validation import (
    GenerationInput,
    PromptTokenizer,
    RequestLimits,
    check_prompt_size,
    validate_request,
)
from services.rpc.errors import ResourceExhausted
from services.rpc.kvrelay.v1 import gateway_pb2

# Below this many characters a prompt tokenizes in about a millisecond: not worth a thread hop.
INLINE_CHARS = 16 * 1024


def prompt_chars(request: gateway_pb2.GenerateRequest) -> int:
    """Characters of a text or chat prompt (0 for token ids); O(1) per message."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return len(request.text)
    if kind == "chat":
        return sum(len(message.content) for message in request.chat.messages)
    return 0


class PromptValidator:
    """`validate` a request on the loop or on one of `threads` tokenizer threads (by size)."""

    def __init__(
        self, limits: RequestLimits, tokenizer: PromptTokenizer, threads: int, max_waiting: int
    ) -> None:
        if threads < 1 or max_waiting < 0:
            raise ValueError(f"threads/max_waiting: need >= 1 / >= 0, got {threads}/{max_waiting}")
        self.limits = limits
        self.tokenizer = tokenizer
        self._capacity = threads + max_waiting
        self._admitted = 0
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="gateway-tokenize")

    @property
    def busy(self) -> int:
        """Big prompts being tokenized or waiting for a thread."""
        return self._admitted

    async def validate(
        self, request: gateway_pb2.GenerateRequest, *, zero_max_tokens_is_default: bool = False
    ) -> GenerationInput:
        """`validate_request`, with a big prompt size-checked here and tokenized on a thread."""
        check = functools.partial(validate_request, zero_max_tokens_is_default=zero_max_tokens_is_default)
        if prompt_chars(request) <= INLINE_CHARS:
            return check(request, self.limits, self.tokenizer)
        check_prompt_size(request, self.limits)
        if self._admitted >= self._capacity:
            raise ResourceExhausted(f"{self._admitted} large prompts are being tokenized; try again later",
                                    field=str(request.WhichOneof("prompt")))
        self._admitted += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._threads, check, request, self.limits, self.tokenizer)
        finally:
            self._admitted -= 1

    def close(self) -> None:
        """Drop prompts still waiting for a thread; those being tokenized finish on their own."""
        self._threads.shutdown(wait=False, cancel_futures=True)
