"""bench.json, bench.md and the console summary of one `kvrelay bench` run.

Every table row is one `Row` (a decode run plus its derived numbers), computed once and
rendered to JSON, Markdown and rich alike; ratios compare numbers of this run only.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from services.benchmark import bandwidth as bw
from services.benchmark.goals import find
from services.benchmark.results import (
    KVPRESS,
    KVRELAY_FULL,
    KVRELAY_SNAPKV,
    TRANSFORMERS,
    BenchReport,
    DecodeRun,
    PhaseMemory,
)

_MIB = 2**20

NOTES = (
    "Decode ms/token: median of the steps after the warm-up steps, batch 1, greedy. kvrelay "
    "and kvpress time each model forward plus the argmax; transformers times the gap between "
    "two calls of a logits processor inside `generate` (forward plus generate's bookkeeping).",
    "Prefill: kvrelay's is the prefill worker's forward (chunked, with observation capture); "
    "its compression overhead is score+allocate+select+pack (the `prefill_worker.pipeline` stage "
    "functions) over that forward. kvpress's prefill includes its compression (forward hooks).",
    "Peak RSS: kvrelay runs in one fresh process, transformers and kvpress (same model object, "
    "kvpress imported up front) in another, one after the other; models and phases run in turn, "
    "each freed before the next. A phase's peak is VmHWM after resetting it at the phase's start "
    "(/proc/self/clear_refs): everything resident during the phase (interpreter, libraries, "
    "weights, caches); Δ is that peak minus the RSS at the phase's start, i.e. what the phase "
    "itself added. kvrelay's decode phase holds only the cache it decodes from (the prefill "
    "side's K/V wait on disk, as they would travel to a decode worker); transformers and kvpress "
    "decode in the process that ran their prefill.",
    "Transaction peak: the ledger's `transaction_peak_bytes` of each compression (source "
    "cache and observation attention, plus the largest stage: scoring's input check, vote, "
    "pooling and GQA buffers; allocation; selection; packing with source and view together; "
    "`services.kvpolicy.workspace`) against the peak RSS measured while that compression ran, "
    "minus the RSS before the prompt's forward (so the source and observation the forward "
    "left count on both sides), and against the whole prefill phase's Δ (forward included, "
    "whose activations and chunk attention the ledger does not count). The measured side also "
    "holds what no ledger term counts: Python objects (position tuples), allocator slack, "
    "freed memory glibc has not returned.",
    "KV bytes: the cache a decode starts from (K + V rows; kvrelay's packed-view metadata "
    "excluded). Achieved bandwidth: (KV bytes + weight bytes a step multiplies) / median step; "
    "the reference is a tensor copy counted as read + write bytes (STREAM Copy), best of 5 "
    "repeats before and 5 after the engines. A "
    "decode step mostly reads, which can run faster than a copy, so a share near or above 100% "
    "means the step is bandwidth-bound. `bytes / full`: the bytes a step reads over the full "
    "cache's, i.e. the ms ratio a purely bandwidth-bound decode would show.",
    "kvpress stores GQA caches per K/V head: SnapKVPress averages the window attention over "
    "each K/V head's query-head group, keeps the same number of rows (max(1, int(T x (1 - "
    "compression_ratio))), the observation window included) in every (layer, K/V head), and the "
    "DynamicCache stays [B, H_kv, T_kept, d_h] per layer. kvrelay's `snapkv` policy here: the "
    "same window, avg pooling with the same kernel, GQA mean, uniform allocation, "
    "ceil(T x budget) rows per (layer, K/V head) including the protected window.",
)


_CONSOLE_COLUMNS = (
    "T",
    "engine",
    "budget",
    "prefill s",
    "ms/token",
    "KV MiB",
    "compress / prefill",
    "RSS decode MiB (Δ)",
    "of copy",
)


@dataclass(frozen=True)
class Row:
    """One decode run and its derived numbers."""

    run: DecodeRun
    achieved_bytes_per_s: float
    bandwidth_fraction: float

    def plain(self) -> dict[str, Any]:
        r = self.run
        return asdict(r) | {
            "ms_per_token": r.ms_per_token,
            "tokens_per_s": r.tokens_per_s,
            "compression_overhead": r.compression_overhead,
            "achieved_bytes_per_s": self.achieved_bytes_per_s,
            "bandwidth_fraction": self.bandwidth_fraction,
            "transaction_ratio": None if r.transaction is None else r.transaction.ratio,
        }


def rows(report: BenchReport) -> list[Row]:
    """Every run, ordered by model, context, engine, budget (descending)."""
    order = {
        engine: i for i, engine in enumerate((KVRELAY_FULL, KVRELAY_SNAPKV, TRANSFORMERS, KVPRESS))
    }
    runs = sorted(report.runs, key=lambda r: (r.model, r.context, order[r.engine], -r.budget))
    out = []
    for run in runs:
        facts = report.facts(run.model)
        out.append(
            Row(
                run, bw.achieved(run, facts), bw.fraction_of_reference(run, facts, report.bandwidth)
            )
        )
    return out


def ratios(report: BenchReport, run: DecodeRun) -> dict[str, float | None]:
    """ms/token of a kvrelay SnapKV run over its full cache and over each anchor
    (< 1: kvrelay is faster)."""

    def over(engine: str, budget: float) -> float | None:
        other = find(report.runs, run.model, engine, run.context, budget)
        return None if other is None else run.ms_per_token / other.ms_per_token

    return {
        "kvrelay_full": over(KVRELAY_FULL, 1.0),
        "bytes_vs_full": bytes_vs_full(report, run),
        "transformers": over(TRANSFORMERS, 1.0),
        "kvpress": over(KVPRESS, run.budget),
    }


def bytes_vs_full(report: BenchReport, run: DecodeRun) -> float | None:
    """(KV + weight) bytes a step reads, over the full cache's: the ms ratio a purely
    bandwidth-bound decode would show (its inverse is the speedup ceiling)."""
    full = find(report.runs, run.model, KVRELAY_FULL, run.context, 1.0)
    if full is None:
        return None
    facts = report.facts(run.model)
    return bw.bytes_per_step(run, facts) / bw.bytes_per_step(full, facts)


def same_tokens(report: BenchReport, run: DecodeRun, engine: str, budget: float) -> bool | None:
    other = find(report.runs, run.model, engine, run.context, budget)
    return None if other is None else other.tokens == run.tokens


def write_outputs(report: BenchReport, out_dir: Path) -> list[Path]:
    """bench.json, bench.md and the PNG plots; returns the paths written."""
    from services.benchmark.plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(
        json.dumps(to_plain(report), indent=2, default=str, allow_nan=False)
    )
    plots = write_plots(report, rows(report), out_dir)
    (out_dir / "bench.md").write_text(markdown(report, [p.name for p in plots]))
    return [out_dir / "bench.json", out_dir / "bench.md", *plots]


def to_plain(report: BenchReport) -> dict[str, Any]:
    """The JSON document: the records, the derived numbers and the ratios."""
    snapkv = [r for r in report.runs if r.engine == KVRELAY_SNAPKV]
    return {
        "config": asdict(report.config),
        "environment": report.environment,
        "models": [asdict(f) for f in report.models],
        "bandwidth": asdict(report.bandwidth) | {"bytes_per_s": report.bandwidth.bytes_per_s},
        "runs": [row.plain() for row in rows(report)],
        "ratios": [
            {"model": r.model, "context": r.context, "budget": r.budget, **ratios(report, r)}
            for r in snapkv
        ],
        "skips": [asdict(s) for s in report.skips],
        "transfer": None
        if report.transfer is None
        else asdict(report.transfer) | {"ratio": report.transfer.ratio},
        "goals": [asdict(g) for g in report.goals],
    }


def markdown(report: BenchReport, plots: list[str]) -> str:
    lines = [f"# kvrelay bench (preset `{report.config.preset}`)", "", "## Setup", ""]
    lines += [f"- {key}: {value}" for key, value in report.environment.items()]
    b = report.bandwidth
    lines.append(
        f"- memory-bandwidth reference: copy of {b.nbytes / _MIB:.0f} MiB, "
        f"{b.bytes_per_s / 1e9:.2f} GB/s (read + write, best of {len(b.seconds)})"
    )
    lines += [f"- model `{f.name}`: {f.description}" for f in report.models]
    c = report.config
    lines.append(
        f"- decode: {c.decode_steps} steps after {c.warmup_steps} warm-up; SnapKV window "
        f"{c.obs_window}, pooling kernel {c.pooling_kernel}; prefill chunk {c.chunk_size}"
    )
    lines += ["", "## Goals", "", "```", *(g.line() for g in report.goals), "```"]
    for model in report.models:
        lines += [
            "",
            f"## Decode, model `{model.name}`",
            "",
            *_md_table(_run_header(), _run_cells(report, model.name)),
        ]
        lines += [
            "",
            f"### Ratios, model `{model.name}` (ms/token, < 1: kvrelay faster)",
            "",
            *_md_table(_ratio_header(), _ratio_cells(report, model.name)),
        ]
        lines += [
            "",
            f"### Transaction peak, model `{model.name}`: ledger vs measured",
            "",
            *_md_table(_peak_header(), _peak_cells(report, model.name)),
        ]
    lines += ["", "## Transfer", "", _transfer_line(report)]
    if report.skips:
        lines += ["", "## Skipped", ""] + [
            f"- {s.model}, T={s.context}, {s.engine}: {s.reason}" for s in report.skips
        ]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    lines += ["", "## How it was measured", ""] + [f"- {note}" for note in NOTES]
    return "\n".join(lines) + "\n"


def print_summary(report: BenchReport, out_dir: Path, console: Console) -> None:
    """The decode and ratio tables (fewer columns than bench.md), transfer, skips, goals."""
    header = _run_header()
    keep = [header.index(name) for name in _CONSOLE_COLUMNS]
    for model in report.models:
        table = Table(title=f"decode, model {model.name} (all columns: bench.md)")
        for index in keep:
            table.add_column(header[index], justify="right")
        for cells in _run_cells(report, model.name):
            table.add_row(*(cells[index] for index in keep))
        console.print(table)
        ratio_table = Table(title=f"ratios, model {model.name} (ms/token; < 1: kvrelay faster)")
        for name in _ratio_header():
            ratio_table.add_column(name, justify="right")
        for cells in _ratio_cells(report, model.name):
            ratio_table.add_row(*cells)
        console.print(ratio_table)
        peak_table = Table(title=f"transaction peak, model {model.name}: ledger vs measured")
        for name in _peak_header():
            peak_table.add_column(name, justify="right")
        for cells in _peak_cells(report, model.name):
            peak_table.add_row(*cells)
        console.print(peak_table)
    console.print(_transfer_line(report))
    for skip in report.skips:
        console.print(f"skipped {skip.model} T={skip.context} {skip.engine}: {skip.reason}")
    for goal in report.goals:
        console.print(goal.line())
    console.print(f"wrote {out_dir / 'bench.json'}, {out_dir / 'bench.md'} and plots")


def _run_header() -> list[str]:
    return [
        "T",
        "engine",
        "budget",
        "prefill s",
        "ms/token",
        "tok/s",
        "kept rows",
        "KV MiB",
        "compress / prefill",
        "RSS prefill MiB (Δ)",
        "RSS decode MiB (Δ)",
        "GB/s",
        "of copy",
    ]


def _run_cells(report: BenchReport, model: str) -> list[list[str]]:
    out = []
    for row in (r for r in rows(report) if r.run.model == model):
        r = row.run
        overhead = r.compression_overhead
        out.append(
            [
                str(r.context),
                r.engine,
                f"{r.budget:.0%}",
                f"{r.prefill_s:.3f}",
                f"{r.ms_per_token:.2f}",
                f"{r.tokens_per_s:.1f}",
                str(r.kept_rows),
                f"{r.kv_bytes / _MIB:.1f}",
                "-" if overhead is None else f"{overhead:.2%}",
                _rss(r.prefill_memory),
                _rss(r.decode_memory),
                f"{row.achieved_bytes_per_s / 1e9:.2f}",
                f"{row.bandwidth_fraction:.0%}",
            ]
        )
    return out


def _ratio_header() -> list[str]:
    return [
        "T",
        "budget",
        "/ kvrelay full",
        "bytes / full",
        "/ transformers",
        "/ kvpress",
        "tokens = full cache",
        "full cache tokens = transformers",
    ]


def _ratio_cells(report: BenchReport, model: str) -> list[list[str]]:
    out = []
    for row in (r for r in rows(report) if r.run.model == model and r.run.engine == KVRELAY_SNAPKV):
        r = row.run
        full = find(report.runs, model, KVRELAY_FULL, r.context, 1.0)
        hf_match = None if full is None else same_tokens(report, full, TRANSFORMERS, 1.0)
        out.append(
            [
                str(r.context),
                f"{r.budget:.0%}",
                *(_num(v) for v in ratios(report, r).values()),
                _flag(same_tokens(report, r, KVRELAY_FULL, 1.0)),
                _flag(hf_match),
            ]
        )
    return out


def _peak_header() -> list[str]:
    return [
        "T",
        "budget",
        "ledger peak MiB",
        "at stage",
        "measured MiB (compression)",
        "ledger / measured",
        "measured MiB (prefill Δ)",
        "ledger / prefill Δ",
    ]


def _peak_cells(report: BenchReport, model: str) -> list[list[str]]:
    """One row per kvrelay SnapKV compression: its ledger peak and the measured peaks."""
    out = []
    for run in (r.run for r in rows(report) if r.run.model == model):
        peak = run.transaction
        if peak is None:
            continue
        prefill = run.prefill_memory.peak - run.prefill_memory.start
        out.append(
            [
                str(run.context),
                f"{run.budget:.0%}",
                f"{peak.ledger_peak / _MIB:.1f}",
                peak.peak_stage,
                f"{peak.measured / _MIB:.1f}",
                _num(peak.ratio),
                f"{prefill / _MIB:.1f}",
                _num(peak.ledger_peak / prefill if prefill > 0 else None),
            ]
        )
    return out


def _transfer_line(report: BenchReport) -> str:
    t = report.transfer
    if t is None:
        return "transfer: not measured"
    return (
        f"transfer of a packed view ({t.layers} layers x {t.kv_heads} K/V heads x "
        f"{t.rows_per_head} rows x {t.head_dim} dims, {t.dtype}, "
        f"{t.bytes_per_transfer / _MIB:.1f} MiB): gloo pair group "
        f"{t.gloo_bytes_per_s / _MIB:.0f} MiB/s, loopback TCP copy "
        f"{t.tcp_bytes_per_s / _MIB:.0f} MiB/s, gloo / TCP = {t.ratio:.2f}"
    )


def _md_table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _rss(memory: PhaseMemory) -> str:
    return f"{memory.peak / _MIB:.0f} (+{(memory.peak - memory.start) / _MIB:.0f})"


def _num(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _flag(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")
