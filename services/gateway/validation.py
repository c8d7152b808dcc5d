"""Validation of a client's `GenerateRequest`: one pure function from the wire message to a
`GenerationInput`, raising `InvalidArgument` that names the offending field (the proto's
field path, e.g. `sampling.top_p`, `token_ids.ids[3]` or `chat.messages[2].role`). Nothing
reaches a worker before every field passed. Sampling is the runtime's one type
(`services.model.sampler.SamplingParams`) checked with its one rule set (`check_sampling`), the
same function the prefill and decode workers re-check it with.

A chat prompt is rendered with the served checkpoint's chat template (ending with the prompt
of an assistant turn) and tokenized as transformers' `apply_chat_template(tokenize=True)`
does; its request also stops at the template's end-of-turn tokens (ChatML's `<|im_end|>`),
besides the model's EOS ids the decode worker always stops at."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import grpc

from services.echo import echo
from services.kvpolicy.manifest import MAX_NAME_CHARS, is_policy_name
from services.policy.types import MAX_GENERATION, check_request_id
from services.rpc.errors import InvalidArgument, ServiceError, reject_unknown_fields
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2

if TYPE_CHECKING:
    from services.model.sampler import SamplingParams
    from services.model.tokenizer import ChatMessage

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Text is rejected before tokenizing when it could not fit even at this many characters, or
# UTF-8 bytes, per token (SmolLM2's longest token is 81 bytes, its typical one 4).
_MAX_CHARS_PER_TOKEN = 64
_MAX_BYTES_PER_TOKEN = 64


class PromptTokenizer(Protocol):
    """What validation needs of the served checkpoint's tokenizer (`TextTokenizer` is one)."""

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]: ...

    def end_of_turn_ids(self) -> tuple[int, ...]: ...


class ChatUnsupported(ServiceError):
    """A well-formed chat request to a checkpoint without a chat template: the deployment,
    not the request, lacks what rendering needs (FAILED_PRECONDITION, field `chat`)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = common_pb2.ERROR_REASON_REQUEST_INVALID


@dataclass(frozen=True)
class RequestLimits:
    """What the served checkpoint and the deployment allow."""

    vocab_size: int
    context_length: int
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    max_chat_messages: int = 256

    def __post_init__(self) -> None:
        if not 0 < self.max_prompt_tokens < self.context_length:
            raise ValueError(
                f"max_prompt_tokens: {self.max_prompt_tokens} is not in (0, context_length="
                f"{self.context_length})"
            )
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens: must be in (0, max_tokens_limit]")
        if self.max_chat_messages <= 0:
            raise ValueError(f"max_chat_messages: {self.max_chat_messages} must be > 0")


@dataclass(frozen=True)
class ManifestChoice:
    """Which manifest the client asked for: by sha256, or by name and generation (0 = latest).
    Neither set means the deployment's default policy."""

    sha256: str = ""
    name: str = ""
    policy_generation: int = 0

    @property
    def is_default(self) -> bool:
        return not self.sha256 and not self.name


@dataclass(frozen=True)
class GenerationInput:
    """A request that passed validation. `max_tokens` counts every output token."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    manifest: ManifestChoice
    detokenize: bool


def validate_request(
    request: gateway_pb2.GenerateRequest,
    limits: RequestLimits,
    tokenizer: PromptTokenizer,
    new_request_id: Callable[[], str] = lambda: f"gen-{uuid.uuid4().hex}",
    *,
    zero_max_tokens_is_default: bool = False,
) -> GenerationInput:
    """Check every field of `request`; `tokenizer` tokenizes a text prompt and renders a chat.
    `zero_max_tokens_is_default`: a `sampling.max_tokens` of 0 takes the gateway's default (the
    HTTP front's requests that name no max_tokens but other sampling); over gRPC 0 is refused."""
    reject_unknown_fields(request)
    request_id = request.request_id or new_request_id()
    check_request_id(request_id)
    prompt = _prompt(request, limits, tokenizer)
    end_of_turn = tokenizer.end_of_turn_ids() if request.WhichOneof("prompt") == "chat" else ()
    sampling, max_tokens = _sampling(request, limits, len(prompt), end_of_turn, zero_max_tokens_is_default)
    return GenerationInput(
        request_id=request_id,
        prompt_ids=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        manifest=_manifest(request),
        detokenize=request.detokenize,
    )


