"""What `kvrelay eval --suite ruler` writes: the summary cells, Markdown tables and heat maps.

Accuracy is RULER's string-match score averaged over trials. A full cache has no budget and is
every budget's ceiling. Ratios put two numbers measured on the very same prompts side by side
(kvrelay vs kvpress, or a policy vs the full cache of its own engine).
"""

from __future__ import annotations

import platform
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from services.evaluation.needs import require
from services.evaluation.ruler_eval import Trial

FULL = "full"
REPORT_FILE = "ruler.md"
# kvrelay policy <-> kvpress press computing the same rule.
PAIRS = (
    ("full", "full"),
    ("snapkv/uniform/mean", "snapkv"),
    ("snapkv/adakv/mean", "adakv_snapkv"),
    (None, "expected_attention"),
)


def variant(trial: Trial) -> str:
    return f"{trial.task}/{trial.haystack}"


def summary(trials: Sequence[Trial]) -> list[dict[str, object]]:
    """Mean score and count per (engine, policy, budget, task, haystack, length, placement)."""
    groups: dict[tuple[Any, ...], list[float]] = defaultdict(list)
    for t in trials:
        groups[(t.engine, t.policy, t.budget, t.task, t.haystack, t.length, t.placement)].append(
            t.score)
    names = ("engine", "policy", "budget", "task", "haystack", "length", "placement")
    return [{**dict(zip(names, key, strict=True)), "accuracy": mean(v), "trials": len(v)}
            for key, v in groups.items()]


def _mean(trials: Iterable[Trial]) -> float | None:
    scores = [t.score for t in trials]
    return mean(scores) if scores else None


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _select(trials: Sequence[Trial], **fields: object) -> list[Trial]:
    return [t for t in trials if all(getattr(t, k) == v for k, v in fields.items())]


def _at(trials: Sequence[Trial], policy: str, budget: float | None) -> list[Trial]:
    """A policy's trials at `budget` (the full cache at any budget)."""
    return [t for t in trials if t.policy == policy and (t.policy == FULL or t.budget == budget)]


def order(trials: Sequence[Trial], attribute: str) -> list[Any]:
    return list(dict.fromkeys(getattr(t, attribute) for t in trials))


def budgets_of(trials: Sequence[Trial]) -> list[float]:
    return sorted({t.budget for t in trials if t.budget is not None})


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def baseline_table(trials: Sequence[Trial], engine: str = "kvrelay") -> str:
    """Full-cache accuracy per task variant (rows) × length × placement."""
    full = _select(trials, engine=engine, policy=FULL)
    columns = [(n, p) for n in sorted({t.length for t in full}) for p in order(full, "placement")]
    rows = []
    for name in order(full, "task"):
        for haystack in sorted({t.haystack for t in full if t.task == name}):
            chosen = _select(full, task=name, haystack=haystack)
            rows.append([f"{name}/{haystack}"] + [
                _cell(_select(chosen, length=n, placement=p)) for n, p in columns])
    rows.append(["all tasks"] + [_cell(_select(full, length=n, placement=p)) for n, p in columns])
    return _table(["task"] + [f"{n} {p}" for n, p in columns], rows)


def _cell(trials: Sequence[Trial]) -> str:
    return f"{_pct(_mean(trials))} ({len(trials)})" if trials else "-"


def policy_table(trials: Sequence[Trial], engine: str = "kvrelay") -> str:
    """Accuracy per policy × budget × placement over every task and length, and as a share of
    the full cache's accuracy on the same prompts."""
    chosen = _select(trials, engine=engine)
    columns = [(b, p) for b in budgets_of(chosen) for p in order(chosen, "placement")]
    rows = []
    for policy in order(chosen, "policy"):
        cells = []
        for budget, placement in columns:
            here = _select(_at(chosen, policy, budget), placement=placement)
            asked = {_prompt(t) for t in here}
            full = [t for t in _at(chosen, FULL, None) if _prompt(t) in asked]
            ratio = _ratio(_mean(here), _mean(full))
            cells.append(f"{_pct(_mean(here))} ({ratio})" if here else "-")
        rows.append([policy] + cells)
    return _table(["policy"] + [f"{100 * b:g}% {p}" for b, p in columns], rows)


