"""`kvrelay bench`: every issue-8 measurement in one run.

    plan -> bandwidth reference -> engine processes -> transfer -> goals -> outputs

Per model and context: kvrelay full-cache and SnapKV decode (prefill worker stages, then a
DecodeCache), transformers' greedy generate, kvpress SnapKVPress at each compressed budget,
all from the same checkpoint files and prompt ids (a GGUF checkpoint is converted once into
the scratch directory, `services.benchmark.models`). Each (model, engine) runs in its own
fresh process, one after another (`services.benchmark.worker`); cells whose estimated
resident memory exceeds the budget are skipped with the estimate as the reason.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from services.benchmark import models as model_files
from services.benchmark.bandwidth import measure_copy
from services.benchmark.config import BenchConfig
from services.benchmark.errors import MissingBenchDependency
from services.benchmark.goals import check_goals
from services.benchmark.memory import ModelDims, available_bytes, estimate_peak
from services.benchmark.report import print_summary, write_outputs
from services.benchmark.results import (
    BenchReport,
    DecodeRun,
    ModelFacts,
    Skip,
    TransferNumbers,
)
from services.benchmark.worker import PROCESSES, EngineJob, ModelJob, RandomModel, run_engine

_FIRST_REGULAR_TOKEN = 3  # below: pad/bos/eos of the demo tokenizer
_DEFAULT_MEMORY_SHARE = 0.7


@dataclass(frozen=True)
class Plan:
    """The engine processes to run, in order, and the cells left out."""

    jobs: tuple[EngineJob, ...]
    skips: tuple[Skip, ...]
    memory_budget_bytes: int
    # "model: 8192 -> 8157 tokens ..." for prompts cut to fit a model's positions
    fitted: tuple[str, ...] = ()


def run_bench(config: BenchConfig, out_dir: Path, console: Console | None = None) -> BenchReport:
    """Measure everything `config` asks for; write bench.json, bench.md and PNG plots to
    `out_dir`; print the tables and goal lines; return the report."""
    console = console or Console()
    require_packages(config)
    torch.set_num_threads(config.threads)
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as scratch:
        plan = make_plan(config, Path(scratch))
        console.print(
            f"memory-bandwidth reference: copying {config.bandwidth_bytes / 2**20:.0f} MiB"
        )
        before = measure_copy(config.bandwidth_bytes, config.threads)
        facts, runs = run_jobs(plan.jobs, config.engine_timeout_s, console)
        # once more after the engines: on a shared host the best of both is the fairer ceiling
        bandwidth = before.merged(measure_copy(config.bandwidth_bytes, config.threads))
    transfer = measure_transfer(config, facts, console)
    report = BenchReport(
        config=config,
        environment=environment(config, plan),
        models=tuple(facts.values()),
        bandwidth=bandwidth,
        runs=tuple(runs),
        skips=plan.skips,
        transfer=transfer,
        goals=check_goals(config.goals, runs, transfer.ratio if transfer else None),
    )
    write_outputs(report, out_dir)
    print_summary(report, out_dir, console)
    return report


def require_packages(config: BenchConfig) -> None:
    """Fail before measuring anything if a package this run needs is missing."""
    needed = (
        [("kvpress", "the kvpress SnapKVPress anchor (or pass --no-kvpress)")]
        if config.kvpress
        else []
    )
    needed += [
        ("transformers", "the transformers anchor and the random-init model"),
        ("matplotlib", "the PNG plots"),
    ]
    for package, purpose in needed:
        if importlib.util.find_spec(package) is None:
            hint = (
                "pip install kvpress==0.5.5 (it needs transformers<5.3)"
                if package == "kvpress"
                else f"pip install {package}"
            )
            raise MissingBenchDependency(package, purpose, hint)


def make_plan(config: BenchConfig, scratch: Path) -> Plan:
    """Draw the prompts and keep the (model, context) cells that fit, per process: the
    transformers process (which also writes the random checkpoints and runs kvpress) first,
    then kvrelay."""
    budget = config.memory_budget_bytes or int(_DEFAULT_MEMORY_SHARE * available_bytes())
    max_positions = max(config.contexts) + config.total_steps + 2
    skips: list[Skip] = []
    fitted: list[str] = []
    per_process: dict[str, list[ModelJob]] = {process: [] for process in PROCESSES}
    for spec in config.models:
        checkpoint = model_files.prepare(spec, scratch)
        info = model_files.describe(spec, checkpoint, max_positions)
        contexts = [fit_context(c, info.max_positions, config.total_steps) for c in config.contexts]
        fitted += [
            f"{spec.name}: {asked} -> {used} prompt tokens, so that {config.total_steps} decode "
            f"steps fit its {info.max_positions} positions"
            for asked, used in zip(config.contexts, contexts, strict=True)
            if asked != used
        ]
        for process in PROCESSES:
            prompts = []
            for context in contexts:
                reason = skip_reason(
                    info.dims, info.max_positions, process, context, config, budget
                )
                if reason is None:
                    prompts.append((context, prompt_ids(info.vocab_size, context, config.seed)))
                else:
                    skips.append(Skip(spec.name, context, process, reason))
            per_process[process].append(ModelJob(spec.name, checkpoint, tuple(prompts)))
    random = tuple(
        RandomModel(
            spec.shape, model_files.checkpoint_path(spec, scratch), max_positions, config.seed
        )
        for spec in config.models
        if spec.shape is not None
    )
    jobs = tuple(
        _job(config, process, tuple(per_process[process]), scratch, random) for process in PROCESSES
    )
    return Plan(jobs, tuple(skips), budget, tuple(fitted))


def fit_context(context: int, max_positions: int, steps: int) -> int:
    """`context`, or the longest prompt that leaves room for `steps` decode tokens (and the
    last token) when `context` overshoots the model's positions by at most an eighth: "8K"
    on an 8192-position model measures 8192 - steps - 1 prompt tokens. Larger overshoots
    stay as asked and are skipped with the reason."""
    usable = max_positions - steps - 1
    return usable if usable < context <= usable + context // 8 else context


def skip_reason(
    dims: ModelDims,
    max_positions: int,
    process: str,
    context: int,
    config: BenchConfig,
    budget: int,
) -> str | None:
    """Why this cell cannot run (None: it can)."""
    if context + config.total_steps + 1 > max_positions:
        return (
            f"{context} prompt + {config.total_steps} decode tokens exceed the model's "
            f"max_position_embeddings {max_positions}"
        )
    estimate = estimate_peak(dims, process, context, config.chunk_size, config.obs_window)
    if estimate > budget:
        return (
            f"estimated peak RSS {estimate / 2**30:.1f} GiB exceeds the memory budget "
            f"{budget / 2**30:.1f} GiB"
        )
    return None


def prompt_ids(vocab_size: int, context: int, seed: int) -> tuple[int, ...]:
    """The prompt every engine of a model reads at this context (seeded, uniform ids)."""
    generator = torch.Generator().manual_seed(seed + context)
    ids = torch.randint(_FIRST_REGULAR_TOKEN, vocab_size, (context,), generator=generator)
    return tuple(ids.tolist())


def _job(
    config: BenchConfig,
    process: str,
    models: tuple[ModelJob, ...],
    scratch: Path,
    random: tuple[RandomModel, ...],
) -> EngineJob:
    return EngineJob(
        process=process,
        models=models,
        budgets=config.budgets,
        kvpress=config.kvpress,
        decode_steps=config.decode_steps,
        warmup_steps=config.warmup_steps,
        obs_window=config.obs_window,
        pooling_kernel=config.pooling_kernel,
        chunk_size=config.chunk_size,
        threads=config.threads,
        scratch=scratch,
        random_models=random if process == "transformers" else (),
    )


def run_jobs(
    jobs: tuple[EngineJob, ...], timeout_s: float, console: Console
) -> tuple[dict[str, ModelFacts], list[DecodeRun]]:
    """Run the engine processes one after another, with a progress bar each."""
    facts: dict[str, ModelFacts] = {}
    runs: list[DecodeRun] = []

    def keep(record: object) -> None:
        if isinstance(record, ModelFacts):
            facts[record.name] = record
        elif isinstance(record, DecodeRun):
            runs.append(record)

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        for job in jobs:
            task = progress.add_task(job.process, total=job.phases)

            def tick(label: str, task: TaskID = task) -> None:
                progress.update(task, advance=1, description=label)
                if not console.is_terminal:  # a log file gets one line per finished phase
                    console.print(f"done: {label}")

            run_engine(job, timeout_s, tick, keep)
    return facts, runs


def measure_transfer(
    config: BenchConfig, facts: dict[str, ModelFacts], console: Console
) -> TransferNumbers | None:
    """A packed view of the goal model (or the last model measured) through a gloo pair
    group vs a loopback TCP copy of the same bytes (`services.transfer.bench`)."""
    from services.transfer.bench import TransferBenchConfig, run_transfer_bench

    if not facts:
        return None
    model = facts.get(config.goals.model) or list(facts.values())[-1]
    rows = max(1, round(config.transfer.budget * config.transfer.context))
    transfer = TransferBenchConfig(
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        rows_per_head=rows,
        head_dim=model.head_dim,
        dtype=model.dtype,
        repeats=config.transfer.repeats,
        threads=config.threads,
    )
    console.print(
        f"transfer: packed view of {model.name} at T={config.transfer.context}, "
        f"{config.transfer.budget:.0%} kept, gloo pair group vs loopback TCP"
    )
    result = run_transfer_bench(transfer)
    return TransferNumbers(
        bytes_per_transfer=result.bytes_per_transfer,
        gloo_bytes_per_s=result.gloo_bytes_per_s,
        tcp_bytes_per_s=result.tcp_bytes_per_s,
        layers=model.num_layers,
        kv_heads=model.num_kv_heads,
        rows_per_head=rows,
        head_dim=model.head_dim,
        dtype=model.dtype,
    )


def environment(config: BenchConfig, plan: Plan) -> dict[str, str]:
    """Host and package versions, as strings."""
    packages = ["torch", "transformers"] + (["kvpress"] if config.kvpress else [])
    env = {name: importlib.metadata.version(name) for name in packages}
    env |= {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "threads": str(config.threads),
        "memory_budget_gib": f"{plan.memory_budget_bytes / 2**30:.1f}",
    }
    if plan.fitted:
        env["prompt lengths cut"] = "; ".join(plan.fitted)
    return env
