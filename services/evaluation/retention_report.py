"""`kvrelay eval retention`'s run and report: the sweep (every method at every budget), the long
run (positional methods past the trained context), costs; results.json, retention.md and
perplexity-vs-position PNGs under one directory (docs/results/retention/ in the repository)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from services.evaluation import retention_generate
from services.evaluation.needs import require
from services.evaluation.retention_chunked import chunked_teacher_forced
from services.evaluation.retention_eval import (
    DEFAULT_SKIP_LINES,
    DEFAULT_TEXT,
    FULL,
    METHODS,
    Cell,
    CellResult,
    cells,
    decode_cost,
    full_cache_nll,
    perplexity,
    read_tokens,
    step_costs,
    teacher_forced,
)
from services.kvpolicy.retention import state_bytes_per_row
from services.model.loader import LoadedModel, load

LONG_METHODS = ("window-decode", "sink-recent-decode", "sink-recent-local")


@dataclass(frozen=True)
class RetentionEvalOptions:
    """One run. `tokens`: the sweep's length (every method x budget); `long_tokens`: the long
    run's (positional methods at `long_budget`, past the checkpoint's trained context when
    larger than it), 0 to skip. Weights in `dtype`; K/V, attention and scores in float32."""

    checkpoint: Path
    out: Path
    text: Path = DEFAULT_TEXT
    skip_lines: int = DEFAULT_SKIP_LINES
    tokens: int = 2048
    budgets: tuple[int, ...] = (256, 512, 1024)
    methods: tuple[str, ...] = METHODS
    sinks: int = 4
    long_tokens: int = 0
    long_budget: int = 1024
    dtype: str = "bfloat16"
    bucket: int = 128
    threads: int = 1
    max_minutes: float | None = None  # each run stops reading tokens past this
    # The generation run (`retention_generate`): tokens generated after a prompt of the text's
    # first `generate_prompt` tokens, under `generate_method` at `generate_budget` rows; 0 skips.
    generate_tokens: int = 0
    generate_method: str = "sink-recent-local"
    generate_budget: int = 1024
    generate_prompt: int = 64
    generate_sample_every: int = 256

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.tokens == 1:
            raise ValueError("tokens is 0 (no sweep) or >= 2")
        if self.long_tokens < 0 or self.bucket < 1 or not (
                self.tokens or self.long_tokens or self.generate_tokens):
            raise ValueError("long_tokens >= 0, bucket >= 1, and a sweep, a long or a generation run")
        if self.generate_tokens < 0 or self.generate_budget < 1 or self.generate_prompt < 1:
            raise ValueError("generate_tokens >= 0, generate_budget >= 1 and generate_prompt >= 1")
        if self.generate_sample_every < 1:
            raise ValueError("generate_sample_every >= 1")
        if self.generate_method not in retention_generate.GENERATE_METHODS:
            raise ValueError(f"generate_method: unknown {self.generate_method!r}; known:"
                             f" {', '.join(retention_generate.GENERATE_METHODS)}")
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; known: {', '.join(METHODS)}")


@dataclass(frozen=True)
class Run:
    name: str
    tokens: int
    results: list[CellResult]
    seconds: float


def run(options: RetentionEvalOptions,
        session: retention_generate.SessionFactory | None = None) -> dict[str, Any]:
    """Measure, then write results.json, retention.md and the PNGs; returns the summary.
    `session`: the decode worker's `RetentionSession` (the generation run needs it)."""
    if options.generate_tokens and session is None:
        raise ValueError("generate_tokens: the generation run needs the decode worker's session")
    torch.set_num_threads(options.threads)
    model = load(options.checkpoint, dtype=options.dtype)
    prompt = options.generate_prompt if options.generate_tokens else 0
    needed = max(options.tokens, options.long_tokens, prompt)
    ids = read_tokens(model, options.text, options.skip_lines, needed)
    runs: list[Run] = []
    costs: dict[str, Any] = {"baseline_ms": {}, "cells": []}
    if options.tokens:
        group = cells(options.methods, options.budgets, options.sinks)
        runs.append(_measure(model, "sweep", ids[: options.tokens], group, options.max_minutes))
        costs = _costs(model, group, options.budgets)
    if options.long_tokens:
        runs.append(_measure_chunked(model, "long", ids[: options.long_tokens],
                                     cells(LONG_METHODS, (options.long_budget,), options.sinks)))
    generation = None
    if options.generate_tokens:
        assert session is not None
        generation = retention_generate.measure(
            model, options.generate_method, options.generate_budget, options.sinks,
            ids[:prompt].tolist(), options.generate_tokens, session,
            options.generate_sample_every, options.max_minutes)
    summary = _summary(options, model, runs, costs)
    if generation is not None:
        summary["generate"] = retention_generate.summary(generation)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    pngs = _plots(runs, options.bucket, options.out, model.config.max_position_embeddings)
    text = _markdown(summary, runs, options, pngs)
    if generation is not None:
        text += retention_generate.markdown(
            generation, options.max_minutes, _generate_command(options),
            retention_generate.plot(generation, options.out))
    (options.out / "retention.md").write_text(text)
    return summary


