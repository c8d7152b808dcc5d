"""An OpenAI request body to the gateway's own `GenerateRequest`, and the gateway's field
names back to OpenAI parameter names for errors.

The body is parsed strictly (`schema`); what the gateway validates for gRPC clients it
validates here too, by the same function (`PromptValidator.validate`), after this module
has translated the parameters: `messages` -> `chat`, `prompt` -> `text` or `token_ids`,
`temperature`/`top_p`/`seed`/`max_tokens` -> `sampling`, `kv_policy` -> `manifest`. Only
what the wire types cannot say is checked here: parameters the gateway lacks (`n`, `stop`,
`stream_options`), and values its encoding would misread (`top_p` 0, which means "unset"
on the wire; `seed` 0, which means unseeded there, so an HTTP seed s travels as s + 1).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

import pydantic

from services.echo import echo, truncated
from services.gateway.openai_api.schema import ChatCompletionRequest, CompletionRequest
from services.gateway.openai_api.stops import check_stops
from services.rpc.errors import InvalidArgument, NotFound
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2

Kind = Literal["chat", "completion"]
INT32_MAX = 2**31 - 1
SEED_MAX = 2**64 - 2  # s + 1 must fit the wire's uint64
# OpenAI's default sampling temperature when a request names none.
DEFAULT_TEMPERATURE = 1.0
SHA256_PREFIX = "sha256:"
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
# Names pydantic puts in an error location for the member of a union, not a field.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict"})
# Gateway field (prefix) -> OpenAI parameter, longest first.
_PARAMS = (
    ("chat.messages", "messages"),
    ("token_ids.ids", "prompt"),
    ("sampling.temperature", "temperature"),
    ("sampling.top_p", "top_p"),
    ("sampling.seed", "seed"),
    ("sampling.stop_token_ids", "stop"),
    ("manifest", "kv_policy"),
    ("chat", "messages"),
    ("text", "prompt"),
)


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed body: the gateway request it becomes and what only the HTTP front uses."""

    kind: Kind
    generate: gateway_pb2.GenerateRequest
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    max_tokens_param: str
    user: str | None

    def param(self, field: str) -> str:
        """The OpenAI parameter a gateway error `field` names."""
        return openai_param(field, self.max_tokens_param)


def openai_param(field: str, max_tokens_param: str = "max_tokens") -> str:
    if field == "sampling.max_tokens":
        return max_tokens_param
    for prefix, param in _PARAMS:
        if field == prefix or field.startswith((f"{prefix}.", f"{prefix}[")):
            # kv_policy is one string: the manifest selector's sub-fields are all of it.
            return param if param == "kv_policy" else param + field[len(prefix):]
    return field


def parse_body(raw: bytes, kind: Kind, model_name: str) -> OpenAIRequest:
    """The request in `raw` (JSON), or InvalidArgument / NotFound naming the parameter."""
    body = _parse(raw, kind)
    if body.model != model_name:
        raise NotFound(f"the model {echo(body.model)} does not exist; this server serves {model_name!r}",
                       field="model")
    body.check_neutral()
    if body.n not in (None, 1):
        raise InvalidArgument(f"{echo(body.n)}: only n=1 is supported", field="n")
    if body.stream_options is not None and not body.stream:
        raise InvalidArgument("is only allowed with stream: true", field="stream_options")
    max_tokens_param, max_tokens = _max_tokens(body)
    generate = gateway_pb2.GenerateRequest(detokenize=True, sampling=_sampling(body, max_tokens))
    _set_prompt(generate, body)
    if body.kv_policy is not None:
        _set_policy(generate, body.kv_policy)
    return OpenAIRequest(kind, generate, check_stops(body.stop_strings()), body.stream,
                         bool(body.stream_options and body.stream_options.include_usage),
                         max_tokens_param, body.user)


def _parse(raw: bytes, kind: Kind) -> ChatCompletionRequest | CompletionRequest:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the body is not valid JSON: {echo(str(exc), 200)}") from None
    if not isinstance(data, dict):
        raise InvalidArgument("the body must be a JSON object")
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    try:
        return model.model_validate(data)
    except pydantic.ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        missing = error["type"] == "missing"
        reason = "is required" if missing else str(error["msg"])
        if error["type"] == "extra_forbidden":
            reason = "is not a parameter kvrelay knows"
        raise InvalidArgument(truncated(reason, 200), field=_location(error["loc"])) from None


def _location(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as a parameter path: `messages[2].content`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _UNION_TAGS and _IDENTIFIER.fullmatch(part):
            path += f".{part}" if path else part
    return path


def _max_tokens(body: ChatCompletionRequest | CompletionRequest) -> tuple[str, int]:
    """Which parameter named the output length, and its value (0: the gateway's default)."""
    named = [("max_tokens", body.max_tokens)]
    if isinstance(body, ChatCompletionRequest):
        named.append(("max_completion_tokens", body.max_completion_tokens))
    given = [(name, value) for name, value in named if value is not None]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise InvalidArgument("differs from max_tokens; send one of them", field="max_completion_tokens")
    if not given:
        return "max_tokens", 0
    name, value = given[-1]
    assert value is not None
    if not 1 <= value <= INT32_MAX:
        raise InvalidArgument(f"{echo(value)} must be a positive 32-bit integer", field=name)
    return name, value


def _sampling(body: ChatCompletionRequest | CompletionRequest, max_tokens: int) -> common_pb2.SamplingParams:
    if body.top_p is not None and body.top_p == 0.0:
        raise InvalidArgument("0.0 is not in (0, 1] (1 disables top-p)", field="top_p")
    if body.seed is not None and not 0 <= body.seed <= SEED_MAX:
        raise InvalidArgument(f"{echo(body.seed)} is not in [0, {SEED_MAX}]", field="seed")
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    return common_pb2.SamplingParams(
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=0 if body.seed is None else body.seed + 1,
        max_tokens=max_tokens,
    )


def _set_prompt(generate: gateway_pb2.GenerateRequest, body: ChatCompletionRequest | CompletionRequest) -> None:
    if isinstance(body, ChatCompletionRequest):
        generate.chat.SetInParent()  # an empty list is still a chat (and refused, naming messages)
        for message in body.messages:
            generate.chat.messages.add(role=message.role, content=message.text())
    elif isinstance(body.prompt, str):
        generate.text = body.prompt
    else:
        for index, token in enumerate(body.prompt):
            if not 0 <= token <= INT32_MAX:
                raise InvalidArgument(f"{echo(token)} is not a token id", field=f"prompt[{index}]")
        generate.token_ids.SetInParent()
        generate.token_ids.ids.extend(body.prompt)


def _set_policy(generate: gateway_pb2.GenerateRequest, policy: str) -> None:
    """A policy name (its latest generation), or `sha256:<hex>` for one manifest."""
    if policy.startswith(SHA256_PREFIX):
        generate.manifest.sha256 = policy[len(SHA256_PREFIX):]
    else:
        generate.manifest.by_name.name = policy
