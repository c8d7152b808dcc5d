"""`kvrelay eval`: presets, the HeadKV profile, the sweep, kvpress agreement and the report files.

Writes into `--out`: `eval.md` (summary tables, heat map links, kvpress agreement),
`heatmap_<placement>_<budget>pct.png` and `trials.json` (every trial, for re-plotting).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from services.evaluation import report
from services.evaluation.calibrate import CalibrationConfig, calibrate
from services.evaluation.needle_eval import SweepConfig, Trial, run_sweep
from services.evaluation.needs import require
from services.kvpolicy.head_profile import HeadProfile, checkpoint_sha256, load_profile
from services.model import LoadedModel, load

# Full: about 9 minutes of sweep on one CPU thread for the 4-layer demo checkpoint (measured
# 1.4 / 2.0 / 2.9 s per prompt at 512 / 1024 / 2048 tokens for all 52 policies; 5 prompts per
# cell -> 210 prompts), plus one calibration pass when the checkpoint has no profile.
PRESETS: dict[str, SweepConfig] = {
    "smoke": SweepConfig(
        context_lengths=(256,), depths=(0.25, 0.75), budgets=(0.25,), prompts_per_cell=1
    ),
    "full": SweepConfig(prompts_per_cell=5),
}
CALIBRATION_PRESETS: dict[str, CalibrationConfig] = {
    "smoke": CalibrationConfig(context_lengths=(256,), prompts=2),
    "full": CalibrationConfig(context_lengths=(512, 1024, 2048), prompts=16),
}
# kvpress's default window is 64 rows: prompts must keep more than that at 25%.
KVPRESS_PRESETS: dict[str, tuple[int, ...]] = {"smoke": (320,), "full": (1024, 2048)}


@dataclass(frozen=True)
class EvalOptions:
    """One `kvrelay eval` run."""

    checkpoint: Path
    out: Path
    preset: str = "smoke"
    prompts_per_cell: int | None = None
    threads: int | None = 1
    kvpress: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: {self.preset!r} is not one of {', '.join(PRESETS)}")

    def sweep(self) -> SweepConfig:
        config = PRESETS[self.preset]
        if self.prompts_per_cell is not None:
            config = replace(config, prompts_per_cell=self.prompts_per_cell)
        return config


@dataclass(frozen=True)
class ProfileSource:
    """The HeadKV profile the sweep used and where it came from."""

    profile: HeadProfile
    origin: str  # a sentence for the report


def resolve_profile(loaded: LoadedModel, options: EvalOptions, console: Console) -> ProfileSource:
    """The profile beside the checkpoint, or one calibrated now (kept in memory only)."""
    stored = load_profile(options.checkpoint)
    if stored is not None:
        stored.check_shape(loaded.config.num_layers, loaded.config.num_q_heads,
                           loaded.config.num_kv_heads)
        return ProfileSource(stored, f"`headkv_profile.safetensors` beside the checkpoint "
                                     f"(sha256 {stored.sha256})")
    config = CALIBRATION_PRESETS[options.preset]
    console.print(f"no HeadKV profile beside {options.checkpoint}: calibrating "
                  f"{config.total_prompts} prompts in memory")
    profile = calibrate(loaded, config, checkpoint_sha256(options.checkpoint))
    origin = (f"calibrated in memory for this run ({profile.provenance.prompts} prompts; "
              "`kvrelay calibrate` writes one beside the checkpoint)")
    return ProfileSource(profile, origin)


def run_eval(options: EvalOptions, console: Console | None = None) -> Path:
    """Run the sweep (and kvpress agreement), write the report; returns the Markdown path."""
    console = console or Console()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    require("matplotlib")  # before minutes of sweep, not after
    options.out.mkdir(parents=True, exist_ok=True)
    agreement_text = _kvpress_section(options, console) if options.kvpress else None
    loaded = load(options.checkpoint)
    source = resolve_profile(loaded, options, console)
    config = options.sweep()
    started = time.perf_counter()
    trials = _sweep_with_progress(loaded, config, source.profile, console)
    seconds = time.perf_counter() - started
    images = report.write_heatmaps(trials, options.out)
    (options.out / "trials.json").write_text(json.dumps([_plain(t) for t in trials], indent=1))
    markdown = options.out / "eval.md"
    markdown.write_text(_markdown(options, config, source, trials, images, seconds, agreement_text))
    console.print(report.summary_table(trials), markup=False, soft_wrap=True)
    console.print(f"wrote {markdown} and {len(images)} heat maps in {seconds:.0f} s of sweep")
    return markdown


def _sweep_with_progress(
    loaded: LoadedModel, config: SweepConfig, profile: HeadProfile, console: Console
) -> list[Trial]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("needle prompts", total=config.total_prompts)

        def advance(length: int) -> None:
            progress.update(task, advance=1, description=f"needle prompts ({length} tokens)")

        return run_sweep(loaded, config, profile, advance)


def _kvpress_section(options: EvalOptions, console: Console) -> str:
    from services.evaluation.kvpress_agreement import agreement_markdown, measure_agreement

    console.print("kvpress agreement: kvrelay SnapKV vs kvpress SnapKVPress on the same prompts")
    results = measure_agreement(options.checkpoint, KVPRESS_PRESETS[options.preset])
    return agreement_markdown(results)


def _markdown(
    options: EvalOptions,
    config: SweepConfig,
    source: ProfileSource,
    trials: list[Trial],
    images: list[Path],
    seconds: float,
    agreement: str | None,
) -> str:
    lengths = ", ".join(str(n) for n in config.context_lengths)
    depths = ", ".join(f"{100 * d:g}%" for d in config.depths)
    parts = [
        f"# Needle retrieval under KV visibility policies: `{options.checkpoint}`\n",
        f"Preset `{options.preset}`: context lengths {lengths}; needle depths {depths}; "
        f"{config.prompts_per_cell} prompt(s) per (length, placement, depth), "
        f"{config.distractors} distractor facts, question gap {config.question_gap} tokens "
        f"in placement before_filler; {len(trials)} trials in {seconds:.0f} s "
        f"({torch.get_num_threads()} torch thread(s)).\n",
        "Protocol: the prompt is prefilled up to its answer cue under the policy (SnapKV "
        f"window {config.shape.observation_window}, {config.shape.pooling.value} pooling "
        f"kernel {config.shape.pooling_kernel}); the cue `answer :` is then decoded over the "
        "packed view and the greedy next token must be the code. A budget is the share of the "
        "prompt each owner keeps, observation window included; window and sink-recent keep "
        "the same number of rows.\n",
        f"HeadKV profile: {source.origin}.\n",
        "## Accuracy per policy, budget and question placement\n",
        report.summary_table(trials),
        "\n## Full-cache accuracy per context length\n",
        report.length_table(trials),
        "\n## Rows retained (share of the full cache)\n",
        report.retained_table(trials),
        "\n## Heat maps (depth x context length)\n",
        "".join(f"![{image.stem}]({image.name})\n" for image in images),
    ]
    if agreement is not None:
        parts += ["\n", agreement]
    return "\n".join(parts)


def _plain(trial: Trial) -> dict[str, object]:
    data = asdict(trial)
    data["placement"] = trial.placement.value
    return data
