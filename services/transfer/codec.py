"""The one proto <-> type codec of the transfer and of the prefill/decode control messages.

Every domain type crosses the wire here, once per hop, in both directions:

| type                                       | message                                   |
| ------------------------------------------ | ----------------------------------------- |
| `SamplingParams` and max_tokens            | `SamplingParams`                          |
| `Ledger`                                   | `Ledger`                                  |
| generations of a `Receipt` or state        | `Generations`                             |
| `TransferDescriptor` (e.g. a recall's rows) | `TransferDescriptor`, the transfer fields |
| `ViewHandoff` (a packed view, its receipt bindings, token 0, sampling, ledger, offload) | `TransferDescriptor`, every field |
| owner budgets `[L][H_owner]` and `PayloadDigest` of a handoff | `Receipt.owner_budgets` (row-major), `payload_hash`, `payload_digests` |

Wire conventions, mapped here and nowhere else: sampling top_p 0 means 1 (no nucleus
filtering) and seed 0 means unseeded; a descriptor's generations travel once, in its receipt;
a ledger travels as its row counts, and the byte fields written beside them must be what
`Ledger` computes from those counts. Parsing raises `DescriptorInvalid` naming the field by its
path in the message (`receipt.manifest_sha256`, `sampling.top_p`, `tensors[3].nbytes`), except
`sampling_from_proto`, which raises the sampler's `InvalidModelInput` (`sampling.top_p`).

It lives in `services/transfer` rather than `services/rpc`: the types it maps are the transfer's
(and the transfer's recall wire embeds a descriptor), while `services/rpc` — errors, stubs,
server bootstrap, imported by every layer — stays below all of them.
"""

from __future__ import annotations

from typing import Protocol

from services.kvpolicy.ledger import Ledger
from services.kvpolicy.manifest import RecoverabilityMode
from services.kvpolicy.receipt import PayloadDigest
from services.kvpolicy.state import BudgetGrid
from services.model.errors import InvalidModelInput
from services.model.sampler import SamplingParams
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer.descriptor import OffloadRef, PairRoute, TransferDescriptor, ViewHandoff
from services.transfer.errors import DescriptorInvalid
from services.transfer.layout import TensorSpec, dtype_from_name, layout_from_specs
from services.transfer.sidecar import sidecar_from_specs, split_specs

# Counted fields of a `Ledger`, named as in both the dataclass and the message.
_LEDGER_COUNTS = (
    "bytes_per_row", "num_layers", "num_owners", "prompt_rows", "visible_rows", "unique_kv_rows",
    "query_expanded_rows", "source_rows", "page_summary_bytes", "host_tier_bytes",
    "observation_bytes", "score_bytes", "score_workspace_bytes", "allocator_workspace_bytes",
    "selection_workspace_bytes", "compaction_workspace_bytes", "code_table_bytes",
)
# Byte fields of the message and the `Ledger` property each must equal.
_LEDGER_BYTES = {
    "full_payload_bytes": "full_payload_bytes",
    "visible_payload_bytes": "visible_payload_bytes",
    "position_map_bytes": "position_map_bytes",
    "row_offsets_bytes": "offsets_bytes",
    "transaction_peak_bytes": "transaction_peak_bytes",
    "unique_demand_bytes": "unique_demand_bytes",
    "query_expanded_demand_bytes": "query_expanded_demand_bytes",
}


class Generational(Protocol):
    """Anything that names one published state (a `Receipt`, a `KVPolicyState`)."""

    @property
    def request_generation(self) -> int: ...

    @property
    def state_generation(self) -> int: ...

    @property
    def parent_state_generation(self) -> int: ...

    @property
    def cache_generation(self) -> int: ...


# --- sampling ------------------------------------------------------------------------------


def sampling_to_proto(params: SamplingParams, max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed or 0,
        max_tokens=max_tokens,
        stop_token_ids=list(params.stop_token_ids),
    )


def sampling_from_proto(message: common_pb2.SamplingParams) -> tuple[SamplingParams, int]:
    """The sampling parameters and `max_tokens` of a wire message; InvalidModelInput names a
    value that breaks `check_sampling`'s value rules. The hop's limits are its caller's check."""
    params = SamplingParams(
        temperature=float(message.temperature),
        top_k=int(message.top_k),
        top_p=float(message.top_p) if message.top_p != 0.0 else 1.0,
        seed=int(message.seed) if message.seed else None,
        stop_token_ids=tuple(int(t) for t in message.stop_token_ids),
    )
    return params, int(message.max_tokens)


# --- ledger and generations ----------------------------------------------------------------


