"""The transfer descriptor: what the prefill worker tells the decode worker over gRPC before
the tensors follow over torch.distributed.

A transfer is keyed by (request id, request generation, state generation, transfer id),
all read from the descriptor; the pair group that carries it is named by `PairRoute`, also
read from the descriptor, never derived by the two sides separately. `TransferDescriptor` is
what the transfer layer moves (a packed view, or a recall's rows); `ViewHandoff` is a packed
view offered to a decode worker: its descriptor plus what the decode worker verifies, decodes
and accounts against. Both cross the wire only through `services.transfer.codec`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.kvpolicy.ledger import Ledger
from services.kvpolicy.manifest import RecoverabilityMode
from services.kvpolicy.receipt import PayloadDigest, Receipt
from services.kvpolicy.state import BudgetGrid, PositionGrid
from services.model.sampler import SamplingParams
from services.transfer.errors import DescriptorInvalid, TransferKey
from services.transfer.layout import TensorSpec, ViewLayout
from services.transfer.sidecar import SidecarLayout

BACKENDS = ("gloo", "nccl")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_PAYLOAD_HEX = re.compile(r"[0-9a-f]{16,128}")  # a payload digest (xxh3-128: 32)
_HASH_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
_SECRET = re.compile(r"[0-9a-f]{64}")  # 32 random bytes, hex
_ADDRESS = re.compile(r"(?P<host>[^/\s]+):(?P<port>\d{1,5})/(?P<backend>[a-z]+)/(?P<epoch>\d{1,19})")


@dataclass(frozen=True)
class PairRoute:
    """The pair group that carries a transfer.

    `store_address` is the decode worker's TCPStore ("host:port"); `epoch` names one
    incarnation of the (sender, backend) group inside it. Epochs are random, not counters,
    so a restarted worker on either side can never meet a group it did not create.
    `secret` (32 random bytes, hex) is the group's key: the sender draws it with the epoch,
    it reaches the decode worker only inside the descriptor (over gRPC, never through the
    store), and both ranks prove they hold it before any tensor moves (`pairgroup`). It is
    left out of `repr` so that errors and logs never carry it.
    """

    store_address: str
    backend: str
    epoch: int
    secret: str = field(repr=False)

    def __post_init__(self) -> None:
        check_store_address(self.store_address)
        if self.backend not in BACKENDS:
            raise DescriptorInvalid("rendezvous_address.backend", f"{self.backend!r} not in {BACKENDS}")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or not 0 < self.epoch < 2**63:
            raise DescriptorInvalid("rendezvous_address.epoch", f"must be a positive int64, got {self.epoch!r}")
        if not isinstance(self.secret, str) or not _SECRET.fullmatch(self.secret):
            # The value is not echoed: a near-miss of a secret is still a secret.
            raise DescriptorInvalid("rendezvous_secret", "must be 64 lowercase hex digits")

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
    def parse(cls, address: str, secret: str) -> PairRoute:
        """The route of a wire `rendezvous_address` and `rendezvous_secret`."""
        match = _ADDRESS.fullmatch(address)
        if match is None:
            raise DescriptorInvalid("rendezvous_address", f"{address!r} is not host:port/backend/epoch")
        store_address = f"{match['host']}:{match['port']}"
        return cls(store_address, match["backend"], int(match["epoch"]), secret)


def check_store_address(address: str) -> None:
    """DescriptorInvalid unless `address` is a rendezvous store's "host:port"."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise DescriptorInvalid("rendezvous_address", f"{address!r} is not host:port")


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


