"""Verification before use: a received view is decoded only if it is exactly what the
descriptor promised, its receipt digest recomputes, and the fence says it is current.

Pure decisions over values (no I/O): the service fetches the manifest and the fence and
calls these in order —

    check_manifest(manifest, claim, model_contract)   # the manifest fits the loaded model
    check_view(view, manifest, claim, layout)         # shapes, dtypes, offsets, positions
    recompute_receipt(manifest, claim, view)          # digest over what actually arrived
    check_fence(fence, claim)                         # this state is current for its g_r
    check_offload(manifest, offload, sidecar, view, claim)   # recallable manifests: summaries

`verified_state` is the state a verified view realizes, what recall builds successors on.
Each raises a typed error naming what disagrees (`ViewRejected`, `StaleTransfer`).
"""

from __future__ import annotations

import torch

from decode_worker.errors import StaleTransfer, ViewRejected
from decode_worker.wire import OffloadClaim, ReceiptClaim
from services.kvpolicy import snapkv
from services.kvpolicy.errors import PackingError, ReceiptMismatch
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    SelectionMethod,
    TensorContract,
)
from services.kvpolicy.packing import PackedKVView, validate_view
from services.kvpolicy.receipt import Receipt, verify_receipt
from services.kvpolicy.state import KVPolicyState
from services.kvpolicy.static import static_protected_positions
from services.offload.errors import OffloadError
from services.offload.pages import OmittedRows, PageSummaries, validate_against_view
from services.policy.types import Fence
from services.transfer import Sidecar, ViewLayout

_SHAPE_FIELDS = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim")


def check_manifest(
    manifest: KVVisibilityPolicyManifest, claim: ReceiptClaim, model_contract: TensorContract
) -> None:
    """The manifest is the one the receipt names and describes the model this worker runs."""
    if manifest.sha256 != claim.manifest_sha256:
        raise ViewRejected(
            f"manifest {manifest.sha256} is not the receipt's {claim.manifest_sha256}",
            field="receipt.manifest_sha256",
        )
    for name in _SHAPE_FIELDS:
        declared, served = getattr(manifest.tensor, name), getattr(model_contract, name)
        if declared != served:
            raise ViewRejected(
                f"manifest declares {declared}, the loaded model has {served}", field=f"manifest.tensor.{name}"
            )
    if manifest.tensor.resolved_q_to_kv_head_map() != model_contract.resolved_q_to_kv_head_map():
        raise ViewRejected("differs from the loaded model's", field="manifest.tensor.q_to_kv_head_map")


def check_view(
    view: PackedKVView, manifest: KVVisibilityPolicyManifest, claim: ReceiptClaim, layout: ViewLayout
) -> None:
    """The received view has the descriptor's layout and satisfies the manifest's tensor
    contract: layers, owners, head dim, K/V dtypes, and every position below the frontier."""
    received = ViewLayout.of(view)
    if received != layout:
        raise ViewRejected(f"received {received}, descriptor says {layout}", field="descriptor.tensors")
    tensor = manifest.tensor
    try:
        validate_view(
            view,
            num_layers=tensor.num_layers,
            num_kv_heads=manifest.num_owners,
            head_dim=tensor.head_dim,
            k_dtype=getattr(torch, tensor.k_dtype.value),
            v_dtype=getattr(torch, tensor.v_dtype.value),
            frontier=claim.end,
        )
    except PackingError as exc:
        raise ViewRejected(exc.reason, field=exc.field) from None


def recompute_receipt(
    manifest: KVVisibilityPolicyManifest, claim: ReceiptClaim, view: PackedKVView
) -> Receipt:
    """The receipt of what arrived: the claimed generations and frontier, the positions read
    from the received position map, the manifest's protected positions. Its digest must be
    the claimed one, so a single moved position or generation is rejected."""
    try:
        receipt = Receipt(
            request_id=claim.request_id,
            manifest_sha256=claim.manifest_sha256,
            request_generation=claim.request_generation,
            state_generation=claim.state_generation,
            parent_state_generation=claim.parent_state_generation,
            cache_generation=claim.cache_generation,
            frontier=claim.frontier,
            position_origin=claim.position_origin,
            selected_positions=tuple(tuple(map(tuple, owners)) for owners in view.selected_positions()),
            protected_positions=protected_positions_for(manifest, claim.frontier, claim.position_origin),
            digest=claim.digest,
        )
        verify_receipt(receipt, manifest_sha256=manifest.sha256, view=view)
    except ReceiptMismatch as exc:
        field = "receipt.digest" if exc.field == "digest" else exc.field
        raise ViewRejected(exc.reason, field=field) from None
    except PackingError as exc:
        raise ViewRejected(exc.reason, field=exc.field) from None
    return receipt


