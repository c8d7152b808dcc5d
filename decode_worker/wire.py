"""Protobuf <-> decode worker values, converted once at the RPC edge.

`incoming_from_proto` turns an `AcceptTransferRequest`'s descriptor into an
`IncomingTransfer`: the transfer layer's `TransferDescriptor` (key, pair group, tensor
layout, sidecar) plus everything the decode side needs to verify, decode and recall — what
the receipt claims, the first token, the sampling parameters, the ledger and what became of
the omitted rows (`OffloadClaim`). Every malformed field raises `TransferInvalid` naming it
(dotted from the request: `descriptor.sampling.top_p`).

Sampling on the wire: temperature 0 = greedy; top_k 0 and top_p 0 (or 1) disable those
filters; seed 0 = unseeded; `max_tokens` counts every output token, the first one included.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

from decode_worker.errors import TransferInvalid
from services.kvpolicy.manifest import RecoverabilityMode
from services.model.errors import InvalidModelInput
from services.model.sampler import SamplingParams
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import DescriptorInvalid, TransferDescriptor, from_proto

_SHA256 = re.compile(r"[0-9a-f]{64}")
_ADDRESS = re.compile(r"[^\s/]+:\d{1,5}")
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ReceiptClaim:
    """What the descriptor's receipt claims: every value the digest binds except the position
    sets, which the decode worker reads from the view it actually received."""

    digest: str
    manifest_sha256: str
    request_id: str
    request_generation: int
    state_generation: int
    parent_state_generation: int
    cache_generation: int
    frontier: int
    position_origin: int

    @property
    def end(self) -> int:
        """Original position of the first token after the prompt (where decoding starts)."""
        return self.position_origin + self.frontier


@dataclass(frozen=True)
class LedgerClaim:
    """The prefill worker's byte ledger of the view (field names as in `kvrelay.v1.Ledger`)."""

    bytes_per_row: int = 0
    full_payload_bytes: int = 0
    visible_payload_bytes: int = 0
    position_map_bytes: int = 0
    row_offsets_bytes: int = 0
    transaction_peak_bytes: int = 0
    unique_demand_bytes: int = 0
    query_expanded_demand_bytes: int = 0
    bytes_moved: int = 0
    recalled_bytes: int = 0
    page_summary_bytes: int = 0
    host_tier_bytes: int = 0

    @property
    def traffic_bytes(self) -> int:
        """What a transfer of the view moves: payload, position map and offsets, plus the
        sidecar (page summaries, host-tier rows) of a recallable manifest."""
        metadata = self.position_map_bytes + self.row_offsets_bytes + self.page_summary_bytes
        return self.visible_payload_bytes + metadata + self.host_tier_bytes


@dataclass(frozen=True)
class OffloadClaim:
    """What became of the omitted rows, as the descriptor says.

    `mode` is what the decode worker may do: recall from the prefill worker's offload store
    (`recallable_remote`: `handoff_id` at `address`, renewed every so often within
    `lease_ms`), from the rows that came with the view (`recallable_local`), or nothing
    (`omitted_irrecoverable`; `degraded` says why when the manifest promised more).
    """

    mode: RecoverabilityMode = RecoverabilityMode.OMITTED_IRRECOVERABLE
    handoff_id: str = ""
    address: str = ""
    lease_ms: int = 0
    degraded: str = ""
    omitted_rows: int = 0

    @property
    def recallable(self) -> bool:
        return self.mode is not RecoverabilityMode.OMITTED_IRRECOVERABLE


@dataclass(frozen=True)
class IncomingTransfer:
    """One accepted transfer, as the decode worker sees it before anything arrived."""

    descriptor: TransferDescriptor
    receipt: ReceiptClaim
    first_token_id: int
    sampling: SamplingParams
    max_tokens: int
    prompt_tokens: int
    ledger: LedgerClaim | None
    deadline_unix_ms: int  # 0: none given
    offload: OffloadClaim = OffloadClaim()

    @property
    def nbytes(self) -> int:
        """Bytes the transfer moves (packed K/V, position map, offsets, sidecar)."""
        return self.descriptor.nbytes


