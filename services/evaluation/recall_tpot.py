"""Decode time with recall against irrecoverable SnapKV, in paired rounds in one process
(`kvrelay bench recall-tpot`).

Why paired rounds: on a shared host the irrecoverable step of the same batch has measured
83-203 ms in runs minutes apart, so a ratio between two groups decoded a minute apart
(`kvrelay eval recall`'s tables) moves by more than the goal's 1.3x. Here every round decodes
the irrecoverable batch and each recall variant's batch back to back on the same prompts
(alternating the order round by round: ABBA), a round's ratios compare groups seconds apart,
and the median over rounds is the figure. Wall time per answer step is the TPOT a user
waits for; CPU time (every thread of the process: the recall planner's and the fetches'
included) is what the step costs the host.

    report = run(checkpoint, TpotConfig(task=0, length=4096, budget=0.10, batch=8), out_dir)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from services.evaluation import ruler
from services.evaluation.recall_ruler import (
    CODES,
    TASKS,
    VALUES,
    VALUES_AHEAD,
    RecallRulerConfig,
    RecallRulerRunner,
    RecallVariant,
    forward_for,
)
from services.evaluation.ruler_suite import REPORT_SEED, TUNE_SEED
from services.model.loader import load

BASELINE = "snapkv"


@dataclass(frozen=True)
class TpotConfig:
    """One (task, length, budget) at one batch size: `rounds` paired rounds."""

    task: int = 0  # index into `recall_ruler.TASKS`
    length: int = 4096
    budget: float = 0.10
    batch: int = 8
    rounds: int = 4
    prompts: int = 4  # distinct prompts (at most the batch), repeated to fill the batch
    variants: tuple[RecallVariant, ...] = (CODES, VALUES_AHEAD, VALUES)
    seed: int = REPORT_SEED
    filler_tokens: int = ruler.DEFAULT_FILLER_TOKENS

    def __post_init__(self) -> None:
        if not 0 <= self.task < len(TASKS):
            raise ValueError(f"task must be in [0, {len(TASKS)}), got {self.task}")
        for name, value in (("batch", self.batch), ("rounds", self.rounds),
                            ("prompts", self.prompts)):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0.0 < self.budget < 1.0:
            raise ValueError(f"budget must be in (0, 1), got {self.budget}")
        if not self.variants:
            raise ValueError("name at least one recall variant")


@dataclass(frozen=True)
class Measured:
    """One group decoded once: mean wall and CPU ms per answer step, and what it answered."""

    wall_ms: float
    cpu_ms: float
    outputs: tuple[str, ...]
    recalls: tuple[int, ...]


@dataclass(frozen=True)
class TpotResult:
    config: TpotConfig
    policies: tuple[str, ...]  # the baseline first
    rounds: tuple[dict[str, Measured], ...]

    def ratios(self, policy: str, field: str = "wall_ms") -> list[float]:
        """Per round, the policy's step time over the baseline's of the same round."""
        return [getattr(r[policy], field) / getattr(r[BASELINE], field) for r in self.rounds]

    def consistent(self, policy: str) -> bool:
        """Every round answered and recalled the same (the timings compare the same work)."""
        first = self.rounds[0][policy]
        return all((r[policy].outputs, r[policy].recalls) == (first.outputs, first.recalls)
                   for r in self.rounds)


def measure(checkpoint: Path, config: TpotConfig, threads: int | None = 1) -> TpotResult:
    """Run the rounds (this process, CPU, `threads` torch threads)."""
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load(checkpoint)
    task = TASKS[config.task]
    ruler_config = RecallRulerConfig(lengths=(config.length,), prompts=config.prompts,
                                     budgets=(config.budget,), tasks=(task,),
                                     variants=config.variants, presses=(), batch=config.batch,
                                     seed=config.seed, filler_tokens=config.filler_tokens)
    runner = RecallRulerRunner(loaded, ruler_config)
    tokenizer = loaded.require_tokenizer()
    specs = ruler_config.specs(task, config.length)[: config.batch]  # more would never decode
    prompts = [ruler.build_prompt(tokenizer, s) for s in specs]
    manifests = runner.manifests(config.length)
    shared = [forward_for(loaded, manifests[BASELINE, config.budget], list(p.prefix),
                          chunk_size=512) for p in prompts]
    policies = (BASELINE, *(f"{BASELINE}+{v.name}" for v in config.variants))
    rounds: list[dict[str, Measured]] = []
    with tqdm(total=config.rounds * len(policies), desc="recall TPOT rounds", unit="group") as bar:
        for index in range(config.rounds):
            order = policies if index % 2 == 0 else policies[::-1]
            measured: dict[str, Measured] = {}
            for policy in order:
                manifest = manifests[policy, config.budget]
                filled = [i % len(prompts) for i in range(config.batch)]
                group = [runner.request((policy, config.budget), manifest, prompts[i], i,
                                        shared[i]) for i in filled]
                rows = runner.decode(group)
                head = rows[: len(prompts)]
                measured[policy] = Measured(
                    wall_ms=1000 * statistics.mean(rows[0].step_s),
                    cpu_ms=1000 * statistics.mean(rows[0].step_cpu_s),
                    outputs=tuple(r.output for r in head),
                    recalls=tuple(r.recalls for r in head),
                )
                bar.update()
            rounds.append(measured)
    return TpotResult(config, policies, tuple(rounds))


def render(result: TpotResult, command: str, host: str, seconds: float) -> str:
    """The Markdown summary: per-round ms and ratios, and the medians."""
    config = result.config
    seeds = ("tuning prompts" if config.seed == TUNE_SEED else "report prompts") + \
        f" (seed {config.seed})"
    lines = [
        f"# Recall TPOT in paired rounds: {task_name(config.task)} at {config.length}, "
        f"{config.budget:.0%}, batch {config.batch}",
        "",
        f"`{command}`: {min(config.prompts, config.batch)} {seeds}, repeated to fill the batch; {config.rounds} "
        f"rounds, each decoding the irrecoverable batch and every variant's back to back (the "
        f"order reversed every other round); {torch.get_num_threads()} torch thread(s); {host}; "
        f"{seconds:.0f} s. Wall: ms per answer step with the whole batch decoding (the TPOT a "
        "user waits for). CPU: the same steps' CPU time over every thread of the process.",
        "",
        "| policy | wall ms per round | CPU ms per round | wall / irrecoverable, per round "
        "| median | CPU / irrecoverable, median | same answers every round |",
        "| --- | --- | --- | --- | ---: | ---: | --- |",
    ]
    for policy in result.policies:
        walls = ", ".join(f"{r[policy].wall_ms:.0f}" for r in result.rounds)
        cpus = ", ".join(f"{r[policy].cpu_ms:.0f}" for r in result.rounds)
        if policy == BASELINE:
            lines.append(f"| {policy} | {walls} | {cpus} | - | - | - | "
                         f"{'yes' if result.consistent(policy) else 'no'} |")
            continue
        wall = result.ratios(policy)
        cpu = result.ratios(policy, "cpu_ms")
        lines.append(
            f"| {policy} | {walls} | {cpus} | {', '.join(f'{x:.2f}' for x in wall)} "
            f"| {statistics.median(wall):.2f}x | {statistics.median(cpu):.2f}x "
            f"| {'yes' if result.consistent(policy) else 'no'} |")
    return "\n".join(lines) + "\n"


def write_plot(result: TpotResult, path: Path) -> Path:
    """Per-round wall ratios against the irrecoverable step, one series a variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    rounds = range(1, len(result.rounds) + 1)
    for policy in result.policies[1:]:
        axes.plot(rounds, result.ratios(policy), marker="o", label=policy)
    axes.axhline(1.3, color="grey", linestyle="--", label="goal 1.3x")
    axes.set_xticks(list(rounds))
    axes.set_xlabel("round")
    axes.set_ylabel("wall ms per step / irrecoverable")
    config = result.config
    axes.set_title(f"{task_name(config.task)} {config.length} {config.budget:.0%} "
                   f"batch {config.batch}")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def run(checkpoint: Path, config: TpotConfig, out: Path, command: str, host: Any,
        threads: int | None = 1) -> tuple[str, TpotResult]:
    """Measure, then the Markdown summary (`host`: `HostLoad`, described after the run)."""
    started = time.perf_counter()
    result = measure(checkpoint, config, threads)
    return render(result, command, host.describe("this process"),
                  time.perf_counter() - started), result


def task_name(index: int) -> str:
    """`TASKS[index]` as the report names it (`niah_single/noise`)."""
    task, haystack = TASKS[index]
    return f"{task.value}/{haystack.value}"


def task_index(name: str) -> int:
    """The index in `TASKS` of a task named `niah_single/noise` or `niah_single`."""
    for index in range(len(TASKS)):
        full = task_name(index)
        if name in (full, full.split("/")[0]):
            return index
    raise ValueError(f"unknown task {name!r}; one of "
                     f"{', '.join(task_name(i) for i in range(len(TASKS)))}")