@dataclass(frozen=True)
class OffloadRef:
    """What became of a view's omitted rows, as its handoff says.

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

    @property
    def recallable(self) -> bool:
        return self.mode is not RecoverabilityMode.OMITTED_IRRECOVERABLE


@dataclass(frozen=True)
class ViewHandoff:
    """One packed view a prefill worker hands to a decode worker (the AcceptTransfer message).

    `descriptor` keys and lays out the transfer and carries the receipt's digest and request,
    state and cache generations; the other receipt bindings (manifest, parent generation,
    frontier, origin, owner budgets `[L][H_owner]`, payload digest) are here, so the decode
    worker rebuilds the receipt from the positions it received (`receipt`) and hashes the bytes
    that arrived. Then: output token 0 with the sampling that continues it, the ledger the
    moved bytes must equal, and what became of the omitted rows. Construction checks what
    needs no deployment limits (DescriptorInvalid names the wire field); each hop checks the
    rest (token ids against its vocabulary, `check_sampling` against its limits).
    """

    descriptor: TransferDescriptor
    manifest_sha256: str
    parent_state_generation: int
    frontier: int
    position_origin: int
    first_token_id: int
    sampling: SamplingParams
    max_tokens: int
    prompt_tokens: int
    ledger: Ledger
    owner_budgets: BudgetGrid
    payload: PayloadDigest
    deadline_unix_ms: int = 0  # 0: none given
    offload: OffloadRef = OffloadRef()

    def __post_init__(self) -> None:
        if not _DIGEST.fullmatch(self.manifest_sha256):
            reason = f"{self.manifest_sha256!r} is not a lowercase hex SHA-256"
            raise DescriptorInvalid("receipt.manifest_sha256", reason)
        if self.descriptor.request_generation < 1:
            raise DescriptorInvalid("receipt.generations.request_generation", "must be >= 1")
        if self.descriptor.state_generation != self.parent_state_generation + 1:
            raise DescriptorInvalid(
                "receipt.generations.state_generation",
                f"{self.descriptor.state_generation} is not parent_state_generation + 1"
                f" ({self.parent_state_generation + 1})",
            )
        for name in ("position_origin", "first_token_id", "prompt_tokens", "deadline_unix_ms"):
            if getattr(self, name) < 0:
                raise DescriptorInvalid(_WIRE_NAMES.get(name, name), f"{getattr(self, name)} is negative")
        if self.frontier < 1:
            raise DescriptorInvalid("receipt.frontier", "a view to decode from covers at least one token")
        if self.ledger.traffic_bytes != self.descriptor.nbytes:
            raise DescriptorInvalid(
                "ledger",
                f"payload + metadata + sidecar = {self.ledger.traffic_bytes} bytes, the tensors listed"
                f" move {self.descriptor.nbytes}",
            )
        _check_offload(self.offload, self.descriptor.sidecar)
        object.__setattr__(self, "owner_budgets", tuple(tuple(row) for row in self.owner_budgets))
        _check_budgets(self.owner_budgets, self.descriptor.layout)
        _check_payload(self.payload, self.descriptor.layout)

    @property
    def key(self) -> TransferKey:
        return self.descriptor.key

    @property
    def end(self) -> int:
        """Original position of the first token after the prompt (where decoding starts)."""
        return self.position_origin + self.frontier

    def receipt(
        self,
        selected_positions: PositionGrid | Sequence[Sequence[Sequence[int]]],
        protected_positions: Sequence[int],
    ) -> Receipt:
        """The receipt this handoff claims, over the positions read from what arrived and the
        manifest's protected positions; ReceiptMismatch (field `digest`) unless the claimed
        digest recomputes, so a single moved position or generation is rejected."""
        descriptor = self.descriptor
        return Receipt(
            request_id=descriptor.request_id,
            manifest_sha256=self.manifest_sha256,
            request_generation=descriptor.request_generation,
            state_generation=descriptor.state_generation,
            parent_state_generation=self.parent_state_generation,
            cache_generation=descriptor.cache_generation,
            frontier=self.frontier,
            position_origin=self.position_origin,
            selected_positions=PositionGrid.of(selected_positions),
            protected_positions=tuple(protected_positions),
            owner_budgets=self.owner_budgets,
            payload=self.payload,
            digest=descriptor.receipt_digest,
        )


_WIRE_NAMES = {"position_origin": "receipt.position_origin"}
_HOST_PORT = re.compile(r"[^\s/]+:\d{1,5}")


def _check_offload(offload: OffloadRef, sidecar: SidecarLayout | None) -> None:
    """The handoff's account of the omitted rows agrees with the tensors it lists: summaries
    for a recallable mode, host-tier rows exactly for `recallable_local`, and a handoff (id,
    host:port, lease) exactly for `recallable_remote`."""
    mode = offload.mode
    if offload.recallable != (sidecar is not None):
        needs = "needs" if offload.recallable else "carries no"
        raise DescriptorInvalid("tensors", f"{mode.value} {needs} page summaries")
    local = mode is RecoverabilityMode.RECALLABLE_LOCAL
    if sidecar is not None and local != (sidecar.host_rows is not None):
        reason = f"host-tier rows travel with recallable_local only, not {mode.value}"
        raise DescriptorInvalid("tensors", reason)
    remote = mode is RecoverabilityMode.RECALLABLE_REMOTE
    if remote != bool(offload.handoff_id):
        reason = f"a handoff id comes with recallable_remote only, not {mode.value}"
        raise DescriptorInvalid("offload_handoff_id", reason)
    if remote and not _HOST_PORT.fullmatch(offload.address):
        raise DescriptorInvalid("offload_address", f"{offload.address!r} is not host:port")
    if remote and offload.lease_ms < 1:
        raise DescriptorInvalid("offload_lease_ms", f"{offload.lease_ms} must be positive")

def _check_budgets(budgets: BudgetGrid, layout: ViewLayout) -> None:
    """One non-negative budget per (layer, owner) of the layout."""
    shape = (layout.num_layers, layout.num_owners)
    if len(budgets) != shape[0] or any(len(row) != shape[1] for row in budgets):
        raise DescriptorInvalid("receipt.owner_budgets", f"not [{shape[0]}][{shape[1]}] like the layout")
    for layer, row in enumerate(budgets):
        for owner, budget in enumerate(row):
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise DescriptorInvalid(f"receipt.owner_budgets[{layer}][{owner}]", f"{budget!r} is not a count")


def _check_payload(payload: PayloadDigest, layout: ViewLayout) -> None:
    """A named hash and one (K, V) pair of hex digests per layer of the layout."""
    if not isinstance(payload.hash, str) or not _HASH_NAME.fullmatch(payload.hash):
        raise DescriptorInvalid("receipt.payload_hash", f"{str(payload.hash)[:40]!r} is not a hash name")
    if len(payload.layers) != layout.num_layers:
        reason = f"{len(payload.layers)} layer digests, the layout has {layout.num_layers} layers"
        raise DescriptorInvalid("receipt.payload_digests", reason)
    for layer, pair in enumerate(payload.layers):
        for name, value in zip("kv", pair, strict=True):
            if not isinstance(value, str) or not _PAYLOAD_HEX.fullmatch(value):
                raise DescriptorInvalid(f"receipt.payload_digests[{layer}].{name}", f"{str(value)[:40]!r} is not hex")


def _carrier_pairs(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    pairs = tuple(sorted((k, v) for k, v in items))
    for key, value in pairs:
        if not isinstance(key, str) or not isinstance(value, str):
            raise DescriptorInvalid("trace_context", f"entries must be str -> str, got {key!r}: {value!r}")
    return pairs
