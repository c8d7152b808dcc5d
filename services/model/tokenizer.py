"""Text <-> token ids through a checkpoint's tokenizer (HF `tokenizers`), and its chat template.

An HF directory carries `tokenizer.json` plus, optionally, a chat template in
`chat_template.jinja` or `tokenizer_config.json`; a GGUF file carries both in its metadata
(`services.model.gguf` builds the same `TextTokenizer` from it). The template is rendered the
way transformers renders it: Jinja2 in an immutable sandbox, `messages`, `add_generation_prompt`,
`bos_token`, `eos_token` and `raise_exception` in scope.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from services.model.errors import InvalidModelConfig, MissingCheckpointFile

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_ROLES = ("system", "user", "assistant")
# Tokens that close a turn in the chat templates of the families this runtime serves (ChatML,
# Llama 3, Gemma, Phi); one counts for a checkpoint when its template writes it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|eom_id|>")


class ChatTemplateError(InvalidModelConfig):
    """The checkpoint has no chat template, or its template failed on these messages."""

    def __init__(self, reason: str) -> None:
        super().__init__("chat_template", reason)


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation; the gateway validates role and content before rendering."""

    role: str
    content: str


@dataclass(frozen=True)
class TextTokenizer:
    """A loaded tokenizer; encode/decode/render_chat are the only verbs the workers need.

    `bos_token` / `eos_token` are the strings the chat template may reference; `add_bos`
    says whether `encode(..., add_special_tokens=True)` should prepend BOS when the backend
    does not already (GGUF's `tokenizer.ggml.add_bos_token`)."""

    backend: Tokenizer
    path: Path
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False

    @classmethod
    def from_file(cls, path: Path) -> TextTokenizer:
        """`tokenizer.json` at `path`, with the chat template and special tokens found beside it."""
        if not path.is_file():
            raise MissingCheckpointFile(path)
        try:
            backend = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on bad JSON
            raise InvalidModelConfig(TOKENIZER_FILE, f"cannot be parsed: {error}") from error
        settings = _read_tokenizer_config(path.parent)
        return cls(
            backend=backend,
            path=path,
            chat_template=_chat_template(path.parent, settings),
            bos_token=_token_string(settings.get("bos_token")),
            eos_token=_token_string(settings.get("eos_token")),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (with the tokenizer's BOS/template when `add_special_tokens`)."""
        # encode_batch releases the GIL (encode holds it), so a big prompt tokenized on a
        # thread does not stall the caller's event loop; the ids are the same.
        ids = list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        bos = self.token_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """Id of a token string (e.g. '</s>'), or None when the vocabulary lacks it."""
        return self.backend.token_to_id(token)

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` under the checkpoint's chat template."""
        if self.chat_template is None:
            raise ChatTemplateError("this checkpoint has no chat template; send text or token ids")
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as error:
            raise ChatTemplateError(f"rendering failed: {error}") from error

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat: special tokens in the template are parsed, no BOS added
        beyond what the template writes (transformers' `apply_chat_template(tokenize=True)`)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn besides the model's EOS ids (e.g. ChatML's `<|im_end|>`):
        the known end-of-turn tokens that this checkpoint's chat template writes."""
        template = self.chat_template or ""
        ids = (self.token_id(token) for token in END_OF_TURN_TOKENS if token in template)
        return tuple(sorted({i for i in ids if i is not None}))

    @cached_property
    def _template(self) -> Any:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_template_error
        try:
            return environment.from_string(self.chat_template or "")
        except TemplateError as error:
            raise ChatTemplateError(f"cannot be compiled: {error}") from error


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _read_tokenizer_config(root: Path) -> Mapping[str, Any]:
    path = root / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InvalidModelConfig(TOKENIZER_CONFIG_FILE, f"is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise InvalidModelConfig(TOKENIZER_CONFIG_FILE, "must hold a JSON object")
    return value


def _chat_template(root: Path, settings: Mapping[str, Any]) -> str | None:
    """`chat_template.jinja` (transformers >= 4.43 writes it) or tokenizer_config's field."""
    jinja = root / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise InvalidModelConfig(f"{TOKENIZER_CONFIG_FILE}:chat_template", "must be a string")
    return template


def _token_string(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
