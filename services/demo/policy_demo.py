"""`kvrelay demo`: the policy core end to end on a synthetic prompt, no model and no I/O.

forward (synthetic keys/queries) → the compression core (`services.kvpolicy.compress`: score
with SnapKV → allocate with PyramidKV → select → pack → state + receipt + ledger), printed as
tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from services.kvpolicy import snapkv
from services.kvpolicy.allocation import BudgetGrid
from services.kvpolicy.compress import StateIdentity, compress, score
from services.kvpolicy.ledger import Ledger
from services.kvpolicy.manifest import (
    DType,
    KVVisibilityPolicyManifest,
    TensorContract,
    default_manifests,
)
from services.kvpolicy.packing import PackedKVView
from services.kvpolicy.receipt import Receipt
from services.kvpolicy.state import PositionGrid

PROMPT_LEN = 48
NEEDLES = (5, 17, 29)  # positions whose keys the window queries attend to strongly


@dataclass(frozen=True)
class SyntheticPrefill:
    """What a prefill would hand the compression core, made up (`PrefillTensors`)."""

    source_k: torch.Tensor  # [L, H_kv, T, d_h]
    source_v: torch.Tensor  # [L, H_kv, T, d_h]
    observation: torch.Tensor  # [L, H_q, W, T]

    @property
    def prompt_length(self) -> int:
        return int(self.source_k.shape[2])


@dataclass(frozen=True)
class DemoResult:
    manifest: KVVisibilityPolicyManifest
    budgets: BudgetGrid
    selected: PositionGrid
    view: PackedKVView
    ledger: Ledger
    receipt: Receipt


def run_demo(console: Console | None = None, seed: int = 0) -> DemoResult:
    """Run SnapKV + PyramidKV on a synthetic prompt and print positions, budgets and ledger."""
    console = console or Console()
    torch.manual_seed(seed)
    tensor = TensorContract(
        num_layers=4,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=16,
        k_dtype=DType.FLOAT16,
        v_dtype=DType.FLOAT16,
    )
    manifest = default_manifests(tensor, observation_window=8)["snapkv-pyramid"]
    prefill = _synthetic_prefill(manifest)
    compressed = compress(manifest, prefill, StateIdentity("demo-request", 1))
    budgets = compressed.selection.budgets
    assert budgets is not None  # SnapKV always allocates
    result = DemoResult(
        manifest,
        budgets,
        compressed.selection.positions,
        compressed.view,
        compressed.ledger,
        compressed.receipt,
    )
    scores = score(manifest, prefill)
    assert scores is not None
    _print(console, result, scores)
    return result


def _synthetic_prefill(manifest: KVVisibilityPolicyManifest) -> SyntheticPrefill:
    """Random keys with a few needle positions that the observation window attends to."""
    t = manifest.tensor
    window = min(manifest.selection.protected_rows, PROMPT_LEN)
    keys = torch.randn(t.num_layers, t.num_kv_heads, PROMPT_LEN, t.head_dim)  # [L, H_kv, T, d_h]
    values = torch.randn(t.num_layers, t.num_kv_heads, PROMPT_LEN, t.head_dim)  # [L, H_kv, T, d_h]
    direction = torch.randn(t.head_dim)
    keys[:, :, list(NEEDLES)] += 3.0 * direction
    queries = (
        torch.randn(t.num_layers, t.num_q_heads, window, t.head_dim) + 3.0 * direction
    )  # [L, H_q, W, d_h]
    head_map = t.resolved_q_to_kv_head_map()
    obs_attn = torch.stack(
        [snapkv.observation_attention(q, k, head_map) for q, k in zip(queries, keys, strict=True)]
    )
    return SyntheticPrefill(keys.half(), values.half(), obs_attn)  # obs_attn: [L, H_q, W, T]


def _print(console: Console, result: DemoResult, scores: torch.Tensor) -> None:
    manifest = result.manifest
    selection = manifest.selection
    console.print(
        f"[bold]policy[/bold] {manifest.name}  sha256 {manifest.sha256[:16]}…  prompt {PROMPT_LEN} tokens"
    )
    capacity, protected = selection.capacity(PROMPT_LEN), selection.protected_rows
    console.print(
        f"capacity {capacity} rows/owner = {protected} protected (observation window)"
        f" + {capacity - protected} budget on average; needles at {list(NEEDLES)}"
    )
    console.print(_positions_table(result, scores))
    console.print(_ledger_table(result.ledger))
    console.print(f"receipt digest {result.receipt.digest}")


def _positions_table(result: DemoResult, scores: torch.Tensor) -> Table:
    table = Table(title="retained positions per layer / K/V head (SnapKV + PyramidKV)")
    for column in (
        "layer",
        "kv head",
        "budget",
        "retained",
        "selected prefix positions",
        "top score",
    ):
        table.add_column(column)
    window_start = PROMPT_LEN - min(result.manifest.selection.protected_rows, PROMPT_LEN)
    for layer, owners in enumerate(result.selected):
        for owner, positions in enumerate(owners):
            prefix = [p for p in positions if p < window_start]
            top = f"{float(scores[layer, owner].max()):.3f}" if scores.shape[-1] else "-"
            table.add_row(
                str(layer),
                str(owner),
                str(result.budgets[layer][owner]),
                str(len(positions)),
                f"{prefix} + [{window_start}..{PROMPT_LEN - 1}]",
                top,
            )
    return table


def _ledger_table(ledger: Ledger) -> Table:
    table = Table(title="byte ledger")
    table.add_column("item")
    table.add_column("rows", justify="right")
    table.add_column("bytes", justify="right")
    table.add_row("bytes per row d_h (b_K + b_V)", "1", str(ledger.bytes_per_row))
    table.add_row("full payload", str(ledger.full_rows), str(ledger.full_payload_bytes))
    table.add_row("visible payload", str(ledger.visible_rows), str(ledger.visible_payload_bytes))
    table.add_row("omitted payload", str(ledger.omitted_rows), str(ledger.omitted_payload_bytes))
    table.add_row("position map (int32)", str(ledger.visible_rows), str(ledger.position_map_bytes))
    table.add_row("row offsets (int32)", "", str(ledger.offsets_bytes))
    table.add_row("transfer traffic", "", str(ledger.traffic_bytes))
    table.add_row("transaction peak", "", str(ledger.transaction_peak_bytes))
    table.add_row(
        "query-expanded read demand",
        str(ledger.query_expanded_rows),
        str(ledger.query_expanded_rows * ledger.bytes_per_row),
    )
    return table
