"""Validation of a client's `GenerateRequest`: one pure function from the wire message to a
`GenerationInput`, raising `InvalidArgument` that names the offending field (the proto's
field path, e.g. `sampling.top_p` or `token_ids.ids[3]`). Nothing reaches a worker before
every field passed."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.policy.types import MAX_GENERATION, check_request_id
from services.rpc.errors import InvalidArgument, reject_unknown_fields
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2

# The manifest name rule of services.kvpolicy.manifest.
_POLICY_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# Text is rejected before tokenizing when it could not fit even at this many characters per token.
_MAX_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class RequestLimits:
    """What the served checkpoint and the deployment allow."""

    vocab_size: int
    context_length: int
    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.max_prompt_tokens < self.context_length:
            raise ValueError(
                f"max_prompt_tokens: {self.max_prompt_tokens} is not in (0, context_length="
                f"{self.context_length})"
            )
        if not 0 < self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError("default_max_tokens: must be in (0, max_tokens_limit]")


@dataclass(frozen=True)
class Sampling:
    """Validated sampling parameters, in the proto's conventions (temperature 0 = greedy,
    top_k 0 and top_p 0 or 1 disable those filters, seed 0 = the default stream)."""

    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def to_proto(self) -> common_pb2.SamplingParams:
        return common_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            max_tokens=self.max_tokens, stop_token_ids=list(self.stop_token_ids),
        )


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
    """A request that passed validation."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    manifest: ManifestChoice
    detokenize: bool


def validate_request(
    request: gateway_pb2.GenerateRequest,
    limits: RequestLimits,
    encode: Callable[[str], list[int]],
    new_request_id: Callable[[], str] = lambda: f"gen-{uuid.uuid4().hex}",
) -> GenerationInput:
    """Check every field of `request`; `encode` tokenizes a text prompt."""
    reject_unknown_fields(request)
    request_id = request.request_id or new_request_id()
    check_request_id(request_id)
    prompt = _prompt(request, limits, encode)
    return GenerationInput(
        request_id=request_id,
        prompt_ids=prompt,
        sampling=_sampling(request, limits, len(prompt)),
        manifest=_manifest(request),
        detokenize=request.detokenize,
    )


def _prompt(
    request: gateway_pb2.GenerateRequest, limits: RequestLimits, encode: Callable[[str], list[int]]
) -> tuple[int, ...]:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgument("set either text or token_ids", field="prompt")
    if kind == "text":
        ids, field = _encode_text(request.text, limits, encode), "text"
    else:
        ids, field = tuple(request.token_ids.ids), "token_ids.ids"
        if not ids:
            raise InvalidArgument("must not be empty", field=field)
        _check_token_ids(ids, limits.vocab_size, field)
    if len(ids) > limits.max_prompt_tokens:
        raise InvalidArgument(
            f"{len(ids)} tokens exceeds the model maximum of {limits.max_prompt_tokens}", field=field
        )
    return ids


def _encode_text(text: str, limits: RequestLimits, encode: Callable[[str], list[int]]) -> tuple[int, ...]:
    if not text.strip():
        raise InvalidArgument("must not be empty", field="text")
    if len(text) > limits.max_prompt_tokens * _MAX_CHARS_PER_TOKEN:
        raise InvalidArgument(
            f"{len(text)} characters cannot fit the model maximum of {limits.max_prompt_tokens} tokens",
            field="text",
        )
    return tuple(encode(text))


def _check_token_ids(ids: tuple[int, ...], vocab_size: int, field: str) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{token} is not a token id in [0, {vocab_size})", field=f"{field}[{index}]")


def _sampling(request: gateway_pb2.GenerateRequest, limits: RequestLimits, prompt_len: int) -> Sampling:
    if not request.HasField("sampling"):
        return Sampling(max_tokens=min(limits.default_max_tokens, limits.context_length - prompt_len))
    wire = request.sampling
    if not math.isfinite(wire.temperature) or wire.temperature < 0:
        raise InvalidArgument(f"{wire.temperature} must be finite and >= 0 (0 = greedy)", field="sampling.temperature")
    if wire.top_k < 0:
        raise InvalidArgument(f"{wire.top_k} must be >= 0 (0 disables top-k)", field="sampling.top_k")
    if not math.isfinite(wire.top_p) or not 0.0 <= wire.top_p <= 1.0:
        raise InvalidArgument(f"{wire.top_p} is not in [0, 1] (0 or 1 disables top-p)", field="sampling.top_p")
    _check_max_tokens(wire.max_tokens, limits, prompt_len)
    stops = tuple(wire.stop_token_ids)
    if len(stops) > limits.max_stop_token_ids:
        raise InvalidArgument(f"{len(stops)} ids exceeds the limit of {limits.max_stop_token_ids}",
                              field="sampling.stop_token_ids")
    _check_token_ids(stops, limits.vocab_size, "sampling.stop_token_ids")
    return Sampling(wire.max_tokens, wire.temperature, wire.top_k, wire.top_p, wire.seed, stops)


def _check_max_tokens(max_tokens: int, limits: RequestLimits, prompt_len: int) -> None:
    field = "sampling.max_tokens"
    if max_tokens <= 0:
        raise InvalidArgument(f"{max_tokens} must be > 0", field=field)
    if max_tokens > limits.max_tokens_limit:
        raise InvalidArgument(f"{max_tokens} exceeds the limit of {limits.max_tokens_limit}", field=field)
    if prompt_len + max_tokens > limits.context_length:
        raise InvalidArgument(
            f"prompt {prompt_len} + {max_tokens} tokens exceeds the model context of {limits.context_length}",
            field=field,
        )


def _manifest(request: gateway_pb2.GenerateRequest) -> ManifestChoice:
    if not request.HasField("manifest"):
        return ManifestChoice()
    kind = request.manifest.WhichOneof("selector")
    if kind == "sha256":
        sha = request.manifest.sha256
        if not _SHA256_HEX.fullmatch(sha):
            raise InvalidArgument(f"{sha!r} is not a lowercase hex SHA-256", field="manifest.sha256")
        return ManifestChoice(sha256=sha)
    if kind == "by_name":
        name, generation = request.manifest.by_name.name, request.manifest.by_name.policy_generation
        if not _POLICY_NAME.fullmatch(name):
            raise InvalidArgument(f"{name!r} is not a policy name", field="manifest.by_name.name")
        if not 0 <= generation <= MAX_GENERATION:
            raise InvalidArgument(f"{generation} is not in [0, {MAX_GENERATION}] (0 = latest)",
                                  field="manifest.by_name.policy_generation")
        return ManifestChoice(name=name, policy_generation=generation)
    return ManifestChoice()
