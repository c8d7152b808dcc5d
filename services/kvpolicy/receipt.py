"""Receipts: a digest binding a packed view to its manifest, generations and positions.

The prefill worker makes a receipt only after the whole view validated and matched the
state; the decode worker recomputes the digest and compares the positions it received.
Changing any generation, the frontier, or any retained position changes the digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from services.kvpolicy.errors import ReceiptMismatch
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.kvpolicy.packing import PackedKVView, validate_view
from services.kvpolicy.state import KVPolicyState, PositionGrid

RECEIPT_DOMAIN = "kvrelay.receipt.v1"


@dataclass(frozen=True)
class Receipt:
    """What a published state promises about a packed view. Construction checks `digest`."""

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
    digest: str

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "selected_positions",
            tuple(tuple(tuple(o) for o in layer) for layer in self.selected_positions),
        )
        object.__setattr__(self, "protected_positions", tuple(self.protected_positions))
        expected = receipt_digest(self.body())
        if self.digest != expected:
            raise ReceiptMismatch(
                "digest", f"{self.digest!r} does not match the recomputed {expected}"
            )

    def body(self) -> dict[str, Any]:
        """Every bound field except the digest itself, as plain JSON data."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name != "digest"}

    @classmethod
    def for_state(cls, state: KVPolicyState) -> Receipt:
        """The receipt of a validated state (positions and generations taken from it)."""
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
        }
        return cls(**body, digest=receipt_digest({k: _plain(v) for k, v in body.items()}))


def receipt_digest(body: dict[str, Any]) -> str:
    """SHA-256 hex of the domain-tagged canonical JSON of a receipt body."""
    text = json.dumps({"domain": RECEIPT_DOMAIN, **body}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def make_receipt(
    manifest: KVVisibilityPolicyManifest, state: KVPolicyState, view: PackedKVView
) -> Receipt:
    """Check that `view` is exactly what `state` says under `manifest`, then bind them.

    Raises ReceiptMismatch (manifest, owners, positions) or PackingError (view vs tensor
    contract) before any receipt exists.
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
    return Receipt.for_state(state)


def verify_receipt(receipt: Receipt, *, manifest_sha256: str, view: PackedKVView) -> None:
    """Decode-side check: the receipt names the expected manifest and describes `view` exactly.

    The digest itself was recomputed when the receipt was constructed.
    """
    if receipt.manifest_sha256 != manifest_sha256:
        raise ReceiptMismatch(
            "manifest_sha256",
            f"receipt names {receipt.manifest_sha256}, expected {manifest_sha256}",
        )
    validate_view(view, frontier=receipt.position_origin + receipt.frontier)
    _check_positions_match(view, receipt.selected_positions)


def _check_positions_match(view: PackedKVView, expected: PositionGrid) -> None:
    received = view.selected_positions()
    for layer, owners in enumerate(expected):
        for owner, positions in enumerate(owners):
            if (
                layer >= len(received)
                or owner >= len(received[layer])
                or tuple(received[layer][owner]) != positions
            ):
                raise ReceiptMismatch(
                    "original_position_map",
                    f"positions of layer {layer} owner {owner} differ from the receipt",
                )
    if len(received) != len(expected) or any(
        len(r) != len(e) for r, e in zip(received, expected, strict=False)
    ):
        raise ReceiptMismatch(
            "row_offsets", "the view has a different number of layers or owners than the receipt"
        )


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