def protected_positions_for(
    manifest: KVVisibilityPolicyManifest, frontier: int, origin: int = 0
) -> tuple[int, ...]:
    """Positions every owner must retain, as the prefill worker bound them into the receipt:
    sinks and observation suffix for SnapKV, sinks for sink + recent, none otherwise."""
    if manifest.selection.method is SelectionMethod.SNAPKV:
        return tuple(origin + p for p in snapkv.protected_positions(manifest, frontier))
    return static_protected_positions(manifest.selection, frontier, origin)


def check_fence(fence: Fence | None, claim: ReceiptClaim) -> None:
    """The policy service's fence admits exactly this state: same request generation, state
    generation, cache generation, digest and manifest, and the request has not ended.
    `fence` None means the policy service does not know the request (expired or never begun)."""
    if fence is None:
        raise StaleTransfer(f"request {claim.request_id!r} is unknown to the policy service", field="request_id")
    expected = (
        ("request_generation", fence.request_generation, claim.request_generation),
        ("state_generation", fence.state_generation, claim.state_generation),
        ("cache_generation", fence.cache_generation, claim.cache_generation),
        ("receipt.digest", fence.receipt_digest, claim.digest),
        ("receipt.manifest_sha256", fence.manifest_sha256, claim.manifest_sha256),
    )
    for field, current, received in expected:
        if current != received:
            raise StaleTransfer(f"fence has {current}, the transfer carries {received}", field=field, current=fence)
    if fence.ended:
        raise StaleTransfer(f"request {claim.request_id!r} has ended", field="phase", current=fence)


def check_offload(
    manifest: KVVisibilityPolicyManifest,
    offload: OffloadClaim,
    sidecar: Sidecar | None,
    view: PackedKVView,
    claim: ReceiptClaim,
) -> None:
    """The descriptor's recoverability is the manifest's (or irrecoverable, degraded from
    recallable_remote with a reason); the page summaries use the manifest's page size and,
    with the retained rows, cover every position below the frontier exactly once; host-tier
    rows are exactly the paged positions, and their keys span exactly each page's min/max."""
    contract = manifest.recoverability
    degraded = (
        offload.mode is RecoverabilityMode.OMITTED_IRRECOVERABLE
        and contract.mode is RecoverabilityMode.RECALLABLE_REMOTE
        and bool(offload.degraded)
    )
    if offload.mode is not contract.mode and not degraded:
        raise ViewRejected(
            f"descriptor says {offload.mode.value}, the manifest {contract.mode.value}",
            field="descriptor.recoverability",
        )
    if sidecar is None:
        return
    summaries = sidecar.summaries
    if summaries.page_size != contract.page_size:
        raise ViewRejected(
            f"{summaries.page_size}, the manifest says {contract.page_size}", field="descriptor.page_size"
        )
    try:
        validate_against_view(summaries, view.selected_positions(), claim.end)
    except OffloadError as exc:
        raise ViewRejected(exc.reason, field=f"sidecar.{exc.field}") from None
    if sidecar.host_rows is not None:
        _check_host_rows(summaries, sidecar.host_rows)


def verified_state(claim: ReceiptClaim, receipt: Receipt) -> KVPolicyState:
    """The state a verified view realizes (what recall builds its successors on)."""
    return KVPolicyState(
        request_id=claim.request_id,
        manifest_sha256=claim.manifest_sha256,
        request_generation=claim.request_generation,
        state_generation=claim.state_generation,
        parent_state_generation=claim.parent_state_generation,
        cache_generation=claim.cache_generation,
        frontier=claim.frontier,
        selected_positions=receipt.selected_positions,
        protected_positions=receipt.protected_positions,
        position_origin=claim.position_origin,
    )


def _check_host_rows(summaries: PageSummaries, rows: OmittedRows) -> None:
    _, positions = summaries.rows()  # [N], page after page
    counts = (rows.page_rows[1:] - rows.page_rows[:-1]).long()  # [P_total]
    if not torch.equal(counts, summaries.page_count.long()):
        raise ViewRejected("row counts per page differ from the summaries", field="sidecar.page_rows")
    if not torch.equal(rows.positions.long(), positions):
        raise ViewRejected("positions differ from the paged positions", field="sidecar.omitted_positions")
    page = torch.repeat_interleave(torch.arange(summaries.num_pages), counts)[:, None].expand(-1, summaries.head_dim)
    keys = rows.k.float()  # [N, d_h]
    empty = torch.zeros(summaries.num_pages, summaries.head_dim)
    low = empty.scatter_reduce(0, page, keys, "amin", include_self=False)  # [P_total, d_h]
    high = empty.scatter_reduce(0, page, keys, "amax", include_self=False)
    if not (torch.equal(low, summaries.page_min.float()) and torch.equal(high, summaries.page_max.float())):
        raise ViewRejected("keys do not span their pages' summaries", field="sidecar.omitted_k")