def incoming_from_proto(
    message: decode_pb2.TransferDescriptor, *, vocab_size: int, max_new_tokens: int
) -> IncomingTransfer:
    """Parse and validate a wire descriptor; TransferInvalid names the first bad field."""
    try:
        descriptor = from_proto(message)
    except DescriptorInvalid as exc:
        raise TransferInvalid(exc.reason, field=f"descriptor.{exc.field}") from None
    ledger = _ledger(message) if message.HasField("ledger") else None
    if ledger is not None and ledger.traffic_bytes != descriptor.nbytes:
        raise TransferInvalid(
            f"payload + metadata + sidecar = {ledger.traffic_bytes} bytes, the tensors"
            f" listed move {descriptor.nbytes}",
            field="descriptor.ledger",
        )
    _check_token(message.first_token_id, vocab_size, "descriptor.first_token_id")
    if message.prompt_tokens < 0:
        raise TransferInvalid(f"{message.prompt_tokens} is negative", field="descriptor.prompt_tokens")
    if message.deadline_unix_ms < 0:
        raise TransferInvalid(f"{message.deadline_unix_ms} is negative", field="descriptor.deadline_unix_ms")
    return IncomingTransfer(
        descriptor=descriptor,
        receipt=_receipt(message, descriptor),
        first_token_id=message.first_token_id,
        sampling=sampling_from_proto(message.sampling, vocab_size, "descriptor.sampling"),
        max_tokens=_max_tokens(message.sampling.max_tokens, max_new_tokens),
        prompt_tokens=message.prompt_tokens,
        ledger=ledger,
        deadline_unix_ms=message.deadline_unix_ms,
        offload=offload_from_proto(message, descriptor),
    )


def offload_from_proto(message: decode_pb2.TransferDescriptor, descriptor: TransferDescriptor) -> OffloadClaim:
    """The descriptor's account of the omitted rows, consistent with the tensors it lists:
    summaries for a recallable mode, host-tier rows exactly for `recallable_local`, and a
    handoff (id, host:port, lease) exactly for `recallable_remote`."""
    name = message.recoverability or RecoverabilityMode.OMITTED_IRRECOVERABLE.value
    try:
        mode = RecoverabilityMode(name)
    except ValueError:
        allowed = [m.value for m in RecoverabilityMode]
        raise TransferInvalid(f"{name!r} is not one of {allowed}", field="descriptor.recoverability") from None
    sidecar = descriptor.sidecar
    recallable = mode is not RecoverabilityMode.OMITTED_IRRECOVERABLE
    if recallable != (sidecar is not None):
        raise TransferInvalid(f"{mode.value} {'needs' if recallable else 'carries no'} page summaries",
                              field="descriptor.tensors")
    local = mode is RecoverabilityMode.RECALLABLE_LOCAL
    if sidecar is not None and local != (sidecar.host_rows is not None):
        raise TransferInvalid(f"host-tier rows travel with recallable_local only, not {mode.value}",
                              field="descriptor.tensors")
    remote = mode is RecoverabilityMode.RECALLABLE_REMOTE
    if remote != bool(message.offload_handoff_id):
        raise TransferInvalid(f"a handoff id comes with recallable_remote only, not {mode.value}",
                              field="descriptor.offload_handoff_id")
    if remote and not _ADDRESS.fullmatch(message.offload_address):
        raise TransferInvalid(f"{message.offload_address!r} is not host:port", field="descriptor.offload_address")
    if remote and message.offload_lease_ms < 1:
        raise TransferInvalid(f"{message.offload_lease_ms} must be positive", field="descriptor.offload_lease_ms")
    if message.receipt.omitted_rows < 0:
        raise TransferInvalid(f"{message.receipt.omitted_rows} is negative", field="descriptor.receipt.omitted_rows")
    return OffloadClaim(
        mode=mode,
        handoff_id=message.offload_handoff_id,
        address=message.offload_address,
        lease_ms=message.offload_lease_ms,
        degraded=message.offload_degraded,
        omitted_rows=message.receipt.omitted_rows,
    )


