"""`kvrelay eval --suite ruler`: presets, the prompt grid, resumable results, the report files.

Writes into `--out`: `results.jsonl` (one `Trial` per line, appended as trials complete, so
`--resume` skips what an interrupted run finished), `summary.json` (accuracy per engine ×
policy × budget × task × length × placement, plus what was run), `ruler.md` and the heat maps
(`ruler_report`).

Seeds. Reported prompts come from `REPORT_SEED`; the prompt wording was tuned on prompts from
`TUNE_SEED`, and the HeadKV profile calibrated on `calibrate.RULER_CALIBRATION_SEED`: the three
ranges never meet (`ruler_eval.prompt_seed` stays within 4M of its base).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from services.evaluation import ruler, ruler_report
from services.evaluation.calibrate import RulerCalibrationConfig, calibrate_ruler
from services.evaluation.needs import require
from services.evaluation.ruler_eval import (
    PolicySet,
    RulerRunner,
    Trial,
    prompt_seed,
    suite_cells,
    trial_key,
)
from services.kvpolicy.head_profile import HeadProfile, checkpoint_sha256, load_profile
from services.kvpolicy.manifest import AllocationMethod, RecoverabilityMode
from services.model import LoadedModel, load

if TYPE_CHECKING:
    from services.evaluation.ruler_kvpress import KvpressRunner

REPORT_SEED = 20_000_000
TUNE_SEED = 5_000_000
RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
Variant = tuple[ruler.Task, ruler.Haystack]
# RULER's pairing (niah_single_1 on noise and _2 on essays, multikey and multivalue on
# essays), except variable tracking: on RULER's noise SmolLM2-135M copies the noise even with
# the full cache (tuning seeds), on prose it names part of the chain.
VARIANTS: tuple[Variant, ...] = (
    (ruler.Task.NIAH_SINGLE, ruler.Haystack.NOISE),
    (ruler.Task.NIAH_SINGLE, ruler.Haystack.PROSE),
    (ruler.Task.NIAH_MULTIKEY, ruler.Haystack.PROSE),
    (ruler.Task.NIAH_MULTIVALUE, ruler.Haystack.PROSE),
    (ruler.Task.VARIABLE_TRACKING, ruler.Haystack.PROSE),
)
PLACEMENTS = (ruler.Placement.END, ruler.Placement.BEFORE_FILLER)


@dataclass(frozen=True)
class KvpressPlan:
    """Which presses run at which budgets, at which lengths; `full` adds transformers without
    a press (every run is a transformers prefill of its own: the cost is planned here)."""

    presses: tuple[tuple[str, tuple[float, ...]], ...]
    lengths: tuple[int, ...]
    full: bool = True

    def runs(self, length: int) -> list[tuple[str, float | None]]:
        if length not in self.lengths:
            return []
        runs: list[tuple[str, float | None]] = [("full", None)] if self.full else []
        return runs + [(press, budget) for press, budgets in self.presses for budget in budgets]


@dataclass(frozen=True)
class SuiteConfig:
    """One suite run: `prompts[i]` prompts per (variant, placement) at `lengths[i]`."""

    lengths: tuple[int, ...]
    prompts: tuple[int, ...]
    variants: tuple[Variant, ...] = VARIANTS
    placements: tuple[ruler.Placement, ...] = PLACEMENTS
    policies: PolicySet = field(default_factory=PolicySet)
    kvpress: KvpressPlan | None = None
    seed: int = REPORT_SEED
    filler_tokens: int = ruler.DEFAULT_FILLER_TOKENS
    calibration: RulerCalibrationConfig = field(default_factory=RulerCalibrationConfig)
    # Lengths that run `recallable_local` besides `recallable_remote`: in one process both
    # modes recall the same rows through the same engine (only the tier differs), so the
    # second one is measured where it is cheap.
    local_recall_lengths: tuple[int, ...] | None = None  # None: every length
    # Variants per length where fewer are affordable (default: `variants` at every length).
    variants_at: tuple[tuple[int, tuple[Variant, ...]], ...] = ()

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.prompts) or not self.lengths:
            raise ValueError("lengths and prompts: one prompt count per length")
        if any(n < 1 for n in self.prompts):
            raise ValueError(f"prompts: must be >= 1, got {self.prompts}")

    def policies_at(self, length: int) -> PolicySet:
        if self.local_recall_lengths is None or length in self.local_recall_lengths:
            return self.policies
        remote = tuple(m for m in self.policies.recall_modes
                       if m is not RecoverabilityMode.RECALLABLE_LOCAL)
        return replace(self.policies, recall_modes=remote)

    def variants_of(self, length: int) -> tuple[Variant, ...]:
        return dict(self.variants_at).get(length, self.variants)

    def specs(self) -> Iterator[tuple[ruler.PromptSpec, int]]:
        """(spec, index) in run order: length, variant, index, placement. Depths are
        stratified: prompt i of n sits in [i/n, (i+1)/n), drawn per (variant, length)."""
        for length, count in zip(self.lengths, self.prompts, strict=True):
            for task, haystack in self.variants_of(length):
                for index in range(count):
                    seed = prompt_seed(self.seed, task, haystack, length, index)
                    depth = (index + random.Random(seed).random()) / count
                    for placement in self.placements:
                        yield ruler.PromptSpec(task, haystack, placement, length, depth, seed,
                                               self.filler_tokens), index


SMOKE_VARIANT: Variant = (ruler.Task.NIAH_SINGLE, ruler.Haystack.NOISE)
# Full: sized from per-prompt costs measured on the shared 2-core machine (one torch thread,
# 25 kvrelay policies per prompt): a single-needle prompt 15 / 25 / 45 / 124 s at
# 1K / 2K / 4K / 8K, a multi-value or variable-tracking one about twice that (longer answers);
# a kvpress run at 1K about 6-9 s. About 35 minutes in all.
FULL_VARIANTS: tuple[Variant, ...] = (
    (ruler.Task.NIAH_SINGLE, ruler.Haystack.PROSE),
    (ruler.Task.NIAH_MULTIKEY, ruler.Haystack.NOISE),
    (ruler.Task.NIAH_MULTIVALUE, ruler.Haystack.PROSE),
    (ruler.Task.VARIABLE_TRACKING, ruler.Haystack.PROSE),
)
PRESETS: dict[str, SuiteConfig] = {
    "smoke": SuiteConfig(
        lengths=(256,),
        prompts=(1,),
        variants=(SMOKE_VARIANT,),
        placements=PLACEMENTS,
        policies=PolicySet(budgets=(0.5,), allocations=(AllocationMethod.UNIFORM,),
                           recall_modes=(RecoverabilityMode.RECALLABLE_LOCAL,)),
        kvpress=KvpressPlan(presses=(("snapkv", (0.5,)),), lengths=(256,), full=False),
        filler_tokens=32,
        calibration=RulerCalibrationConfig(context_lengths=(256,), prompts=1),
    ),
    "full": SuiteConfig(
        lengths=(1024, 2048, 4096, 8192),
        prompts=(1, 1, 1, 1),
        variants=FULL_VARIANTS,
        variants_at=((8192, FULL_VARIANTS[:2]),),
        local_recall_lengths=(1024,),
        kvpress=KvpressPlan(
            presses=(("snapkv", (0.10, 0.25, 0.50)), ("expected_attention", (0.10, 0.25, 0.50)),
                     ("adakv_snapkv", (0.25,))),
            lengths=(1024,),
        ),
        calibration=RulerCalibrationConfig(prompts=4),
    ),
}


@dataclass(frozen=True)
class SuiteOptions:
    """One `kvrelay eval --suite ruler` run."""

    checkpoint: Path
    out: Path
    preset: str = "smoke"
    threads: int | None = 1
    kvpress: bool = True
    resume: bool = False

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: {self.preset!r} is not one of {', '.join(PRESETS)}")

    def config(self) -> SuiteConfig:
        config = PRESETS[self.preset]
        return config if self.kvpress else replace(config, kvpress=None)


@dataclass(frozen=True)
class ProfileSource:
    profile: HeadProfile
    origin: str


def resolve_profile(
    loaded: LoadedModel, options: SuiteOptions, console: Console
) -> ProfileSource | None:
    """The checkpoint's HeadKV profile (beside it or shipped), else one calibrated now; None
    when the suite runs no HeadKV policy."""
    if AllocationMethod.HEADKV not in options.config().policies.allocations:
        return None
    stored = load_profile(options.checkpoint)
    config = loaded.config
    if stored is not None:
        stored.check_shape(config.num_layers, config.num_q_heads, config.num_kv_heads)
        return ProfileSource(stored, f"the checkpoint's profile (sha256 {stored.sha256}, "
                                     f"{stored.provenance.method}, {stored.provenance.prompts} "
                                     f"prompts from seed {stored.provenance.seed})")
    calibration = options.config().calibration
    console.print(f"no HeadKV profile for {options.checkpoint}: calibrating "
                  f"{calibration.total_prompts} RULER prompts in memory")
    profile = calibrate_ruler(loaded, calibration, checkpoint_sha256(options.checkpoint))
    return ProfileSource(profile, f"calibrated in memory for this run ({profile.provenance.prompts}"
                                  f" prompts from seed {profile.provenance.seed}; `kvrelay "
                                  "calibrate` stores one)")


def run_suite(options: SuiteOptions, console: Console | None = None) -> Path:
    """Run (or resume) the suite, write results, summary and report; returns the report path."""
    console = console or Console()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    require("matplotlib")
    config = options.config()
    options.out.mkdir(parents=True, exist_ok=True)
    results = options.out / RESULTS_FILE
    done = _read_trials(results) if options.resume else []
    # Rewritten from the parsed trials: a torn last line of an interrupted run goes.
    results.write_text("".join(json.dumps(asdict(t)) + "\n" for t in done))
    started = time.perf_counter()
    loaded = load(options.checkpoint)
    source = resolve_profile(loaded, options, console)
    profile = source.profile if source is not None else None
    runner = RulerRunner(loaded, config.policies, profile)
    press = _kvpress_runner(loaded, options, config, console)
    keys = {t.key for t in done}
    specs = list(config.specs())
    def press_runs(length: int) -> list[tuple[str, float | None]]:
        return config.kvpress.runs(length) if press is not None and config.kvpress else []

    units = sum(1 + len(press_runs(s.length)) for s, _ in specs)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    tokenizer = loaded.require_tokenizer()
    with Progress(*columns, console=console) as progress, results.open("a") as sink:
        bar = progress.add_task("ruler", total=units)
        for spec, index in specs:
            label = f"{spec.task.value}/{spec.haystack.value} {spec.placement.value} {spec.length}"
            progress.update(bar, description=label)
            prompt = ruler.build_prompt(tokenizer, spec)
            policies = config.policies_at(spec.length)
            if not _kvrelay_done(loaded, policies, profile, spec, index, keys):
                _append(sink, runner.run_prompt(prompt, index, policies))
            progress.advance(bar)
            for name, budget in press_runs(spec.length):
                key = trial_key("kvpress", name, budget, spec.task.value, spec.haystack.value,
                                spec.placement.value, spec.length, index)
                if press is not None and key not in keys:
                    _append(sink, [press.run(prompt, index, name, budget)])
                progress.advance(bar)
    seconds = time.perf_counter() - started
    trials = _read_trials(results)
    meta = {**_meta(options, config, source, seconds, press), "reused_trials": len(done)}
    (options.out / SUMMARY_FILE).write_text(
        json.dumps({"run": meta, "cells": ruler_report.summary(trials)}, indent=1))
    markdown = ruler_report.write_report(trials, meta, options.out)
    console.print(f"wrote {markdown} ({len(trials)} trials, {seconds:.0f} s)")
    return markdown


def _kvpress_runner(
    loaded: LoadedModel, options: SuiteOptions, config: SuiteConfig, console: Console
) -> KvpressRunner | None:
    if config.kvpress is None:
        return None
    from services.evaluation.ruler_kvpress import KvpressRunner

    console.print("kvpress: the checkpoint's weights in transformers")
    return KvpressRunner(loaded, options.checkpoint, config.policies.shape)


def _kvrelay_done(
    loaded: LoadedModel, policies: PolicySet, profile: HeadProfile | None,
    spec: ruler.PromptSpec, index: int, keys: set[tuple[object, ...]],
) -> bool:
    labels = [(c.label, c.cell.budget) for c in suite_cells(loaded, policies, 256, profile)]
    return all(
        trial_key("kvrelay", label, budget, spec.task.value, spec.haystack.value,
                  spec.placement.value, spec.length, index) in keys
        for label, budget in labels
    )


def _append(sink: object, trials: list[Trial]) -> None:
    for trial in trials:
        sink.write(json.dumps(asdict(trial)) + "\n")  # type: ignore[attr-defined]
    sink.flush()  # type: ignore[attr-defined]


def _read_trials(path: Path) -> list[Trial]:
    """Trials of a results file; a torn last line (an interrupted write) is dropped."""
    if not path.is_file():
        return []
    trials = []
    for line in path.read_text().splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        trials.append(Trial(**{**data, "answers": tuple(data["answers"])}))
    return trials


def _meta(
    options: SuiteOptions, config: SuiteConfig, source: ProfileSource | None, seconds: float,
    press: KvpressRunner | None,
) -> dict[str, object]:
    plain = asdict(config)
    return {
        "checkpoint": str(options.checkpoint),
        "preset": options.preset,
        "threads": torch.get_num_threads(),
        "seconds": seconds,
        "profile": source.origin if source is not None else "not used (no HeadKV policy)",
        "config": json.loads(json.dumps(plain, default=str)),
        "kvpress": press is not None,
        "seeds": {"report": config.seed, "tune": TUNE_SEED, "calibration": config.calibration.seed},
    }