def _generate_command(options: RetentionEvalOptions) -> str:
    limit = "" if options.max_minutes is None else f" --max-minutes {options.max_minutes:g}"
    return (f"kvrelay eval retention --tokens {options.tokens} --long-tokens"
            f" {options.long_tokens} --generate-tokens {options.generate_tokens}"
            f" --generate-method {options.generate_method} --generate-budget"
            f" {options.generate_budget} --dtype {options.dtype}{limit}")


def _measure(model: LoadedModel, name: str, ids: torch.Tensor, group: list[Cell],
             max_minutes: float | None) -> Run:
    """The cells over `ids` (up to the time limit), then the full cache over the same tokens."""
    began = time.perf_counter()
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    with tqdm(total=ids.numel() - 1, desc=f"retention {name}", unit="token") as bar:
        results = teacher_forced(model, ids, group, lambda _: bar.update(1), deadline)
    read = len(results[0].nll) + 1
    full = CellResult(Cell(FULL, None, None), full_cache_nll(model, ids[:read]), read, 0.0, 0.0)
    return Run(name, read, [full, *results], time.perf_counter() - began)


def _measure_chunked(model: LoadedModel, name: str, ids: torch.Tensor, group: list[Cell]
                     ) -> Run:
    """Positional cells in chunks of queries (`retention_chunked`), then the full cache."""
    began = time.perf_counter()
    results = []
    with tqdm(total=(ids.numel() - 1) * len(group), desc=f"retention {name}",
              unit="token") as bar:
        for cell in group:
            results.append(chunked_teacher_forced(model, ids, cell, progress=bar.update))
    full = CellResult(Cell(FULL, None, None), full_cache_nll(model, ids), ids.numel(), 0.0, 0.0)
    return Run(name, ids.numel(), [full, *results], time.perf_counter() - began)


def _costs(model: LoadedModel, group: Sequence[Cell], budgets: Sequence[int]
           ) -> dict[str, Any]:
    baseline = {b: decode_cost(model, b) for b in budgets}
    decisions = step_costs(model, group)
    rows = []
    for cell in group:
        assert cell.contract is not None and cell.budget is not None
        base, own = baseline[cell.budget], decisions[cell.label]
        rows.append({"cell": cell.label, "no_eviction_ms": base, "decision_ms": own,
                     "decode_ms": base + own, "ratio": (base + own) / base,
                     "state_bytes_per_row": state_bytes_per_row(cell.contract)})
    return {"baseline_ms": {str(b): v for b, v in baseline.items()}, "cells": rows}


def _summary(options: RetentionEvalOptions, model: LoadedModel, runs: Sequence[Run],
             costs: dict[str, Any]) -> dict[str, Any]:
    def cell_summary(result: CellResult, past: int) -> dict[str, Any]:
        budget = result.cell.budget
        return {"cell": result.cell.label, "ppl": perplexity(result.nll),
                "ppl_past_largest_budget": perplexity(result.nll, past),
                "ppl_past_trained_context": perplexity(
                    result.nll, model.config.max_position_embeddings),
                "max_rows_per_owner": result.max_rows, "budget": budget,
                "bounded": budget is None or result.max_rows <= budget,
                "nll": [round(x, 4) for x in result.nll]}

    return {"checkpoint": str(options.checkpoint), "text": str(options.text),
            "skip_lines": options.skip_lines, "dtype": options.dtype,
            "options": {k: (str(v) if isinstance(v, Path) else v)
                        for k, v in asdict(options).items()},
            "trained_context": model.config.max_position_embeddings,
            "runs": [{"name": r.name, "tokens": r.tokens, "seconds": r.seconds,
                      "largest_budget": _largest(r),
                      "cells": [cell_summary(c, _largest(r)) for c in r.results]} for r in runs],
            "costs": costs}


def _largest(one: Run) -> int:
    return max(r.cell.budget for r in one.results if r.cell.budget is not None)


def bucketed(nll: Sequence[float], bucket: int) -> tuple[list[int], list[float]]:
    """Perplexity over consecutive `bucket`-token spans: (span starts, values)."""
    starts = list(range(0, len(nll), bucket))
    return starts, [perplexity(nll, s, s + bucket) for s in starts]


