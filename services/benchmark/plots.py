"""PNG plots of one bench run (matplotlib, Agg backend: no display needed).

Per model: decode ms/token against context for every engine and budget, and the achieved
share of the copy bandwidth at the longest context. For all models: kvrelay's compression
overhead (score+allocate+select+pack over prefill) against context.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.benchmark.report import Row
from services.benchmark.results import KVRELAY_FULL, KVRELAY_SNAPKV, TRANSFORMERS, BenchReport


def write_plots(report: BenchReport, rows: list[Row], out_dir: Path) -> list[Path]:
    """Write the plots into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for model in report.models:
        model_rows = [r for r in rows if r.run.model == model.name]
        if model_rows:
            paths.append(
                _save(
                    plt,
                    _decode_plot(plt, model.name, model_rows),
                    out_dir / f"decode_{model.name}.png",
                )
            )
            paths.append(
                _save(
                    plt,
                    _bandwidth_plot(plt, model.name, model_rows),
                    out_dir / f"bandwidth_{model.name}.png",
                )
            )
    overhead = [r for r in rows if r.run.engine == KVRELAY_SNAPKV and r.run.budget < 1.0]
    if overhead:
        paths.append(
            _save(plt, _overhead_plot(plt, overhead), out_dir / "compression_overhead.png")
        )
    return paths


def _label(row: Row) -> str:
    if row.run.engine in (KVRELAY_FULL, TRANSFORMERS):
        return row.run.engine
    return f"{row.run.engine} {row.run.budget:.0%}"


def _context_axis(axes: Any, rows: list[Row]) -> None:
    contexts = sorted({r.run.context for r in rows})
    axes.set_xscale("log", base=2)
    axes.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
    axes.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)


def _series(rows: list[Row]) -> dict[str, list[Row]]:
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(_label(row), []).append(row)
    return series


def _decode_plot(plt: Any, model: str, rows: list[Row]) -> Any:
    figure, axes = plt.subplots(figsize=(8, 5))
    for label, points in _series(rows).items():
        points.sort(key=lambda r: r.run.context)
        axes.plot(
            [r.run.context for r in points],
            [r.run.ms_per_token for r in points],
            marker="o",
            label=label,
        )
    axes.set(
        yscale="log",
        xlabel="context (tokens)",
        ylabel="decode ms/token (median)",
        title=f"decode latency, model {model}",
    )
    _context_axis(axes, rows)
    axes.legend(fontsize="small")
    return figure


def _bandwidth_plot(plt: Any, model: str, rows: list[Row]) -> Any:
    longest = max(r.run.context for r in rows)
    points = [r for r in rows if r.run.context == longest]
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.barh([_label(r) for r in points], [100 * r.bandwidth_fraction for r in points])
    axes.set(
        xlabel="achieved (KV + weights) bytes/s, % of the copy reference",
        title=f"decode bandwidth at T={longest}, model {model}",
    )
    figure.tight_layout()
    return figure


def _overhead_plot(plt: Any, rows: list[Row]) -> Any:
    figure, axes = plt.subplots(figsize=(8, 5))
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(f"{row.run.model} {row.run.budget:.0%}", []).append(row)
    for label, points in series.items():
        points.sort(key=lambda r: r.run.context)
        axes.plot(
            [r.run.context for r in points],
            [100 * (r.run.compression_overhead or 0.0) for r in points],
            marker="o",
            label=label,
        )
    axes.set(
        xlabel="context (tokens)",
        ylabel="% of prefill",
        title="kvrelay compression overhead (score+allocate+select+pack)",
    )
    _context_axis(axes, rows)
    axes.legend(fontsize="small")
    return figure


def _save(plt: Any, figure: Any, path: Path) -> Path:
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