def _prompt(
    request: gateway_pb2.GenerateRequest, limits: RequestLimits, tokenizer: PromptTokenizer
) -> tuple[int, ...]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("set one of text, token_ids or chat", field="prompt")
    if kind == "text":
        ids, field = _encode_text(request.text, limits, tokenizer), "text"
    elif kind == "chat":
        ids, field = _encode_chat(request.chat, limits, tokenizer), "chat"
    else:
        ids, field = tuple(request.token_ids.ids), "token_ids.ids"
        if not ids:
            raise InvalidArgument("must not be empty", field=field)
        _check_length(len(ids), limits, field)  # before a per-id loop over a huge list
        _check_token_ids(ids, limits.vocab_size, field)
    _check_length(len(ids), limits, field)
    return ids


def check_prompt_size(request: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Refuse a prompt too large to fit `limits.max_prompt_tokens` whatever its tokenization
    (characters and UTF-8 bytes per token; token ids by count), naming its field. Cheap, and
    done again by `validate_request`: the gateway calls it before handing a big prompt to a
    tokenizer thread."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        _check_size((request.text,), limits, "text")
    elif kind == "chat":
        # Over the message limit, `validate_request` refuses the count; only that many are summed.
        contents = [m.content for m in request.chat.messages[: limits.max_chat_messages + 1]]
        _check_size(contents, limits, "chat.messages")
    elif kind == "token_ids":
        _check_length(len(request.token_ids.ids), limits, "token_ids.ids")


def _encode_text(text: str, limits: RequestLimits, tokenizer: PromptTokenizer) -> tuple[int, ...]:
    if not text.strip():
        raise InvalidArgument("must not be empty", field="text")
    _check_size((text,), limits, "text")
    return tuple(tokenizer.encode(text))


def _encode_chat(
    chat: gateway_pb2.ChatMessages, limits: RequestLimits, tokenizer: PromptTokenizer
) -> tuple[int, ...]:
    # Imported here: the `services.model` package imports torch, and `services.gateway`
    # (whose __init__ imports this module) must stay light for the CLI's client.
    from services.model.tokenizer import ChatTemplateError

    messages = _chat_messages(chat, limits)
    if tokenizer.chat_template is None:
        raise ChatUnsupported(
            "the served checkpoint has no chat template; send text or token_ids", field="chat"
        )
    try:
        return tuple(tokenizer.encode_chat(messages))
    except ChatTemplateError as error:  # e.g. a template that raise_exception()s on role order
        reason = f"the chat template rejected these messages: {error.reason}"
        raise InvalidArgument(reason, field="chat") from error


def _chat_messages(
    chat: gateway_pb2.ChatMessages, limits: RequestLimits
) -> tuple[ChatMessage, ...]:
    from services.model.tokenizer import CHAT_ROLES, ChatMessage  # see _encode_chat

    field = "chat.messages"
    if not chat.messages:
        raise InvalidArgument("must hold at least one message", field=field)
    if len(chat.messages) > limits.max_chat_messages:
        count, limit = len(chat.messages), limits.max_chat_messages
        raise InvalidArgument(f"{count} messages exceeds the limit of {limit}", field=field)
    for index, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(f"{message.role!r} is not one of {', '.join(CHAT_ROLES)}",
                                  field=f"{field}[{index}].role")
        if not message.content.strip():
            raise InvalidArgument("must not be empty", field=f"{field}[{index}].content")
    _check_size([message.content for message in chat.messages], limits, field)
    return tuple(ChatMessage(message.role, message.content) for message in chat.messages)


def _check_size(texts: Sequence[str], limits: RequestLimits, field: str) -> None:
    """Characters first (free), then UTF-8 bytes (one pass in C, no tokenizing)."""
    characters = sum(len(text) for text in texts)
    if characters > limits.max_prompt_tokens * _MAX_CHARS_PER_TOKEN:
        raise InvalidArgument(
            f"{characters} characters cannot fit the model maximum of "
            f"{limits.max_prompt_tokens} tokens",
            field=field,
        )
    size = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
    if size > limits.max_prompt_tokens * _MAX_BYTES_PER_TOKEN:
        raise InvalidArgument(
            f"{size} UTF-8 bytes cannot fit the model maximum of {limits.max_prompt_tokens} tokens"
            f" (at most {limits.max_prompt_tokens * _MAX_BYTES_PER_TOKEN} bytes)",
            field=field,
        )


def _check_length(tokens: int, limits: RequestLimits, field: str) -> None:
    if tokens > limits.max_prompt_tokens:
        raise InvalidArgument(f"{tokens} tokens exceeds the model maximum of {limits.max_prompt_tokens}", field=field)


def _check_token_ids(ids: tuple[int, ...], vocab_size: int, field: str) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{token} is not a token id in [0, {vocab_size})", field=f"{field}[{index}]")


def _sampling(
    request: gateway_pb2.GenerateRequest,
    limits: RequestLimits,
    prompt_len: int,
    end_of_turn: Sequence[int],
    zero_max_tokens_is_default: bool = False,
) -> tuple[SamplingParams, int]:
    """The request's sampling and max_tokens; `end_of_turn` ids join its stop ids (after the
    client's own), and the stop ids the workers get are the ones checked."""
    # Imported here, as in _encode_chat: `services.model` imports torch.
    from dataclasses import replace

    from services.model.errors import InvalidModelInput
    from services.model.sampler import SamplingLimits, SamplingParams, check_sampling
    from services.transfer.codec import sampling_from_proto

    room = limits.context_length - prompt_len
    bounds = SamplingLimits(limits.vocab_size, max_tokens=min(limits.max_tokens_limit, room))
    try:
        if request.HasField("sampling"):
            params, max_tokens = sampling_from_proto(request.sampling)
            if max_tokens == 0 and zero_max_tokens_is_default:
                max_tokens = min(limits.default_max_tokens, room)
        else:
            params, max_tokens = SamplingParams(), min(limits.default_max_tokens, room)
        stops = params.stop_token_ids
        turn_ends = tuple(t for t in dict.fromkeys(end_of_turn) if t not in stops)
        params = replace(params, stop_token_ids=stops + turn_ends)
        check_sampling(params, max_tokens, bounds)
    except InvalidModelInput as exc:
        reason = exc.reason
        if exc.field == "sampling.max_tokens":
            reason += (f" (the limit is {limits.max_tokens_limit}; a prompt of {prompt_len} tokens leaves"
                       f" {room} of the model's {limits.context_length})")
        raise InvalidArgument(reason, field=exc.field) from exc
    return params, max_tokens


def _manifest(request: gateway_pb2.GenerateRequest) -> ManifestChoice:
    if not request.HasField("manifest"):
        return ManifestChoice()
    kind = request.manifest.WhichOneof("selector")
    if kind == "sha256":
        sha = request.manifest.sha256
        if not _SHA256_HEX.fullmatch(sha):
            raise InvalidArgument(f"{echo(sha)} is not a lowercase hex SHA-256", field="manifest.sha256")
        return ManifestChoice(sha256=sha)
    if kind == "by_name":
        name, generation = request.manifest.by_name.name, request.manifest.by_name.policy_generation
        if len(name) > MAX_NAME_CHARS:
            raise InvalidArgument(f"{len(name)} characters exceeds the limit of {MAX_NAME_CHARS}",
                                  field="manifest.by_name.name")
        if not is_policy_name(name):
            raise InvalidArgument(f"{echo(name)} is not a policy name", field="manifest.by_name.name")
        if not 0 <= generation <= MAX_GENERATION:
            raise InvalidArgument(f"{generation} is not in [0, {MAX_GENERATION}] (0 = latest)",
                                  field="manifest.by_name.policy_generation")
        return ManifestChoice(name=name, policy_generation=generation)
    return ManifestChoice()
