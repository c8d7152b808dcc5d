"""Rich views of what the gateway and the policy service return, for `kvrelay generate`,
`kvrelay policies` and `kvrelay demo`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.gateway.client import GatewayClient
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import PolicyClient, PolicyClientConfig
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2


def finish_label(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def summary_table(summary: gateway_pb2.GenerateSummary, title: str = "summary") -> Table:
    """Timings, generations, rows and the byte ledger of one generation."""
    table = Table(title=title, show_header=False)
    table.add_column("item")
    table.add_column("value", justify="right")
    g, ledger = summary.generations, summary.ledger
    rows = [
        ("request", summary.request_id),
        ("ttft", f"{summary.ttft_ms:.1f} ms"),
        ("tpot", f"{summary.tpot_ms:.1f} ms"),
        ("tokens (prompt / output)", f"{summary.prompt_tokens} / {summary.output_tokens}"),
        ("finish", finish_label(summary.finish_reason)),
        ("manifest", f"{summary.manifest_sha256[:16]}…"),
        ("generations (request / state / cache)",
         f"{g.request_generation} / {g.state_generation} / {g.cache_generation}"),
        ("rows (retained / omitted)", f"{summary.retained_rows} / {summary.omitted_rows}"),
        ("KV bytes full cache", f"{ledger.full_payload_bytes:,}"),
        ("KV bytes retained", f"{ledger.visible_payload_bytes:,}"),
        ("bytes moved (payload + metadata)", f"{summary.bytes_moved:,}"),
        ("workers (prefill / decode)", f"{summary.prefill_worker} / {summary.decode_worker}"),
    ]
    for fallback in summary.fallbacks:
        rows.append(("fallback", fallback))
    for item, value in rows:
        table.add_row(item, value)
    return table


def policies_table(manifests: Sequence[tuple[str, KVVisibilityPolicyManifest]]) -> Table:
    """One row per registered manifest: (sha256, manifest)."""
    table = Table(title="registered policies")
    for column in ("name", "gen", "sha256", "method", "unit", "budget", "allocation", "omitted rows"):
        table.add_column(column)
    for sha, manifest in manifests:
        selection = manifest.selection
        budget = selection.budget
        budget_text = "-" if budget is None else (
            f"{budget.fraction:.0%} of prompt" if budget.fraction is not None else f"{budget.rows_per_owner} rows"
        )
        if selection.recent_window is not None:
            budget_text = f"last {selection.recent_window}" + (
                f" + {selection.protected.sinks} sinks" if selection.protected.sinks else "")
        table.add_row(
            manifest.name,
            str(manifest.policy_generation),
            f"{sha[:16]}…",
            selection.method.value,
            selection.unit.value,
            budget_text,
            selection.allocation.method.value if selection.allocation else "-",
            manifest.recoverability.mode.value,
        )
    return table


def print_generation(
    client: GatewayClient, request: gateway_pb2.GenerateRequest, console: Console, *, stream: bool
) -> gateway_pb2.GenerateSummary:
    """Print token text as it arrives (`stream`) or the whole answer at the end, then the summary."""
    pieces: list[str] = []
    for event in client.stream(request):
        if event.HasField("summary"):
            if not stream:
                console.print("".join(pieces).strip(), markup=False, highlight=False)
            else:
                console.print()
            console.print(summary_table(event.summary))
            return event.summary
        piece = event.token.text if request.detokenize else f"{event.token.token_id} "
        pieces.append(piece)
        if stream:
            console.print(piece, end="", markup=False, highlight=False)
            console.file.flush()
    raise RuntimeError(f"gateway {client.address} ended the stream without a summary")


async def registered_policies(
    policy_address: str, register: Sequence[Path] = (), timeout_s: float = 5.0
) -> list[tuple[str, KVVisibilityPolicyManifest]]:
    """Register `register` manifest files (idempotent), then every registered manifest."""
    async with PolicyClient(PolicyClientConfig(policy_address, timeout_s=timeout_s)) as client:
        for path in register:
            await client.register_manifest(path.read_bytes())
        refs = await client.list_manifests()
        stored = [await client.get_manifest(ref.sha256) for ref in refs]
    return [(s.ref.sha256, KVVisibilityPolicyManifest.from_json(s.canonical_json)) for s in stored]
