"""What `kvrelay eval` writes: accuracy tables (Markdown) and depth × length heat maps (PNG).

Aggregation is over trials (`needle_eval.Trial`); `full` has no budget and is shown next to
every budget. Heat maps: one figure per (placement, budget), one subplot per policy, rows
= needle depth, columns = context length, colour = accuracy (matplotlib, Agg backend).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.demo import needle
from services.evaluation.needle_eval import Trial
from services.evaluation.needs import require

FULL = "full"


@dataclass(frozen=True)
class Accuracy:
    correct: int
    total: int

    @property
    def value(self) -> float:
        return self.correct / self.total if self.total else 0.0

    def cell(self) -> str:
        return f"{100 * self.value:.0f}% ({self.correct}/{self.total})" if self.total else "-"


def accuracy(trials: Iterable[Trial]) -> Accuracy:
    chosen = list(trials)
    return Accuracy(sum(t.correct for t in chosen), len(chosen))


def policy_order(trials: Sequence[Trial]) -> list[str]:
    """Policies in the order the sweep ran them (full first)."""
    return list(dict.fromkeys(t.policy for t in trials))


def budgets_of(trials: Sequence[Trial]) -> list[float]:
    return sorted({t.budget for t in trials if t.budget is not None})


def placements_of(trials: Sequence[Trial]) -> list[needle.Placement]:
    return list(dict.fromkeys(t.placement for t in trials))


def _matches(trial: Trial, policy: str, budget: float) -> bool:
    return trial.policy == policy and (trial.budget == budget or trial.policy == FULL)


def summary_table(trials: Sequence[Trial]) -> str:
    """Accuracy per policy (rows) × budget × placement (columns), Markdown."""
    budgets, placements = budgets_of(trials), placements_of(trials)
    columns = [(b, p) for b in budgets for p in placements]
    header = "| policy | " + " | ".join(f"{_pct(b)} {p.value}" for b, p in columns) + " |"
    lines = [header, "| --- |" + " ---: |" * len(columns)]
    for policy in policy_order(trials):
        cells = [
            accuracy(t for t in trials if _matches(t, policy, b) and t.placement is p).cell()
            for b, p in columns
        ]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def retained_table(trials: Sequence[Trial]) -> str:
    """Mean share of the full cache's rows each policy kept, per budget (charged per owner
    row, so `expand` pays H_q rows per position)."""
    budgets = budgets_of(trials)
    lines = ["| policy | " + " | ".join(_pct(b) for b in budgets) + " |",
             "| --- |" + " ---: |" * len(budgets)]
    for policy in policy_order(trials):
        if policy == FULL:
            continue
        cells = []
        for budget in budgets:
            chosen = [t for t in trials if t.policy == policy and t.budget == budget]
            shares = [t.retained_rows / t.full_rows for t in chosen]
            cells.append(f"{100 * sum(shares) / len(shares):.1f}%" if shares else "-")
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def length_table(trials: Sequence[Trial], policy: str = FULL) -> str:
    """One policy's accuracy per placement × context length."""
    lengths = sorted({t.context_tokens for t in trials})
    lines = ["| placement | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "| --- |" + " ---: |" * len(lengths)]
    for placement in placements_of(trials):
        cells = [
            accuracy(t for t in trials if t.policy == policy and t.placement is placement
                     and t.context_tokens == n).cell()
            for n in lengths
        ]
        lines.append(f"| {placement.value} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def heat_grid(
    trials: Sequence[Trial], policy: str, budget: float, placement: needle.Placement
) -> tuple[list[float], list[int], list[list[float]]]:
    """Depths (rows), lengths (columns) and accuracy per cell of one policy."""
    chosen = [t for t in trials if _matches(t, policy, budget) and t.placement is placement]
    depths = sorted({t.depth for t in chosen})
    lengths = sorted({t.context_tokens for t in chosen})
    cells: dict[tuple[float, int], list[Trial]] = defaultdict(list)
    for trial in chosen:
        cells[(trial.depth, trial.context_tokens)].append(trial)
    grid = [[accuracy(cells[(d, n)]).value for n in lengths] for d in depths]
    return depths, lengths, grid


def write_heatmaps(trials: Sequence[Trial], out: Path) -> list[Path]:
    """One PNG per (placement, budget); returns the paths written."""
    require("matplotlib").use("Agg")
    paths = []
    for placement in placements_of(trials):
        for budget in budgets_of(trials):
            path = out / f"heatmap_{placement.value}_{_pct(budget).rstrip('%')}pct.png"
            _heatmap_figure(trials, placement, budget, path)
            paths.append(path)
    return paths


def _heatmap_figure(
    trials: Sequence[Trial], placement: needle.Placement, budget: float, path: Path
) -> None:
    import matplotlib.pyplot as plt

    policies = [p for p in policy_order(trials)
                if p == FULL or any(t.policy == p and t.budget == budget for t in trials)]
    columns = min(5, len(policies))
    rows = -(-len(policies) // columns)
    figure, axes = plt.subplots(
        rows, columns, figsize=(3.2 * columns, 2.8 * rows), squeeze=False, constrained_layout=True
    )
    image = None
    for index, axis in enumerate(axes.flat):
        if index >= len(policies):
            axis.axis("off")
            continue
        depths, lengths, grid = heat_grid(trials, policies[index], budget, placement)
        image = axis.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        _annotate(axis, grid)
        axis.set_title(policies[index], fontsize=9)
        axis.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        axis.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths], fontsize=7)
    if image is not None:
        figure.colorbar(image, ax=axes, shrink=0.6, label="accuracy")
    figure.supxlabel("context length (tokens)")
    figure.supylabel("needle depth")
    figure.suptitle(f"needle accuracy, depth x context length: budget {_pct(budget)}, "
                    f"question {placement.value}")
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _annotate(axis: Any, grid: list[list[float]]) -> None:
    """Accuracy in percent on every cell (`axis`: a matplotlib Axes)."""
    for row, values in enumerate(grid):
        for column, value in enumerate(values):
            axis.text(column, row, f"{100 * value:.0f}", ha="center", va="center", fontsize=6)


def _pct(budget: float) -> str:
    return f"{100 * budget:g}%"