def _plots(runs: Sequence[Run], bucket: int, out: Path, trained: int) -> list[str]:
    require("matplotlib").use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for one in runs:
        budgets = sorted({r.cell.budget for r in one.results if r.cell.budget is not None})
        figure, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.2),
                                    squeeze=False)
        for axis, budget in zip(axes[0], budgets, strict=True):
            for result in one.results:
                if result.cell.budget not in (None, budget):
                    continue
                starts, values = bucketed(result.nll, bucket)
                axis.plot(starts, values, label=result.cell.policy, linewidth=1.2)
            axis.axvline(budget, color="grey", linestyle=":", linewidth=1)
            if one.tokens > trained:
                axis.axvline(trained, color="black", linestyle="--", linewidth=1)
            axis.set_yscale("log")
            axis.set_title(f"{one.name}: budget {budget} rows per owner")
            axis.set_xlabel(f"position (perplexity over {bucket}-token spans)")
            axis.set_ylabel("perplexity")
            axis.legend(fontsize=7)
        figure.tight_layout()
        name = f"perplexity-{one.name}.png"
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
        names.append(name)
    return names


def _markdown(summary: dict[str, Any], runs: Sequence[Run], options: RetentionEvalOptions,
              pngs: Sequence[str]) -> str:
    trained = summary["trained_context"]
    lines = [
        "# Decode-time retention: perplexity under teacher forcing\n",
        f"Checkpoint `{options.checkpoint.name}` (trained context {trained}), weights"
        f" {options.dtype}, K/V, attention and scores float32, one CPU thread. Text:"
        f" `{options.text}` (Debian package `debian-policy`, the Debian Policy Manual, GPL-2+)"
        f" from line {options.skip_lines} on. Every cell reads the same tokens one at a time"
        " through the model's own layers; after every token its retention contract (the"
        " runtime's `services.kvpolicy.retention.step`) bounds each (layer, K/V head) to the"
        " budget. The long run's positional cells read the text in chunks of 256 queries, each"
        " masked to the rows that `step` (run over the positions first) keeps for it: the"
        " same numbers as the token loop (tested), at prefill speed. `full` is the model's"
        " causal prefill over the same tokens. Command:"
        f" `kvrelay eval retention --tokens {options.tokens} --budgets"
        f" {','.join(str(b) for b in options.budgets)} --methods {','.join(options.methods)}"
        f" --long-tokens {options.long_tokens} --long-budget {options.long_budget}`.\n",
    ]
    if not runs:  # the generation run alone: its own section says what it did
        lines = [f"# Decode-time retention: bounded memory (checkpoint `{options.checkpoint.name}`,"
                 f" trained context {trained})\n"]
    for one, data in zip(runs, summary["runs"], strict=True):
        asked = options.tokens if one.name == "sweep" else options.long_tokens
        stopped = "" if one.tokens >= asked else (
            f", stopped by the {options.max_minutes:g}-minute limit of {asked} asked")
        lines += [f"\n## {one.name}: {one.tokens} tokens{stopped} ({one.seconds / 60:.1f} min)\n",
                  "| cell | ppl | ppl past the largest budget | ppl past the trained context |"
                  " max rows per owner | bounded |",
                  "|---|---|---|---|---|---|"]
        for cell in data["cells"]:
            lines.append(f"| {cell['cell']} | {_fmt(cell['ppl'])} |"
                         f" {_fmt(cell['ppl_past_largest_budget'])} |"
                         f" {_fmt(cell['ppl_past_trained_context'])} |"
                         f" {cell['max_rows_per_owner']} | {'yes' if cell['bounded'] else 'NO'} |")
    lines += ["", *[f"![perplexity vs position]({png})" for png in pngs], ""]
    if not summary["costs"]["cells"]:
        return "\n".join(lines) + "\n"
    lines += ["## Cost (one request, ms per token, one CPU thread)\n",
              "`no eviction`: a decode step holding the budget's rows per owner and dropping"
              " none; `decision`: the method's append + step over every (layer, owner) at that"
              " budget (steady state, one eviction round per step).\n",
              "| cell | no eviction | decision | decode | ratio | score state bytes/row |",
              "|---|---|---|---|---|---|"]
    for row in summary["costs"]["cells"]:
        lines.append(f"| {row['cell']} | {row['no_eviction_ms']:.1f} | {row['decision_ms']:.2f}"
                     f" | {row['decode_ms']:.1f} | {row['ratio']:.3f} |"
                     f" {row['state_bytes_per_row']} |")
    return "\n".join(lines) + "\n"


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"