def sampling_from_proto(message: common_pb2.SamplingParams, vocab_size: int, field: str) -> SamplingParams:
    """The model runtime's sampling parameters of a wire message (see the module docstring)."""
    if not math.isfinite(message.temperature):
        raise TransferInvalid(f"{message.temperature} is not finite", field=f"{field}.temperature")
    if not 0.0 <= message.top_p <= 1.0:
        raise TransferInvalid(f"{message.top_p} is not in [0, 1]", field=f"{field}.top_p")
    for index, token in enumerate(message.stop_token_ids):
        _check_token(token, vocab_size, f"{field}.stop_token_ids[{index}]")
    try:
        return SamplingParams(
            temperature=float(message.temperature),
            top_k=int(message.top_k),
            top_p=float(message.top_p) if message.top_p > 0.0 else 1.0,
            seed=int(message.seed) if message.seed else None,
            stop_token_ids=tuple(int(t) for t in message.stop_token_ids),
        )
    except InvalidModelInput as exc:
        name = exc.field.removeprefix("sampling.")
        raise TransferInvalid(exc.reason, field=f"{field}.{name}") from None


def ledger_to_proto(ledger: LedgerClaim | None, bytes_moved: int) -> common_pb2.Ledger:
    """The ledger echoed in the decode summary, with the bytes this worker actually received."""
    values = {f.name: getattr(ledger, f.name) for f in fields(LedgerClaim)} if ledger else {}
    return common_pb2.Ledger(**{**values, "bytes_moved": bytes_moved})


def _receipt(message: decode_pb2.TransferDescriptor, descriptor: TransferDescriptor) -> ReceiptClaim:
    receipt, generations = message.receipt, message.receipt.generations
    if not _SHA256.fullmatch(receipt.manifest_sha256):
        raise TransferInvalid(
            f"{receipt.manifest_sha256!r} is not a lowercase hex SHA-256", field="descriptor.receipt.manifest_sha256"
        )
    if descriptor.request_generation < 1:
        raise TransferInvalid("must be >= 1", field="descriptor.request_generation")
    if generations.state_generation != generations.parent_state_generation + 1:
        raise TransferInvalid(
            f"{generations.state_generation} is not parent_state_generation + 1"
            f" ({generations.parent_state_generation + 1})",
            field="descriptor.receipt.generations.state_generation",
        )
    for name in ("frontier", "position_origin"):
        if getattr(receipt, name) < 0:
            raise TransferInvalid(f"{getattr(receipt, name)} is negative", field=f"descriptor.receipt.{name}")
    if receipt.frontier == 0:
        raise TransferInvalid("a view to decode from covers at least one token", field="descriptor.receipt.frontier")
    return ReceiptClaim(
        digest=descriptor.receipt_digest,
        manifest_sha256=receipt.manifest_sha256,
        request_id=descriptor.request_id,
        request_generation=descriptor.request_generation,
        state_generation=descriptor.state_generation,
        parent_state_generation=generations.parent_state_generation,
        cache_generation=descriptor.cache_generation,
        frontier=receipt.frontier,
        position_origin=receipt.position_origin,
    )


def _ledger(message: decode_pb2.TransferDescriptor) -> LedgerClaim:
    values = {f.name: getattr(message.ledger, f.name) for f in fields(LedgerClaim)}
    for name, value in values.items():
        if value < 0:
            raise TransferInvalid(f"{value} is negative", field=f"descriptor.ledger.{name}")
    return LedgerClaim(**values)


def _max_tokens(value: int, limit: int) -> int:
    if not 1 <= value <= limit:
        raise TransferInvalid(f"{value} is not in [1, {limit}]", field="descriptor.sampling.max_tokens")
    return value


def _check_token(token: int, vocab_size: int, field: str) -> None:
    if not 0 <= token < min(vocab_size, _INT32_MAX):
        raise TransferInvalid(f"token id {token} is not in [0, {vocab_size})", field=field)