def _prompt(trial: Trial) -> tuple[object, ...]:
    """What identifies the prompt a trial ran on."""
    return (trial.task, trial.haystack, trial.placement, trial.length, trial.index)


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def length_table(trials: Sequence[Trial], placement: str, engine: str = "kvrelay") -> str:
    """Accuracy per (policy, budget) × length, one placement, over every task."""
    chosen = _select(trials, engine=engine, placement=placement)
    lengths = sorted({t.length for t in chosen})
    rows = []
    for policy in order(chosen, "policy"):
        budgets: list[float | None] = [None] if policy == FULL else [*budgets_of(chosen)]
        for budget in budgets:
            here = _at(chosen, policy, budget)
            label = policy if budget is None else f"{policy} @{100 * budget:g}%"
            rows.append([label] + [_pct(_mean(_select(here, length=n))) for n in lengths])
    return _table(["policy"] + [f"{n}" for n in lengths], rows)


def kvpress_table(trials: Sequence[Trial]) -> str:
    """kvrelay vs kvpress on the prompts kvpress ran: `kvrelay / kvpress (ratio)`."""
    pressed = _select(trials, engine="kvpress")
    prompts = {_prompt(t) for t in pressed}
    ours = [t for t in _select(trials, engine="kvrelay") if _prompt(t) in prompts]
    columns = [(b, p) for b in budgets_of(pressed) for p in order(pressed, "placement")]
    rows = []
    for policy, press in PAIRS:
        if not _select(pressed, policy=press):
            continue
        cells = []
        for budget, placement in columns:
            a = _mean(_select(_at(ours, policy, budget), placement=placement)) if policy else None
            b = _mean(_select(_at(pressed, press, budget), placement=placement))
            cells.append(f"{_pct(a)} / {_pct(b)} ({_ratio(a, b)})")
        rows.append([f"{policy or '-'} / {press}"] + cells)
    return _table(["kvrelay / kvpress"] + [f"{100 * b:g}% {p}" for b, p in columns], rows)


def recall_table(trials: Sequence[Trial]) -> str:
    """Recall variants next to SnapKV uniform: accuracy, recalled rows and recalls per request."""
    chosen = _select(trials, engine="kvrelay")
    recall = [p for p in order(chosen, "policy") if "+recallable" in p]
    rows = []
    for policy in ["snapkv/uniform/mean", *recall]:
        for budget in budgets_of(chosen):
            for placement in order(chosen, "placement"):
                here = _select(_at(chosen, policy, budget), placement=placement)
                if not here:
                    continue
                rows.append([policy, f"{100 * budget:g}%", placement, _pct(_mean(here)),
                             f"{mean(t.recalled_rows for t in here):.0f}",
                             f"{mean(t.recalls for t in here):.1f}",
                             f"{100 * mean(t.retained_share for t in here):.1f}%"])
    return _table(["policy", "budget", "placement", "accuracy", "recalled rows/request",
                   "recalls/request", "rows retained at prefill"], rows)


def retained_table(trials: Sequence[Trial]) -> str:
    """Mean share of the full cache's rows each policy retained at prefill, per budget."""
    chosen = [t for t in trials if t.policy != FULL]
    budgets = budgets_of(chosen)
    rows = [[f"{engine}: {policy}"] + [
        _share(_select(chosen, engine=engine, policy=policy, budget=b)) for b in budgets]
        for engine in order(chosen, "engine") for policy in order(_select(chosen, engine=engine),
                                                                  "policy")]
    return _table(["policy"] + [f"{100 * b:g}%" for b in budgets], rows)


def _share(trials: Sequence[Trial]) -> str:
    return f"{100 * mean(t.retained_share for t in trials):.1f}%" if trials else "-"


# --- heat maps ---------------------------------------------------------------------------


def write_heatmaps(trials: Sequence[Trial], out: Path) -> list[Path]:
    """Policy × budget per placement, and task × length for full and SnapKV uniform."""
    require("matplotlib").use("Agg")
    kvrelay = _select(trials, engine="kvrelay")
    paths = [_policy_budget(kvrelay, out / "heatmap_policy_budget.png")]
    for placement in order(kvrelay, "placement"):
        path = out / f"heatmap_task_length_{placement}.png"
        paths.append(_task_length(_select(kvrelay, placement=placement), placement, path))
    return paths


