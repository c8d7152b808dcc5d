"""Verify: a received view is decoded only if it is exactly what the handoff promised, its
receipt digest recomputes, no owner holds more rows than its budget, its K/V bytes hash to
the receipt's payload digest, and the fence says it is current.

The checks are pure decisions over values (no I/O); `Verifier`, the stage, fetches the
manifest (the one `ManifestCache`) and the fence and calls them in order —

    check_manifest(manifest, handoff, deployment)   # the receipt's manifest, and it fits (kvpolicy.fit)
    check_view(view, manifest, handoff)             # layout, shapes, dtypes, offsets, frontier
    check_offload(manifest, handoff, sidecar, view) # recallable manifests: summaries, row codes
    check_budgets(manifest, handoff)                # static policies: the rule's own row count
    check_fidelity(manifest, handoff, view)         # full_cache_exact: every row of every owner
    recompute_receipt(manifest, handoff, view)      # digest over the positions that arrived, budgets
    check_payload(handoff, view)                    # the bytes that arrived are the digested ones
    check_fence(fence, handoff)                     # this state is current for its g_r

The position sets the receipt binds are read from the received position map, so the digest
carries the promise that every retained row is the published one; the payload digest (bound
by the receipt digest) carries the promise that every row's K and V bytes are the published
ones, so a V row shifted against K or a flipped bit is refused (`packed_v[l]`, `packed_k[l]`);
on a GPU that check copies the payload to host once (`services.kvpolicy.receipt`).
`verified_state` is the state a verified view realizes, what recall builds successors on. Each
raises a typed error naming what disagrees (`ViewRejected`, `StaleTransfer`); a policy service
that cannot answer raises `TransferFailed`.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from decode_worker.accept import Accepted
from decode_worker.errors import StaleTransfer, TransferFailed, ViewRejected
from decode_worker.receive import Received
from services.kvpolicy import receipt as receipts
from services.kvpolicy import snapkv
from services.kvpolicy.compress import owner_capacities
from services.kvpolicy.errors import KVPolicyError, PackingError, ReceiptMismatch
from services.kvpolicy.fit import Deployment, ManifestUnfit, check_fits
from services.kvpolicy.manifest import (
    KVVisibilityPolicyManifest,
    RecoverabilityMode,
    SelectionMethod,
)
from services.kvpolicy.packing import PackedKVView, validate_view
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.state import KVPolicyState
from services.kvpolicy.static import static_protected_positions
from services.offload.errors import OffloadError
from services.offload.pages import (
    OmittedRows,
    PageSummaries,
    encode_codes,
    validate_against_view,
    value_mean_matches,
)
from services.policy import NotFound, PolicyClient, PolicyError
from services.policy.manifests import ManifestCache
from services.policy.types import Fence
from services.telemetry.spans import span
from services.transfer import Sidecar, ViewHandoff, ViewLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verified:
    """A received view that passed every check: its manifest and the recomputed receipt."""

    manifest: KVVisibilityPolicyManifest
    receipt: Receipt


class Verifier:
    """The verify stage of one worker: the manifests it reads, the fence it asks, the model
    it runs (`deployment`); the pure checks run on `executor` threads."""

    def __init__(
        self, policy: PolicyClient, manifests: ManifestCache, deployment: Deployment,
        executor: Executor, *, policy_timeout_s: float,
    ) -> None:
        self._policy = policy
        self._manifests = manifests
        self._deployment = deployment
        self._executor = executor
        self._policy_timeout_s = policy_timeout_s

    async def verify(self, accepted: Accepted, received: Received) -> Verified:
        """Manifest → pure checks → fence, in one `kv.verify` span."""
        handoff, view = accepted.handoff, received.view
        with span("kv.verify", accepted.trace_parent, **accepted.span_attributes()) as current:
            manifest = await self._manifest(handoff.manifest_sha256)
            current.set_attribute("manifest_name", manifest.name)

            def pure_checks() -> Receipt:
                check_manifest(manifest, handoff, self._deployment)
                check_view(view, manifest, handoff)
                check_offload(manifest, handoff, received.sidecar, view)
                check_budgets(manifest, handoff)
                check_fidelity(manifest, handoff, view)
                receipt = recompute_receipt(manifest, handoff, view)
                check_payload(handoff, view)
                return receipt

            receipt = await asyncio.get_running_loop().run_in_executor(self._executor, pure_checks)
            check_fence(await self._fence(accepted.request_id), handoff)
            current.set_attributes({"retained_rows": view.total_rows, "receipt_digest": receipt.digest,
                                    "recoverability": handoff.offload.mode.value,
                                    "offload_degraded": handoff.offload.degraded or None})
            # Inside the span: the log line carries its trace and request ids.
            log.info("transfer %s verified: %d rows, %d bytes from %s", handoff.key, view.total_rows,
                     received.bytes_moved, handoff.descriptor.source_worker)
        return Verified(manifest, receipt)

    async def _manifest(self, sha256: str) -> KVVisibilityPolicyManifest:
        try:
            return await self._manifests.get(sha256)
        except NotFound:
            raise ViewRejected(f"manifest {sha256} is not registered", field="receipt.manifest_sha256") from None
        except KVPolicyError as exc:
            raise ViewRejected(f"stored manifest is invalid: {exc}", field="receipt.manifest_sha256") from None
        except PolicyError as exc:
            raise TransferFailed(f"policy service: {exc}", field="receipt.manifest_sha256") from exc

    async def _fence(self, request_id: str) -> Fence | None:
        try:
            return await self._policy.get_fence(request_id, timeout_s=self._policy_timeout_s)
        except NotFound:
            return None
        except PolicyError as exc:
            raise TransferFailed(f"policy service: {exc}", field="fence") from exc


def check_manifest(
    manifest: KVVisibilityPolicyManifest, handoff: ViewHandoff, deployment: Deployment
) -> None:
    """The manifest is the one the receipt names, and it fits the model this worker runs."""
    if manifest.sha256 != handoff.manifest_sha256:
        raise ViewRejected(
            f"manifest {manifest.sha256} is not the receipt's {handoff.manifest_sha256}",
            field="receipt.manifest_sha256",
        )
    try:
        check_fits(manifest, deployment)
    except ManifestUnfit as exc:
        raise ViewRejected(exc.reason, field=f"manifest.{exc.field}") from None


def check_view(view: PackedKVView, manifest: KVVisibilityPolicyManifest, handoff: ViewHandoff) -> None:
    """The received view has the descriptor's layout and satisfies the manifest's tensor
    contract: layers, owners, head dim, K/V dtypes, and every position below the frontier."""
    received, layout = ViewLayout.of(view), handoff.descriptor.layout
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
            frontier=handoff.end,
        )
    except PackingError as exc:
        raise ViewRejected(exc.reason, field=exc.field) from None


def check_budgets(manifest: KVVisibilityPolicyManifest, handoff: ViewHandoff) -> None:
    """A static policy's owner budgets are its rule's row count for the frontier (the same
    `owner_capacities` the prefill worker bound). SnapKV's come from the allocator's scores,
    which do not travel: the receipt digest and the fence vouch for them."""
    if manifest.selection.method is SelectionMethod.SNAPKV:
        return
    expected = owner_capacities(manifest, handoff.frontier, None)
    for layer, (claimed_row, rule_row) in enumerate(zip(handoff.owner_budgets, expected, strict=True)):
        for owner, (claimed, count) in enumerate(zip(claimed_row, rule_row, strict=True)):
            if claimed != count:
                raise ViewRejected(f"{claimed}, the manifest's rule keeps {count} rows",
                                   field=f"receipt.owner_budgets[{layer}][{owner}]")


def check_fidelity(
    manifest: KVVisibilityPolicyManifest, handoff: ViewHandoff, view: PackedKVView
) -> None:
    """A `full_cache_exact` view holds every position below the frontier for every owner (the
    rule the prefill worker's receipt applied, `receipts.check_fidelity`)."""
    try:
        receipts.check_fidelity(
            manifest, view.selected_positions(), handoff.position_origin, handoff.end
        )
    except ReceiptMismatch as exc:
        raise ViewRejected(exc.reason, field=f"receipt.{exc.field}") from None


def recompute_receipt(
    manifest: KVVisibilityPolicyManifest, handoff: ViewHandoff, view: PackedKVView
) -> Receipt:
    """The receipt of what arrived: the handoff's generations, manifest, frontier, owner
    budgets and payload digest, the positions read from the received position map, the
    manifest's protected positions. An owner holding more rows than its budget is rejected
    (`receipt.owner_budgets[l][h]`), and the digest must be the claimed one, so a single moved
    position, budget or generation is rejected."""
    protected = protected_positions_for(manifest, handoff.frontier, handoff.position_origin)
    try:
        return handoff.receipt(view.selected_positions(), protected)
    except ReceiptMismatch as exc:
        raise ViewRejected(exc.reason, field=f"receipt.{exc.field}") from None


def check_payload(handoff: ViewHandoff, view: PackedKVView) -> None:
    """The received K/V bytes hash, layer by layer, to the payload digest the receipt binds;
    ViewRejected names the first layer and tensor that differ (`packed_v[3]`)."""
    try:
        receipts.check_payload(handoff.payload, view)
    except ReceiptMismatch as exc:
        field = exc.field if exc.field.startswith("packed_") else f"receipt.{exc.field}"
        raise ViewRejected(exc.reason, field=field) from None


def protected_positions_for(
    manifest: KVVisibilityPolicyManifest, frontier: int, origin: int = 0
) -> tuple[int, ...]:
    """Positions every owner must retain, as the prefill worker bound them into the receipt:
    sinks and observation suffix for SnapKV, sinks for sink + recent, none otherwise."""
    if manifest.selection.method is SelectionMethod.SNAPKV:
        return tuple(origin + p for p in snapkv.protected_positions(manifest, frontier))
    return static_protected_positions(manifest.selection, frontier, origin)


def check_fence(fence: Fence | None, handoff: ViewHandoff) -> None:
    """The policy service's fence admits exactly this state: same request generation, state
    generation, cache generation, digest and manifest, and the request has not ended.
    `fence` None means the policy service does not know the request (expired or never begun)."""
    descriptor = handoff.descriptor
    if fence is None:
        unknown = f"request {descriptor.request_id!r} is unknown to the policy service"
        raise StaleTransfer(unknown, field="request_id")
    expected = (
        ("request_generation", fence.request_generation, descriptor.request_generation),
        ("state_generation", fence.state_generation, descriptor.state_generation),
        ("cache_generation", fence.cache_generation, descriptor.cache_generation),
        ("receipt.digest", fence.receipt_digest, descriptor.receipt_digest),
        ("receipt.manifest_sha256", fence.manifest_sha256, handoff.manifest_sha256),
    )
    for field, current, received in expected:
        if current != received:
            raise StaleTransfer(f"fence has {current}, the transfer carries {received}", field=field, current=fence)
    if fence.ended:
        raise StaleTransfer(f"request {descriptor.request_id!r} has ended", field="phase", current=fence)


def check_offload(
    manifest: KVVisibilityPolicyManifest, handoff: ViewHandoff, sidecar: Sidecar | None, view: PackedKVView
) -> None:
    """The descriptor's recoverability is the manifest's (or irrecoverable, degraded from
    recallable_remote with a reason); the page summaries use the manifest's page size and
    row-code bits and, with the retained rows, cover every position below the frontier
    exactly once; the ledger charged the codes table they need (what accept reserved);
    host-tier rows are exactly the paged positions, their keys span exactly each page's
    min/max and, with codes, encode to exactly the row codes, and their values average to the
    page value means the manifest's `omitted_value_term` asks for."""
    contract, offload = manifest.recoverability, handoff.offload
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
    if summaries.code_bits != (contract.key_code_bits or 0):
        raise ViewRejected(
            f"{summaries.code_bits}-bit row codes, the manifest says {contract.key_code_bits or 0}",
            field="sidecar.code_bits",
        )
    means = summaries.page_value_mean
    if (means is not None) != bool(contract.omitted_value_term):
        carried = "carry" if means is not None else "lack"
        raise ViewRejected(
            f"the summaries {carried} page value means, the manifest's omitted_value_term is "
            f"{bool(contract.omitted_value_term)}",
            field="sidecar.page_value_mean",
        )
    if means is not None and means.dtype != view.packed_v.dtype:
        raise ViewRejected(f"{means.dtype}, the view's values are {view.packed_v.dtype}",
                           field="sidecar.page_value_mean")
    try:
        validate_against_view(summaries, view.selected_positions(), handoff.end)
    except OffloadError as exc:
        raise ViewRejected(exc.reason, field=f"sidecar.{exc.field}") from None
    if handoff.ledger.code_table_bytes != summaries.code_table_bytes:  # what accept reserved
        raise ViewRejected(
            f"{handoff.ledger.code_table_bytes} bytes, the summaries' table needs "
            f"{summaries.code_table_bytes}",
            field="ledger.code_table_bytes",
        )
    if sidecar.host_rows is not None:
        _check_host_rows(summaries, sidecar.host_rows)


def verified_state(receipt: Receipt) -> KVPolicyState:
    """The state a verified view realizes (what recall builds its successors on)."""
    return KVPolicyState(
        request_id=receipt.request_id,
        manifest_sha256=receipt.manifest_sha256,
        request_generation=receipt.request_generation,
        state_generation=receipt.state_generation,
        parent_state_generation=receipt.parent_state_generation,
        cache_generation=receipt.cache_generation,
        frontier=receipt.frontier,
        selected_positions=receipt.selected_positions,
        protected_positions=receipt.protected_positions,
        position_origin=receipt.position_origin,
        owner_budgets=receipt.owner_budgets,
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
    if summaries.row_codes is not None:
        _check_row_codes(summaries, keys, summaries.row_codes)
    means = summaries.page_value_mean
    if means is not None and not value_mean_matches(means, rows.v, counts):
        raise ViewRejected("page value means differ from the host rows' means",
                           field="sidecar.page_value_mean")


def _check_row_codes(summaries: PageSummaries, keys: torch.Tensor, codes: torch.Tensor) -> None:
    """The row codes are the host rows' own: encoded as the prefill worker encodes them, against
    the page boxes just checked, so a code shifted to another row or tampered is refused."""
    page = summaries.row_page  # [N]
    low, high = (t.float().index_select(0, page) for t in (summaries.page_min, summaries.page_max))
    if not torch.equal(encode_codes(keys, low, high, summaries.code_bits), codes):
        raise ViewRejected("row codes differ from the host rows' codes", field="sidecar.row_codes")
