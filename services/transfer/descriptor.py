"""The transfer descriptor: what the prefill worker tells the decode worker over gRPC before
the tensors follow over torch.distributed.

A transfer is keyed by (request id, request generation, state generation, transfer id),
all read from the descriptor; the pair group that carries it is named by `PairRoute`, also
read from the descriptor, never derived by the two sides separately. `to_proto` and
`from_proto` are the only conversions to and from `kvrelay.v1.TransferDescriptor`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer.errors import DescriptorInvalid, TransferKey
from services.transfer.layout import TensorSpec, ViewLayout, dtype_from_name, layout_from_specs
from services.transfer.sidecar import SidecarLayout, sidecar_from_specs, split_specs

BACKENDS = ("gloo", "nccl")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_ADDRESS = re.compile(r"(?P<host>[^/\s]+):(?P<port>\d{1,5})/(?P<backend>[a-z]+)/(?P<epoch>\d{1,19})")


@dataclass(frozen=True)
class PairRoute:
    """The pair group that carries a transfer.

    `store_address` is the decode worker's TCPStore ("host:port"); `epoch` names one
    incarnation of the (sender, backend) group inside it. Epochs are random, not counters,
    so a restarted worker on either side can never meet a group it did not create.
    """

    store_address: str
    backend: str
    epoch: int

    def __post_init__(self) -> None:
        host, _, port = self.store_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
            raise DescriptorInvalid("rendezvous_address", f"{self.store_address!r} is not host:port")
        if self.backend not in BACKENDS:
            raise DescriptorInvalid("rendezvous_address.backend", f"{self.backend!r} not in {BACKENDS}")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or not 0 < self.epoch < 2**63:
            raise DescriptorInvalid("rendezvous_address.epoch", f"must be a positive int64, got {self.epoch!r}")

    @property
    def host(self) -> str:
        return self.store_address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.store_address.rpartition(":")[2])

    def to_address(self) -> str:
        """Wire form: "host:port/backend/epoch" (the proto's `rendezvous_address`)."""
        return f"{self.store_address}/{self.backend}/{self.epoch}"

    @classmethod
    def parse(cls, address: str) -> PairRoute:
        match = _ADDRESS.fullmatch(address)
        if match is None:
            raise DescriptorInvalid("rendezvous_address", f"{address!r} is not host:port/backend/epoch")
        return cls(f"{match['host']}:{match['port']}", match["backend"], int(match["epoch"]))


@dataclass(frozen=True)
class TransferDescriptor:
    """Everything the decode worker needs to receive one packed view and tie it to a state.

    `layout` fixes every tensor that travels (`tensors()` lists them in send order) and the
    rows of each layer, so layers can be sent as they are packed; `sidecar`, for recallable
    manifests, the page summaries (and host-tier rows) that follow the last layer.
    `trace_context` is a W3C text-map carrier (traceparent, tracestate), stored as sorted pairs.
    """

    transfer_id: str
    request_id: str
    request_generation: int
    state_generation: int
    cache_generation: int
    receipt_digest: str
    source_worker: str
    route: PairRoute
    layout: ViewLayout
    trace_context: tuple[tuple[str, str], ...] = ()
    sidecar: SidecarLayout | None = None

    def __post_init__(self) -> None:
        for name in ("transfer_id", "request_id", "source_worker"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or "/" in value:
                raise DescriptorInvalid(name, f"must be a non-empty string without '/', got {value!r}")
        for name in ("request_generation", "state_generation", "cache_generation"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DescriptorInvalid(name, f"must be a non-negative int, got {value!r}")
        if not isinstance(self.receipt_digest, str) or not _DIGEST.fullmatch(self.receipt_digest):
            raise DescriptorInvalid("receipt.digest", f"{self.receipt_digest!r} is not a lowercase SHA-256 hex digest")
        object.__setattr__(self, "trace_context", _carrier_pairs(self.trace_context))
        sidecar = self.sidecar
        if sidecar is not None and (sidecar.num_layers, sidecar.num_owners, sidecar.head_dim) != (
            self.layout.num_layers, self.layout.num_owners, self.layout.head_dim
        ):
            raise DescriptorInvalid("tensors", f"sidecar {sidecar} does not match the view layout {self.layout}")

    @property
    def key(self) -> TransferKey:
        return TransferKey(self.request_id, self.request_generation, self.state_generation, self.transfer_id)

    def tensors(self) -> tuple[TensorSpec, ...]:
        """Every message of the transfer, in send order: the view's layers, then the sidecar."""
        return self.layout.specs() + (self.sidecar.specs() if self.sidecar is not None else ())

    @property
    def nbytes(self) -> int:
        """Bytes the transfer moves: the view (payload and metadata) plus its sidecar."""
        return self.layout.nbytes + (self.sidecar.nbytes if self.sidecar is not None else 0)

    def trace_carrier(self) -> dict[str, str]:
        """The trace context as the dict an OpenTelemetry propagator reads."""
        return dict(self.trace_context)


def to_proto(descriptor: TransferDescriptor) -> decode_pb2.TransferDescriptor:
    """The wire message. Fields this layer does not own (first token, sampling, ledger,
    recoverability and offload handoff, prompt tokens, deadline) are left for the caller to
    set; the page size travels here because the sidecar's summaries need it."""
    return decode_pb2.TransferDescriptor(
        transfer_id=descriptor.transfer_id,
        request_id=descriptor.request_id,
        request_generation=descriptor.request_generation,
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
        source_worker=descriptor.source_worker,
        trace_context=descriptor.trace_carrier(),
        page_size=descriptor.sidecar.page_size if descriptor.sidecar is not None else 0,
    )


def from_proto(message: decode_pb2.TransferDescriptor) -> TransferDescriptor:
    """Parse and validate a wire descriptor; DescriptorInvalid names the first bad field."""
    generations = message.receipt.generations
    if generations.request_generation != message.request_generation:
        raise DescriptorInvalid(
            "receipt.generations.request_generation",
            f"{generations.request_generation} != request_generation {message.request_generation}",
        )
    specs = [TensorSpec(t.name, tuple(t.shape), t.dtype) for t in message.tensors]
    for index, (spec, wire) in enumerate(zip(specs, message.tensors, strict=True)):
        dtype_from_name(spec.dtype, f"tensors[{index}].dtype")
        if wire.nbytes != spec.nbytes:
            raise DescriptorInvalid(f"tensors[{index}].nbytes", f"{wire.nbytes} != {spec.nbytes} implied by shape and dtype")
    view_specs, sidecar_specs = split_specs(specs)
    layout = layout_from_specs(view_specs)
    if sidecar_specs and message.page_size < 1:
        raise DescriptorInvalid("page_size", f"{message.page_size}: the page summaries need a positive page size")
    return TransferDescriptor(
        transfer_id=message.transfer_id,
        request_id=message.request_id,
        request_generation=message.request_generation,
        state_generation=generations.state_generation,
        cache_generation=generations.cache_generation,
        receipt_digest=message.receipt.digest,
        source_worker=message.source_worker,
        route=PairRoute.parse(message.rendezvous_address),
        layout=layout,
        trace_context=tuple(message.trace_context.items()),
        sidecar=sidecar_from_specs(sidecar_specs, message.page_size, layout.v_dtype),
    )


def _carrier_pairs(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    pairs = tuple(sorted((k, v) for k, v in items))
    for key, value in pairs:
        if not isinstance(key, str) or not isinstance(value, str):
            raise DescriptorInvalid("trace_context", f"entries must be str -> str, got {key!r}: {value!r}")
    return pairs
