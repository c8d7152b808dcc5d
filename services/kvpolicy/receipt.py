"""Receipts: a digest binding a packed view to its manifest, generations, positions, owner
budgets and payload bytes.

The prefill worker makes a receipt only after the whole view validated and matched the
state and the source cache it was gathered from; the decode worker recomputes the digest
from the positions it received, checks every owner's rows against its budget, and hashes the
K/V bytes that arrived against the receipt's payload digest. Changing any generation, the
frontier, any retained position, any budget or any payload byte changes what the receipt
says, and so its digest.

The payload digest is XXH3-128 of each layer's packed K bytes and packed V bytes, separately,
in row order. XXH3 is a fast non-cryptographic hash (~10 GB/s on one core, several times
SHA-256 or BLAKE3 there): it catches corruption and misalignment (a V row shifted against K, a
flipped bit) with a 2^-128 chance of missing one, but not an adversary, who can forge
collisions. That is enough while receipts are not a security boundary (any party that can
alter the payload can also recompute every digest: nothing is signed or keyed yet); when
receipts become one, the payload needs a cryptographic, keyed digest (e.g. keyed BLAKE3)
under a key the decode worker trusts, and `payload.hash` names which one a receipt used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, cast

import torch
import xxhash

from services.kvpolicy.errors import ReceiptMismatch, StateInvalid
from services.kvpolicy.manifest import Fidelity, KVVisibilityPolicyManifest
from services.kvpolicy.packing import PackedKVView, SourceIdentity, validate_view
from services.kvpolicy.state import (
    BudgetGrid,
    KVPolicyState,
    PositionGrid,
    budgets_match_shape,
    first_over_budget,
)

# v3 binds the positions by the SHA-256 of their int64 bytes (`PositionGrid.digest`), not by
# their JSON text: v2's text was the largest cost of making and checking a receipt (~60 ms for
# the 393,216 positions of a 16K prompt on 24 layers x 4 owners, on both workers).
RECEIPT_DOMAIN = "kvrelay.receipt.v3"
PAYLOAD_HASH = "xxh3-128"


@dataclass(frozen=True)
class PayloadDigest:
    """Digests of a view's payload under `hash`: per layer, (packed K, packed V) in hex."""

    hash: str
    layers: tuple[tuple[str, str], ...]  # [L]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple((k, v) for k, v in self.layers))


