"""The request bodies the HTTP front accepts: OpenAI's `/v1/chat/completions` and
`/v1/completions` parameters that kvrelay serves, plus the `kv_policy` extension.

Strict: a value of the wrong type is refused (a string where a number belongs is not
coerced), and so is a parameter kvrelay does not know. Parameters that OpenAI defines but
kvrelay does not implement are accepted only at their neutral value (`frequency_penalty: 0`,
`logprobs: false`, ...), so SDKs and harnesses that send defaults keep working while a
request that asks for the behaviour is refused naming the parameter (`check_neutral`).
Range rules live where the gRPC path keeps them (`services.gateway.validation`,
`services.model.sampler.check_sampling`); this module checks types and shapes only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from services.rpc.errors import InvalidArgument

_STRICT = ConfigDict(extra="forbid", strict=True)
# Defined by OpenAI, not implemented here: accepted only at these values (None = absent).
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "store": (None, False),
    "parallel_tool_calls": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    """One part of a message's content; only text parts exist for a text-only model."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = _STRICT
    role: str
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(BaseModel):
    """Parameters both endpoints share."""

    model_config = _STRICT
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    # kvrelay's extension: a policy name, or "sha256:<hex>" for one manifest.
    kv_policy: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None

    def check_neutral(self) -> None:
        """Refuse an OpenAI parameter kvrelay does not implement unless it asks for nothing."""
        for name, allowed in _NEUTRAL.items():
            value = getattr(self, name, None)
            if not any(value == neutral and type(value) is type(neutral) for neutral in allowed):
                raise InvalidArgument("is not supported by kvrelay (only its default is accepted)",
                                      field=name)

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ChatCompletionRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None


class CompletionRequest(_Common):
    # Text, or token ids of the served vocabulary (one prompt: n=1, no batches).
    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
