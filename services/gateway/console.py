"""Rich views of what the gateway and the policy service return, for `kvrelay generate`,
`kvrelay chat`, `kvrelay policies` and `kvrelay demo`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.gateway.client import ChatHistory, GatewayClient, Generation
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy import PolicyClient, PolicyClientConfig
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2
from services.security.transport import TransportSecurity


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
    if summary.HasField("retention"):
        r = summary.retention
        rows += [
            ("decode-time retention", f"{r.prompt_method} + {r.decode_method} ({r.positions})"),
            ("rows per owner (budget / most held)", f"{r.budget_rows} / {r.resident_max}"),
            ("evicted rows / successors published", f"{r.evicted_rows:,} / {r.publications}"),
        ]
    for fallback in summary.fallbacks:
        rows.append(("fallback", fallback))
    for item, value in rows:
        table.add_row(item, value)
    return table


def summary_line(summary: gateway_pb2.GenerateSummary) -> str:
    """One line per chat turn: tokens, timings, why it stopped and the byte ledger."""
    ledger = summary.ledger
    return (
        f"{summary.output_tokens} tokens ({summary.prompt_tokens} prompt)"
        f" · ttft {summary.ttft_ms:.1f} ms · tpot {summary.tpot_ms:.1f} ms"
        f" · {finish_label(summary.finish_reason)}"
        f" · KV {ledger.visible_payload_bytes:,} of {ledger.full_payload_bytes:,} bytes retained"
        f" · {summary.bytes_moved:,} bytes moved"
    )


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


def stream_reply(
    client: GatewayClient, request: gateway_pb2.GenerateRequest, console: Console
) -> Generation:
    """Print the reply's text as it arrives, end the line, and return everything the call sent."""
    ids: list[int] = []
    pieces: list[str] = []
    for event in client.stream(request):
        if event.HasField("summary"):
            console.print()
            return Generation(tuple(ids), "".join(pieces), event.summary)
        ids.append(event.token.token_id)
        pieces.append(event.token.text)
        console.print(event.token.text, end="", markup=False, highlight=False, soft_wrap=True)
        console.file.flush()
    raise RuntimeError(f"gateway {client.address} ended the stream without a summary")


USER_PROMPT = "you> "
ASSISTANT_PREFIX = "assistant> "
CHAT_HELP = "type a message; /reset clears the conversation, /exit (or end of input) quits"


def chat_loop(
    client: GatewayClient,
    history: ChatHistory,
    make_request: Callable[[gateway_pb2.ChatMessages], gateway_pb2.GenerateRequest],
    console: Console,
    *,
    summary: bool = False,
    read_line: Callable[[str], str] = input,
) -> None:
    """`kvrelay chat`: read user turns until end of input or `/exit`, stream each reply and
    keep the conversation in `history`; `/reset` clears it. A failed turn is reported and not
    kept, so the conversation goes on."""
    console.print(f"[dim]{CHAT_HELP}[/dim]")
    while True:
        try:
            user = read_line(USER_PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if user == "/exit":
            return
        if user == "/reset":
            history.reset()
            console.print("[dim](conversation cleared)[/dim]")
        elif user:
            _chat_turn(client, history, user, make_request(history.prompt(user)), console, summary)


def _chat_turn(
    client: GatewayClient,
    history: ChatHistory,
    user: str,
    request: gateway_pb2.GenerateRequest,
    console: Console,
    summary: bool,
) -> None:
    console.print(ASSISTANT_PREFIX, end="", markup=False, highlight=False)
    try:
        reply = stream_reply(client, request, console)
    except grpc.RpcError as exc:
        console.print(f"\n[red]{exc.code().name}[/red]: {escape(exc.details() or '')} "
                      "[dim](turn not kept; /reset if the conversation no longer fits)[/dim]")
        return
    except KeyboardInterrupt:  # leaving the stream cancelled the call
        console.print("\n[dim](reply interrupted, turn not kept)[/dim]")
        return
    history.record(user, reply.text)
    if summary:
        line = f"[{summary_line(reply.summary)}]"
        console.print(line, style="dim", markup=False, highlight=False, soft_wrap=True)


async def registered_policies(
    policy_address: str, register: Sequence[Path] = (), timeout_s: float = 5.0,
    security: TransportSecurity | None = None,
) -> list[tuple[str, KVVisibilityPolicyManifest]]:
    """Register `register` manifest files (idempotent), then every registered manifest."""
    config = PolicyClientConfig(policy_address, timeout_s=timeout_s,
                                security=security or TransportSecurity.local_plaintext())
    async with PolicyClient(config) as client:
        for path in register:
            await client.register_manifest(path.read_bytes())
        refs = await client.list_manifests()
        stored = [await client.get_manifest(ref.sha256) for ref in refs]
    return [(s.ref.sha256, KVVisibilityPolicyManifest.from_json(s.canonical_json)) for s in stored]