@dataclass(frozen=True)
class Receipt:
    """What a published state promises about a packed view. Construction checks that no
    owner retains more positions than its budget, then `digest`.

    `owner_budgets` and `payload` are None only for a state that no view realizes (a
    recall's successor, whose rows arrive by recall); `make_receipt` requires both.
    """

    request_id: str
    manifest_sha256: str
    request_generation: int
    state_generation: int
    parent_state_generation: int
    cache_generation: int
    frontier: int
    position_origin: int
    selected_positions: PositionGrid
    protected_positions: tuple[int, ...]
    owner_budgets: BudgetGrid | None
    payload: PayloadDigest | None
    digest: str

    def __post_init__(self) -> None:
        try:
            grid = PositionGrid.of(self.selected_positions)
        except StateInvalid as error:
            raise ReceiptMismatch(error.field, error.reason) from error
        object.__setattr__(self, "selected_positions", grid)
        object.__setattr__(self, "protected_positions", tuple(self.protected_positions))
        if self.owner_budgets is not None:
            object.__setattr__(
                self, "owner_budgets", tuple(tuple(row) for row in self.owner_budgets)
            )
            _check_budgets(self.selected_positions, self.owner_budgets)
        if self.payload is not None and len(self.payload.layers) != grid.num_layers:
            layers = grid.num_layers
            raise ReceiptMismatch(
                "payload", f"{len(self.payload.layers)} layer digests for {layers} layers"
            )
        expected = receipt_digest(self.body())
        if self.digest is _OWN_DIGEST:  # `for_state`: the digest is computed here, once
            object.__setattr__(self, "digest", expected)
        if self.digest != expected:
            raise ReceiptMismatch(
                "digest", f"{self.digest!r} does not match the recomputed {expected}"
            )

    def body(self) -> dict[str, Any]:
        """Every bound field except the digest itself (what `receipt_digest` hashes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "digest"}

    def view_bindings(self) -> tuple[BudgetGrid, PayloadDigest]:
        """The owner budgets and payload digest a view's receipt binds (what travels with the
        view); ReceiptMismatch for the receipt of a state no view realizes."""
        if self.owner_budgets is None or self.payload is None:
            raise ReceiptMismatch("payload", "this receipt binds no view (no budgets or payload)")
        return self.owner_budgets, self.payload

    @classmethod
    def for_state(cls, state: KVPolicyState, payload: PayloadDigest | None = None) -> Receipt:
        """The receipt of a validated state (positions, generations and budgets taken from
        it) and, for a view, of the view's payload."""
        body: dict[str, Any] = {
            "request_id": state.request_id,
            "manifest_sha256": state.manifest_sha256,
            "request_generation": state.request_generation,
            "state_generation": state.state_generation,
            "parent_state_generation": state.parent_state_generation,
            "cache_generation": state.cache_generation,
            "frontier": state.frontier,
            "position_origin": state.position_origin,
            "selected_positions": state.selected_positions,
            "protected_positions": state.protected_positions,
            "owner_budgets": state.owner_budgets,
            "payload": payload,
        }
        return cls(**body, digest=cast(str, _OWN_DIGEST))


# What `for_state` passes for the digest: not a str, so nothing decoded from the wire can be it;
# the receipt computes its digest instead of computing it twice (once to pass, once to check).
_OWN_DIGEST: Any = object()


