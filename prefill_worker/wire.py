"""The prefill worker's RPC edge: a `PrefillRequest` is validated into a `PrefillCall` once, and
the typed results go back to protobuf here (receipt, ledger, sampling, response). Nothing
else in the worker touches protobuf except the handoff's descriptor to the decode worker."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from services.kvpolicy.ledger import Ledger
from services.kvpolicy.receipt import Receipt
from services.model import InvalidModelInput, SamplingParams
from services.policy.types import check_generation, check_request_id, check_sha256
from services.rpc.errors import InvalidArgument, reject_unknown_fields
from services.rpc.kvrelay.v1 import common_pb2, prefill_pb2

_ADDRESS = re.compile(r"[^\s/]+:\d{1,5}")
_WORKER_ID = re.compile(r"[!-.0-~]{1,128}")


@dataclass(frozen=True)
class RequestLimits:
    """What the loaded model accepts: token ids in [0, vocab_size), at most `max_prompt_tokens`."""

    vocab_size: int
    max_prompt_tokens: int


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
    sampling, max_tokens = sampling_from_proto(message.sampling, limits.vocab_size)
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


def sampling_from_proto(message: common_pb2.SamplingParams, vocab_size: int) -> tuple[SamplingParams, int]:
    """The runtime's sampling parameters and `max_tokens`. top_p 0 means 1 (no nucleus
    filtering) and seed 0 means unseeded, as on the decode worker, which samples the rest."""
    if not math.isfinite(message.temperature) or message.temperature < 0:
        raise InvalidArgument(f"{message.temperature} must be a finite number >= 0", field="sampling.temperature")
    if not math.isfinite(message.top_p) or not 0 <= message.top_p <= 1:
        raise InvalidArgument(f"{message.top_p} must be in [0, 1] (0 disables)", field="sampling.top_p")
    if message.max_tokens < 1:
        raise InvalidArgument(f"{message.max_tokens} must be >= 1", field="sampling.max_tokens")
    for index, token in enumerate(message.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{token} is not in [0, {vocab_size})", field=f"sampling.stop_token_ids[{index}]")
    try:
        params = SamplingParams(
            temperature=float(message.temperature),
            top_k=message.top_k,
            top_p=float(message.top_p) or 1.0,
            seed=message.seed or None,
            stop_token_ids=tuple(message.stop_token_ids),
        )
    except InvalidModelInput as exc:
        raise InvalidArgument(exc.reason, field=exc.field) from exc
    return params, message.max_tokens


def sampling_to_proto(params: SamplingParams, max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed or 0,
        max_tokens=max_tokens,
        stop_token_ids=list(params.stop_token_ids),
    )


def receipt_to_proto(receipt: Receipt, ledger: Ledger) -> common_pb2.Receipt:
    return common_pb2.Receipt(
        digest=receipt.digest,
        manifest_sha256=receipt.manifest_sha256,
        generations=common_pb2.Generations(
            request_generation=receipt.request_generation,
            state_generation=receipt.state_generation,
            parent_state_generation=receipt.parent_state_generation,
            cache_generation=receipt.cache_generation,
        ),
        frontier=receipt.frontier,
        position_origin=receipt.position_origin,
        retained_rows=ledger.visible_rows,
        omitted_rows=ledger.omitted_rows,
    )


def ledger_to_proto(ledger: Ledger, bytes_moved: int) -> common_pb2.Ledger:
    return common_pb2.Ledger(
        bytes_per_row=ledger.bytes_per_row,
        full_payload_bytes=ledger.full_payload_bytes,
        visible_payload_bytes=ledger.visible_payload_bytes,
        position_map_bytes=ledger.position_map_bytes,
        row_offsets_bytes=ledger.offsets_bytes,
        transaction_peak_bytes=ledger.transaction_peak_bytes,
        unique_demand_bytes=ledger.unique_kv_rows * ledger.bytes_per_row,
        query_expanded_demand_bytes=ledger.query_expanded_rows * ledger.bytes_per_row,
        bytes_moved=bytes_moved,
        page_summary_bytes=ledger.page_summary_bytes,
        host_tier_bytes=ledger.host_tier_bytes,
    )


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
