"""OpenAI response bodies built from the gateway's events (pure: values in, dicts out).

Non-streaming: one `chat.completion` / `text_completion` object. Streaming: chunks of the
same shapes (`chat.completion.chunk` deltas, `text_completion` texts), the last carrying the
finish reason, then — with `stream_options.include_usage` — a chunk with no choices and the
usage, as OpenAI sends it. `usage` counts prompt and completion tokens; the `kvrelay` object,
next to `usage` (and on the finishing chunk of a stream), carries the request's KV summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_api.convert import Kind
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_CHUNK_OBJECT = {"chat": "chat.completion.chunk", "completion": "text_completion"}
_ID_PREFIX = {"chat": "chatcmpl-", "completion": "cmpl-"}


@dataclass(frozen=True)
class Identity:
    """What every object of one response repeats."""

    kind: Kind
    request_id: str
    model: str
    created: int

    def head(self, chunk: bool) -> dict[str, Any]:
        objects = _CHUNK_OBJECT if chunk else _OBJECT
        return {"id": _ID_PREFIX[self.kind] + self.request_id, "object": objects[self.kind],
                "created": self.created, "model": self.model}


@dataclass
class Completion:
    """A response being assembled: its text so far and, at the end, the summary."""

    identity: Identity
    text: list[str] = field(default_factory=list)
    summary: gateway_pb2.GenerateSummary | None = None

    def finish_reason(self) -> str:
        assert self.summary is not None
        return _FINISH.get(self.summary.finish_reason, "stop")

    def body(self) -> dict[str, Any]:
        """The non-streaming response."""
        text = "".join(self.text)
        if self.identity.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=self.finish_reason())
        return {**self.identity.head(chunk=False), "choices": [choice], **self.usage()}

    def usage(self) -> dict[str, Any]:
        assert self.summary is not None
        return {"usage": usage(self.summary), "kvrelay": kvrelay_summary(self.summary)}


def first_chunk(identity: Identity) -> dict[str, Any] | None:
    """A chat stream opens with the assistant's role (an empty delta)."""
    if identity.kind != "chat":
        return None
    return _chunk(identity, {"role": "assistant", "content": ""}, None)


def text_chunk(identity: Identity, text: str) -> dict[str, Any]:
    return _chunk(identity, {"content": text}, None)


def finish_chunk(completion: Completion) -> dict[str, Any]:
    """The last choice chunk: the finish reason, and the kvrelay summary beside it."""
    assert completion.summary is not None
    chunk = _chunk(completion.identity, {}, completion.finish_reason())
    chunk["kvrelay"] = kvrelay_summary(completion.summary)
    return chunk


def usage_chunk(completion: Completion) -> dict[str, Any]:
    """`stream_options.include_usage`: no choices, the usage (and the kvrelay summary)."""
    return {**completion.identity.head(chunk=True), "choices": [], **completion.usage()}


def _chunk(identity: Identity, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    if identity.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": delta.get("content", "")}
    choice.update(logprobs=None, finish_reason=finish_reason)
    return {**identity.head(chunk=True), "choices": [choice]}


def usage(summary: gateway_pb2.GenerateSummary) -> dict[str, int]:
    return {"prompt_tokens": summary.prompt_tokens, "completion_tokens": summary.output_tokens,
            "total_tokens": summary.prompt_tokens + summary.output_tokens}


def kvrelay_summary(summary: gateway_pb2.GenerateSummary) -> dict[str, Any]:
    """The KV policy's side of the request: which manifest, the generations of the last
    published state, rows kept and left out, bytes moved, timings, where to find the trace."""
    generations = summary.generations
    return {
        "request_id": summary.request_id,
        "policy_sha256": summary.manifest_sha256,
        "generations": {
            "request": generations.request_generation,
            "state": generations.state_generation,
            "parent_state": generations.parent_state_generation,
            "cache": generations.cache_generation,
        },
        "retained_rows": summary.retained_rows,
        "omitted_rows": summary.omitted_rows,
        "recalled_rows": summary.recalled_rows,
        "bytes_moved": summary.bytes_moved,
        "ttft_ms": summary.ttft_ms,
        "tpot_ms": summary.tpot_ms,
        "fallbacks": list(summary.fallbacks),
        "trace_id": summary.trace_id,
        "prefill_worker": summary.prefill_worker,
        "decode_worker": summary.decode_worker,
        **({"retention": {f.name: getattr(summary.retention, f.name)
                          for f in summary.retention.DESCRIPTOR.fields}}
           if summary.HasField("retention") else {}),
    }