def receipt_digest(body: dict[str, Any]) -> str:
    """SHA-256 hex of the domain-tagged canonical JSON of a receipt body (tuples and
    `PayloadDigest`s taken as the lists and objects they hold, a `PositionGrid` as the
    SHA-256 of its bytes)."""
    positions = body.get("selected_positions")
    if positions is not None and not isinstance(positions, PositionGrid):
        try:  # nested sequences: bound by the bytes of the grid they stand for, all the same
            body = body | {"selected_positions": PositionGrid.of(positions)}
        except StateInvalid as error:
            raise ReceiptMismatch(error.field, error.reason) from error
    text = json.dumps(
        {"domain": RECEIPT_DOMAIN, **_plain(body)}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_receipt(
    manifest: KVVisibilityPolicyManifest,
    state: KVPolicyState,
    view: PackedKVView,
    *,
    source: SourceIdentity,
) -> Receipt:
    """Check that `view` is exactly what `state` says under `manifest`, gathered from the
    cache image `source` names, then bind them (payload digest included).

    Raises ReceiptMismatch (manifest, owners, source: `cache_generation`, `position_origin`,
    `frontier`; `owner_budgets`, positions, the manifest's fidelity) or PackingError (view vs
    tensor contract) before any receipt exists.
    """
    if state.manifest_sha256 != manifest.sha256:
        raise ReceiptMismatch(
            "manifest_sha256", f"state names {state.manifest_sha256}, manifest is {manifest.sha256}"
        )
    tensor = manifest.tensor
    if (state.num_layers, state.num_owners) != (tensor.num_layers, manifest.num_owners):
        raise ReceiptMismatch(
            "selected_positions",
            f"state has [{state.num_layers}][{state.num_owners}] owners,"
            f" manifest [{tensor.num_layers}][{manifest.num_owners}]",
        )
    _check_source(state, source)
    check_fidelity(manifest, state.selected_positions, state.position_origin, state.end)
    if state.owner_budgets is None:
        raise ReceiptMismatch("owner_budgets", "the state has none: a view's receipt binds them")
    validate_view(
        view,
        num_layers=tensor.num_layers,
        num_kv_heads=manifest.num_owners,
        head_dim=tensor.head_dim,
        k_dtype=getattr(torch, tensor.k_dtype.value),
        v_dtype=getattr(torch, tensor.v_dtype.value),
        frontier=state.end,
    )
    _check_positions_match(view, state.selected_positions)
    return Receipt.for_state(state, payload_digest(view))


def check_fidelity(
    manifest: KVVisibilityPolicyManifest,
    positions: PositionGrid | Sequence[Sequence[Sequence[int]]],
    origin: int,
    end: int,
) -> None:
    """Under `full_cache_exact` every owner retains every position of `[origin, end)`;
    ReceiptMismatch names the first owner that omits one (`selected_positions[l][h]`). The
    one fidelity rule: the prefill worker's receipt and the decode worker's check apply it.
    Positions are strictly ascending inside the range (the state and the view check that), so
    a full owner is one with `end - origin` of them."""
    if manifest.representation.fidelity is not Fidelity.FULL_CACHE_EXACT:
        return
    grid = positions if isinstance(positions, PositionGrid) else None
    if grid is not None and bool((grid.counts == end - origin).all()):
        return
    for layer, owners in enumerate(positions):
        for owner, retained in enumerate(owners):
            if len(retained) != end - origin:
                raise ReceiptMismatch(
                    f"selected_positions[{layer}][{owner}]",
                    f"retains {len(retained)} of the {end - origin} positions [{origin}, {end});"
                    " representation.fidelity full_cache_exact keeps every one",
                )


def verify_receipt(receipt: Receipt, *, manifest_sha256: str, view: PackedKVView) -> None:
    """Decode-side check: the receipt names the expected manifest and describes `view`
    exactly, positions and payload bytes.

    The digest and the owner budgets were checked when the receipt was constructed.
    """
    if receipt.manifest_sha256 != manifest_sha256:
        raise ReceiptMismatch(
            "manifest_sha256",
            f"receipt names {receipt.manifest_sha256}, expected {manifest_sha256}",
        )
    validate_view(view, frontier=receipt.position_origin + receipt.frontier)
    _check_positions_match(view, receipt.selected_positions)
    check_payload(receipt.payload, view)


def payload_digest(view: PackedKVView) -> PayloadDigest:
    """XXH3-128 of every layer's packed K bytes and packed V bytes, raw, in row order. A view
    on an accelerator is copied to host once first (that copy is the cost of a GPU view)."""
    k, v = _host_bytes(view.packed_k), _host_bytes(view.packed_v)  # [R_total, d_h * itemsize]
    bounds = view.row_offsets[:, [0, -1]].cpu().tolist()  # [L, 2]
    return PayloadDigest(
        PAYLOAD_HASH,
        tuple((_xxh3(k[start:end]), _xxh3(v[start:end])) for start, end in bounds),
    )


def check_payload(expected: PayloadDigest | None, view: PackedKVView) -> None:
    """The K/V bytes of `view` are the ones `expected` digests; ReceiptMismatch names
    `packed_k[l]` or `packed_v[l]` for the first layer whose bytes differ (or `payload`,
    `payload.hash` when there is nothing this worker can compare)."""
    if expected is None:
        raise ReceiptMismatch("payload", "the receipt binds no payload digest")
    if expected.hash != PAYLOAD_HASH:
        reason = f"{expected.hash[:32]!r}, this worker checks {PAYLOAD_HASH}"
        raise ReceiptMismatch("payload.hash", reason)
    actual = payload_digest(view)
    if len(actual.layers) != len(expected.layers):
        reason = f"{len(expected.layers)} layer digests, the view has {len(actual.layers)} layers"
        raise ReceiptMismatch("payload", reason)
    for layer, (got, want) in enumerate(zip(actual.layers, expected.layers, strict=True)):
        for name, got_hex, want_hex in zip(("packed_k", "packed_v"), got, want, strict=True):
            if got_hex != want_hex:
                reason = (
                    f"bytes hash to {got_hex}, the receipt's payload.layers[{layer}] binds"
                    f" {want_hex[:64]}"
                )
                raise ReceiptMismatch(f"{name}[{layer}]", reason)


def _check_source(state: KVPolicyState, source: SourceIdentity) -> None:
    """The state lies inside the source image: its cache generation, positions from the
    source's origin, frontier no further than the source's end."""
    if state.cache_generation != source.cache_generation:
        raise ReceiptMismatch(
            "cache_generation",
            f"the state has {state.cache_generation}, the source cache {source.cache_generation}",
        )
    if state.position_origin < source.position_origin:
        raise ReceiptMismatch(
            "position_origin",
            f"{state.position_origin} precedes the source's origin {source.position_origin}",
        )
    if state.end > source.end:
        raise ReceiptMismatch(
            "frontier",
            f"the state ends at {state.end}, the source holds"
            f" [{source.position_origin}, {source.end})",
        )


def _check_budgets(grid: PositionGrid, budgets: BudgetGrid) -> None:
    if not budgets_match_shape(budgets, grid):
        raise ReceiptMismatch("owner_budgets", "shape differs from selected_positions")
    over = first_over_budget(grid, budgets)
    if over is not None:
        layer, owner = over
        raise ReceiptMismatch(
            f"owner_budgets[{layer}][{owner}]",
            f"{len(grid[layer][owner])} rows retained, the budget is {budgets[layer][owner]}",
        )


def _host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().view(torch.uint8)  # [R, d_h * itemsize]


def _xxh3(rows: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(rows.numpy().data)


def _check_positions_match(view: PackedKVView, expected: PositionGrid) -> None:
    if _positions_equal(view, expected):
        return
    received = view.selected_positions()  # find and name the first difference
    for layer, owners in enumerate(expected):
        for owner, positions in enumerate(owners):
            if (
                layer >= len(received)
                or owner >= len(received[layer])
                or tuple(received[layer][owner]) != positions
            ):
                raise ReceiptMismatch(
                    "original_position_map",
                    f"positions of layer {layer} owner {owner} differ from the receipt's"
                    f" selected_positions[{layer}][{owner}]",
                )
    if len(received) != len(expected) or any(
        len(r) != len(e) for r, e in zip(received, expected, strict=False)
    ):
        raise ReceiptMismatch(
            "row_offsets", "the view has a different number of layers or owners than the receipt"
        )


def _positions_equal(view: PackedKVView, expected: PositionGrid) -> bool:
    """Whether the view holds exactly `expected`, compared as tensors: the same owners per
    layer, the same row count per segment, the same positions in row order."""
    owners = view.num_kv_heads
    if (expected.num_layers, expected.num_owners) != (view.num_layers, owners):
        return False
    offsets = view.row_offsets.cpu().reshape(-1, owners + 1).long()  # [L, H + 1]
    if not torch.equal(expected.counts, offsets[:, 1:] - offsets[:, :-1]):
        return False
    positions = view.original_position_map.cpu()  # int32
    flat = expected.flat
    if positions.shape != flat.shape or positions.dtype != torch.int32:
        return False
    if flat.numel() and int(flat.max()) > torch.iinfo(torch.int32).max:
        return False  # not a position an int32 map holds (and a narrowed copy would wrap)
    return torch.equal(positions, flat.to(torch.int32))  # a 4 R copy, not an 8 R one


def _plain(value: Any) -> Any:
    if isinstance(value, PositionGrid):
        return {"counts_then_positions_int64_le_sha256": value.digest()}
    if isinstance(value, PayloadDigest):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        if set(map(type, value)) <= _SCALARS:  # a leaf (positions, budgets): copied at C speed
            return list(value)
        return [_plain(v) for v in value]
    return value


_SCALARS = {int, str, float, bool, type(None)}