def _policy_budget(trials: Sequence[Trial], path: Path) -> Path:
    policies = [p for p in order(trials, "policy") if p != FULL]
    budgets = budgets_of(trials)
    placements = order(trials, "placement")

    def grid(placement: str) -> list[list[float | None]]:
        return [[_mean(_select(_at(trials, p, b), placement=placement)) for b in budgets]
                for p in policies]

    panels = [(placement, grid(placement)) for placement in placements]
    _figure(panels, policies, [f"{100 * b:g}%" for b in budgets], path,
            "accuracy over every task and length: policy x budget", "budget", (4.2, 0.42))
    return path


def _task_length(trials: Sequence[Trial], placement: str, path: Path) -> Path:
    variants = list(dict.fromkeys(variant(t) for t in trials))
    lengths = sorted({t.length for t in trials})
    panels: list[tuple[str, list[list[float | None]]]] = []
    for policy, budget in [(FULL, None)] + [("snapkv/uniform/mean", b) for b in budgets_of(trials)]:
        here = _at(trials, policy, budget)
        title = policy if budget is None else f"{policy} @{100 * budget:g}%"
        panels.append((title, [[_mean(t for t in here if variant(t) == v and t.length == n)
                                for n in lengths] for v in variants]))
    _figure(panels, variants, [str(n) for n in lengths], path,
            f"accuracy per task x context length, question {placement}", "context (tokens)",
            (3.6, 0.5))
    return path


def _figure(
    panels: Sequence[tuple[str, list[list[float | None]]]],
    rows: Sequence[str],
    columns: Sequence[str],
    path: Path,
    title: str,
    xlabel: str,
    size: tuple[float, float],
) -> None:
    import matplotlib.pyplot as plt

    width, per_row = size
    figure, axes = plt.subplots(1, len(panels), squeeze=False, constrained_layout=True,
                                figsize=(width * len(panels) + 2.5, per_row * len(rows) + 1.6))
    image = None
    for axis, (name, grid) in zip(axes[0], panels, strict=True):
        values = [[float("nan") if v is None else v for v in row] for row in grid]
        image = axis.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        _annotate(axis, grid)
        axis.set_title(name, fontsize=9)
        axis.set_xticks(range(len(columns)), list(columns), fontsize=7)
        axis.set_yticks(range(len(rows)), list(rows), fontsize=7)
        axis.set_xlabel(xlabel, fontsize=8)
    if image is not None:
        figure.colorbar(image, ax=axes, shrink=0.7, label="accuracy")
    figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _annotate(axis: Any, grid: list[list[float | None]]) -> None:
    for row, values in enumerate(grid):
        for column, value in enumerate(values):
            if value is not None:
                axis.text(column, row, f"{100 * value:.0f}", ha="center", va="center", fontsize=6)


# --- the report --------------------------------------------------------------------------


def write_report(trials: Sequence[Trial], meta: dict[str, Any], out: Path) -> Path:
    """Heat maps and `ruler.md`; returns the Markdown path."""
    images = write_heatmaps(trials, out)
    sections: list[tuple[str, Callable[[], str]]] = [
        ("## Full-cache baseline (kvrelay) per task, length and placement\n\n"
         "Accuracy (trials).\n", lambda: baseline_table(trials)),
        ("## Accuracy per policy, budget and placement (every task and length)\n\n"
         "Accuracy (share of the full cache's accuracy on the same prompts).\n",
         lambda: policy_table(trials)),
        *[(f"## Accuracy per length, question `{p}` (every task)\n",
           lambda p=p: length_table(trials, p)) for p in order(trials, "placement")],
        ("## Recall of omitted rows (SnapKV uniform)\n", lambda: recall_table(trials)),
        ("## Rows retained at prefill (share of the full cache)\n", lambda: retained_table(trials)),
    ]
    if _select(trials, engine="kvpress"):
        sections.insert(2, (
            "## kvrelay vs kvpress on the same prompts\n\n"
            "`kvrelay accuracy / kvpress accuracy (ratio)`, on the prompts kvpress ran.\n",
            lambda: kvpress_table(trials)))
    if _select(trials, engine="kvpress", policy=FULL):
        sections.insert(3, ("## Full-cache baseline in transformers (kvpress runs)\n",
                            lambda: baseline_table(trials, "kvpress")))
    parts = [header(meta), left_out(meta), *[f"{title}\n{body()}" for title, body in sections],
             "## Heat maps\n\n" + "".join(f"![{p.stem}]({p.name})\n" for p in images)]
    path = out / REPORT_FILE
    path.write_text("\n".join(parts))
    return path


