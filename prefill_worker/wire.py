"""The prefill worker's RPC edge: a `PrefillRequest` is validated into a `PrefillCall` once
(proto -> types through `services.transfer.codec`, sampling re-checked with `check_sampling`).
What goes back out — the handoff to the decode worker, the response — is written by the same
codec (`prefill_worker.handoff`, `prefill_worker.service`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.model.errors import InvalidModelInput
from services.model.sampler import SamplingLimits, SamplingParams, check_sampling
from services.policy.types import check_generation, check_request_id, check_sha256
from services.rpc.errors import InvalidArgument, reject_unknown_fields
from services.rpc.kvrelay.v1 import common_pb2, prefill_pb2
from services.transfer.codec import sampling_from_proto

_ADDRESS = re.compile(r"[^\s/]+:\d{1,5}")
_WORKER_ID = re.compile(r"[!-.0-~]{1,128}")


@dataclass(frozen=True)
class RequestLimits:
    """What the loaded model accepts: token ids in [0, vocab_size), at most `max_prompt_tokens`,
    and a prompt plus its output tokens within `context_length`."""

    vocab_size: int
    max_prompt_tokens: int
    context_length: int


@dataclass(frozen=True)
class DecodeTarget:
    """The decode worker the gateway chose: gRPC `address` (host:port) and its `worker_id`."""

    address: str
    worker_id: str


@dataclass(frozen=True)
class PrefillCall:
    """A validated Prefill request. `max_tokens` travels to the decode worker; the first of
    those tokens is sampled here."""

    request_id: str
    request_generation: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    manifest_sha256: str
    decode: DecodeTarget
    trace_context: tuple[tuple[str, str], ...] = ()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def parse_prefill_request(message: prefill_pb2.PrefillRequest, limits: RequestLimits) -> PrefillCall:
    """Validate every field; InvalidArgument names the first bad one."""
    reject_unknown_fields(message)
    check_request_id(message.request_id)
    check_generation(message.request_generation, "request_generation", minimum=1)
    prompt = _prompt(list(message.prompt_token_ids), limits)
    check_sha256(message.manifest_sha256, "manifest_sha256")
    sampling, max_tokens = _sampling(message.sampling, limits, len(prompt))
    return PrefillCall(
        request_id=message.request_id,
        request_generation=message.request_generation,
        prompt_ids=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        manifest_sha256=message.manifest_sha256,
        decode=_decode_target(message.decode_worker_address, message.decode_worker_id),
        trace_context=tuple(sorted(message.trace_context.items())),
    )


def _sampling(
    message: common_pb2.SamplingParams, limits: RequestLimits, prompt_len: int
) -> tuple[SamplingParams, int]:
    """The call's sampling, re-checked with the gateway's own rule set: output tokens fit the
    model's context after the prompt, stop ids are in the vocabulary."""
    bounds = SamplingLimits(limits.vocab_size, max_tokens=limits.context_length - prompt_len)
    try:
        params, max_tokens = sampling_from_proto(message)
        check_sampling(params, max_tokens, bounds)
    except InvalidModelInput as exc:
        raise InvalidArgument(exc.reason, field=exc.field) from exc
    return params, max_tokens


def _prompt(ids: list[int], limits: RequestLimits) -> tuple[int, ...]:
    if not ids:
        raise InvalidArgument("must not be empty", field="prompt_token_ids")
    if len(ids) > limits.max_prompt_tokens:
        raise InvalidArgument(
            f"{len(ids)} tokens exceed the limit of {limits.max_prompt_tokens}", field="prompt_token_ids"
        )
    for index, token in enumerate(ids):
        if not 0 <= token < limits.vocab_size:
            raise InvalidArgument(f"{token} is not in [0, {limits.vocab_size})", field=f"prompt_token_ids[{index}]")
    return tuple(ids)


def _decode_target(address: str, worker_id: str) -> DecodeTarget:
    if not _ADDRESS.fullmatch(address):
        raise InvalidArgument(f"{address!r} is not host:port", field="decode_worker_address")
    if not _WORKER_ID.fullmatch(worker_id):
        raise InvalidArgument(
            f"{worker_id!r} must be 1-128 printable ASCII characters without '/' or spaces",
            field="decode_worker_id",
        )
    return DecodeTarget(address, worker_id)