def ledger_to_proto(ledger: Ledger, *, bytes_moved: int = 0, recalled_bytes: int = 0) -> common_pb2.Ledger:
    """The ledger's counts and the bytes they imply, with what a transfer or recall measured."""
    message = common_pb2.Ledger(
        owners_are_query_heads=ledger.owners_are_query_heads,
        bytes_moved=bytes_moved,
        recalled_bytes=recalled_bytes,
    )
    for name in _LEDGER_COUNTS:
        setattr(message, name, getattr(ledger, name))
    for wire, prop in _LEDGER_BYTES.items():
        setattr(message, wire, getattr(ledger, prop))
    return message


def ledger_from_proto(message: common_pb2.Ledger, field: str = "ledger") -> Ledger:
    """The ledger of a wire message. DescriptorInvalid names a negative count
    (`ledger.visible_rows`), or `ledger` itself when a byte field disagrees with the counts."""
    counts = {name: int(getattr(message, name)) for name in _LEDGER_COUNTS}
    for name, value in counts.items():
        if value < 0:
            raise DescriptorInvalid(f"{field}.{name}", f"{value} is negative")
    ledger = Ledger(owners_are_query_heads=message.owners_are_query_heads, **counts)
    for wire, prop in _LEDGER_BYTES.items():
        if getattr(message, wire) != getattr(ledger, prop):
            raise DescriptorInvalid(
                field, f"{wire} is {getattr(message, wire)}, its row counts make {getattr(ledger, prop)}"
            )
    return ledger


def generations_to_proto(state: Generational, cache_generation: int | None = None) -> common_pb2.Generations:
    """The generations of `state`; `cache_generation` where the cache moved on since (decode)."""
    return common_pb2.Generations(
        request_generation=state.request_generation,
        state_generation=state.state_generation,
        parent_state_generation=state.parent_state_generation,
        cache_generation=state.cache_generation if cache_generation is None else cache_generation,
    )


# --- descriptors ---------------------------------------------------------------------------


def descriptor_to_proto(descriptor: TransferDescriptor) -> decode_pb2.TransferDescriptor:
    """The transfer's own fields: ids, receipt digest and generations, tensors in send order,
    route, trace context and, for a sidecar, the page size its summaries need."""
    return decode_pb2.TransferDescriptor(
        transfer_id=descriptor.transfer_id,
        request_id=descriptor.request_id,
        receipt=common_pb2.Receipt(
            digest=descriptor.receipt_digest,
            generations=common_pb2.Generations(
                request_generation=descriptor.request_generation,
                state_generation=descriptor.state_generation,
                cache_generation=descriptor.cache_generation,
            ),
        ),
        tensors=[
            common_pb2.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, nbytes=s.nbytes)
            for s in descriptor.tensors()
        ],
        rendezvous_address=descriptor.route.to_address(),
        rendezvous_secret=descriptor.route.secret,
        source_worker=descriptor.source_worker,
        trace_context=descriptor.trace_carrier(),
        page_size=descriptor.sidecar.page_size if descriptor.sidecar is not None else 0,
    )


def descriptor_from_proto(message: decode_pb2.TransferDescriptor) -> TransferDescriptor:
    """Parse and validate the transfer's own fields; DescriptorInvalid names the first bad one."""
    generations = message.receipt.generations
    specs = [TensorSpec(t.name, tuple(t.shape), t.dtype) for t in message.tensors]
    for index, (spec, wire) in enumerate(zip(specs, message.tensors, strict=True)):
        dtype_from_name(spec.dtype, f"tensors[{index}].dtype")
        if wire.nbytes != spec.nbytes:
            raise DescriptorInvalid(
                f"tensors[{index}].nbytes", f"{wire.nbytes} != {spec.nbytes} implied by shape and dtype"
            )
    view_specs, sidecar_specs = split_specs(specs)
    layout = layout_from_specs(view_specs)
    if sidecar_specs and message.page_size < 1:
        reason = f"{message.page_size}: the page summaries need a positive page size"
        raise DescriptorInvalid("page_size", reason)
    return TransferDescriptor(
        transfer_id=message.transfer_id,
        request_id=message.request_id,
        request_generation=generations.request_generation,
        state_generation=generations.state_generation,
        cache_generation=generations.cache_generation,
        receipt_digest=message.receipt.digest,
        source_worker=message.source_worker,
        route=PairRoute.parse(message.rendezvous_address, message.rendezvous_secret),
        layout=layout,
        trace_context=tuple(message.trace_context.items()),
        sidecar=sidecar_from_specs(sidecar_specs, message.page_size, layout.v_dtype),
    )