def header(meta: dict[str, Any]) -> str:
    """Title, what was run, seeds and the profile's origin."""
    config = meta["config"]
    lengths = ", ".join(f"{n} ({k} per task variant and placement)"
                        for n, k in zip(config["lengths"], config["prompts"], strict=True))
    variants = ", ".join(f"{t}/{h}" for t, h in config["variants"])
    policies = config["policies"]
    press = config.get("kvpress") if meta.get("kvpress") else None
    kvpress = ("not run" if press is None else
               "; ".join(f"{name} at {', '.join(f'{100 * b:g}%' for b in budgets)}"
                         for name, budgets in press["presses"])
               + f"{'; transformers full cache' if press['full'] else ''}; lengths "
               f"{', '.join(map(str, press['lengths']))} only (every kvpress run is a "
               "transformers prefill of its own)")
    seeds = meta["seeds"]
    return (
        f"# RULER-style long-context accuracy under KV visibility policies: "
        f"`{Path(meta['checkpoint']).name}`\n\n"
        f"Preset `{meta['preset']}`, {meta['seconds']:.0f} s wall time on "
        f"{meta['threads']} torch thread(s)"
        + (f" (resumed: {meta['reused_trials']} trials came from an earlier, interrupted "
           "invocation)" if meta.get("reused_trials") else "")
        + ".\n\n"
        f"- Lengths (tokens, chat template and cue included): {lengths}.\n"
        f"- Task variants: {variants}; placements: {', '.join(config['placements'])}.\n"
        f"- kvrelay policies: full, window, sink-recent, SnapKV x "
        f"{{{', '.join(policies['allocations'])}}} (GQA {policies['reduction']}), SnapKV uniform"
        f" + {{{', '.join(policies['recall_modes']) or 'no recall'}}}; budgets "
        f"{', '.join(f'{100 * b:g}%' for b in policies['budgets'])}.\n"
        f"- kvpress: {kvpress}.\n"
        f"- HeadKV profile: {meta['profile']}.\n"
        f"- Seeds: reported prompts from {seeds['report']}; prompt wording tuned on prompts "
        f"from {seeds['tune']}; HeadKV calibrated on prompts from {seeds['calibration']} "
        "(disjoint ranges).\n"
    )


def left_out(meta: dict[str, Any]) -> str:
    """What this run did not measure, and why (from the run's config, plus fixed choices)."""
    config = meta["config"]
    lines = ["## What was left out, and why\n"]
    if config["policies"]["reduction"] == "mean":
        lines.append("- GQA reductions `max` and `expand`: only `mean` (kvpress's rule) runs; each "
                     "reduction is a full set of decodes per prompt. The needle report "
                     "(`docs/results/eval`) compares all three on the demo checkpoint.")
    local = config.get("local_recall_lengths")
    if local is not None:
        lines.append(f"- `recallable_local` only at {', '.join(map(str, local))} tokens: in one "
                     "process both recallable modes recall the same rows through the same engine "
                     "(only the tier holding them differs), so their answers are equal by "
                     "construction (the table shows it where both ran); `recallable_remote` runs "
                     "at every length.")
    for length, variants in config.get("variants_at") or ():
        names = ", ".join(f"{t}/{h}" for t, h in variants)
        lines.append(f"- {length} tokens: only {names} (a prompt there costs ~2 minutes on one "
                     "thread of this shared machine).")
    press = config.get("kvpress")
    if press is not None:
        lines.append(f"- kvpress only at {', '.join(map(str, press['lengths']))} tokens, and only "
                     "the budgets listed above: every (press, budget) is its own transformers "
                     "prefill. KVzip (2-3 context replays per prefill) was not run.")
    lines += [
        "- RULER's exact wording: the answer prefix never names the key (it sits inside the "
        "observation window, which in the question-agnostic placements must not see the "
        "question), and variable tracking asks \"Which variables are assigned the value ...\" on "
        "prose: RULER's wording on its noise haystack scored 0% with the full cache "
        "(tuning seeds).",
        "- Prompts per cell are few (see above): one (task, length, placement) cell is one or "
        "two trials; the per-policy tables pool every task and length.",
        "- The prose haystack is `pydoc_data.topics` of the interpreter that ran (Python "
        f"{platform.python_version()}); another Python version gives other paragraphs.",
    ]
    return "\n".join(lines) + "\n"