def handoff_to_proto(handoff: ViewHandoff) -> decode_pb2.TransferDescriptor:
    """The AcceptTransfer descriptor of a packed view: the transfer's fields, then every receipt
    binding, token 0, sampling, ledger (bytes_moved: what the tensors will move), what became
    of the omitted rows, prompt tokens and deadline."""
    message = descriptor_to_proto(handoff.descriptor)
    receipt = message.receipt
    receipt.manifest_sha256 = handoff.manifest_sha256
    receipt.generations.parent_state_generation = handoff.parent_state_generation
    receipt.frontier = handoff.frontier
    receipt.position_origin = handoff.position_origin
    receipt.retained_rows = handoff.ledger.visible_rows
    receipt.omitted_rows = handoff.ledger.omitted_rows
    receipt.owner_budgets.extend(budget for row in handoff.owner_budgets for budget in row)
    receipt.payload_hash = handoff.payload.hash
    receipt.payload_digests.extend(common_pb2.PayloadDigest(k=k, v=v) for k, v in handoff.payload.layers)
    message.first_token_id = handoff.first_token_id
    message.sampling.CopyFrom(sampling_to_proto(handoff.sampling, handoff.max_tokens))
    message.ledger.CopyFrom(ledger_to_proto(handoff.ledger, bytes_moved=handoff.ledger.traffic_bytes))
    message.prompt_tokens = handoff.prompt_tokens
    message.deadline_unix_ms = handoff.deadline_unix_ms
    offload = handoff.offload
    message.recoverability = offload.mode.value
    message.offload_handoff_id = offload.handoff_id
    message.offload_address = offload.address
    message.offload_lease_ms = offload.lease_ms
    message.offload_degraded = offload.degraded
    return message


def handoff_from_proto(message: decode_pb2.TransferDescriptor) -> ViewHandoff:
    """Parse and validate an AcceptTransfer descriptor; DescriptorInvalid names the first bad
    field. What depends on the receiving deployment (token ids against its vocabulary,
    `check_sampling` against its limits) is the receiver's to check."""
    descriptor = descriptor_from_proto(message)
    receipt = message.receipt
    if not message.HasField("ledger"):
        raise DescriptorInvalid("ledger", "is required: the bytes moved must equal it")
    ledger = ledger_from_proto(message.ledger)
    if receipt.retained_rows != descriptor.layout.total_rows:
        carried = descriptor.layout.total_rows
        raise DescriptorInvalid("receipt.retained_rows", f"{receipt.retained_rows}, the tensors carry {carried} rows")
    if receipt.omitted_rows != ledger.omitted_rows:
        reason = f"{receipt.omitted_rows}, the ledger omits {ledger.omitted_rows}"
        raise DescriptorInvalid("receipt.omitted_rows", reason)
    try:
        sampling, max_tokens = sampling_from_proto(message.sampling)
    except InvalidModelInput as exc:
        raise DescriptorInvalid(exc.field, exc.reason) from None
    return ViewHandoff(
        descriptor=descriptor,
        manifest_sha256=receipt.manifest_sha256,
        parent_state_generation=receipt.generations.parent_state_generation,
        frontier=receipt.frontier,
        position_origin=receipt.position_origin,
        first_token_id=message.first_token_id,
        sampling=sampling,
        max_tokens=max_tokens,
        prompt_tokens=message.prompt_tokens,
        ledger=ledger,
        owner_budgets=_budgets_from_proto(receipt, descriptor.layout.num_layers, descriptor.layout.num_owners),
        payload=PayloadDigest(receipt.payload_hash, tuple((d.k, d.v) for d in receipt.payload_digests)),
        deadline_unix_ms=message.deadline_unix_ms,
        offload=_offload_from_proto(message),
    )


def _budgets_from_proto(receipt: common_pb2.Receipt, num_layers: int, num_owners: int) -> BudgetGrid:
    """The row-major budgets as `[L][H_owner]`; DescriptorInvalid unless there is one per owner."""
    flat = [int(b) for b in receipt.owner_budgets]
    if len(flat) != num_layers * num_owners:
        reason = f"{len(flat)} entries, the layout has {num_layers} x {num_owners} owners"
        raise DescriptorInvalid("receipt.owner_budgets", reason)
    return tuple(tuple(flat[layer * num_owners : (layer + 1) * num_owners]) for layer in range(num_layers))


def _offload_from_proto(message: decode_pb2.TransferDescriptor) -> OffloadRef:
    name = message.recoverability or RecoverabilityMode.OMITTED_IRRECOVERABLE.value
    try:
        mode = RecoverabilityMode(name)
    except ValueError:
        allowed = [m.value for m in RecoverabilityMode]
        raise DescriptorInvalid("recoverability", f"{name!r} is not one of {allowed}") from None
    return OffloadRef(
        mode=mode,
        handoff_id=message.offload_handoff_id,
        address=message.offload_address,
        lease_ms=message.offload_lease_ms,
        degraded=message.offload_degraded,
    )
