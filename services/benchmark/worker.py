"""Measurement processes: kvrelay runs in one fresh spawned process, transformers and
kvpress (both on the transformers model) in another, one after the other, never side by
side, so neither runtime's weights or caches are resident while the other is measured.
Inside a process the models and phases run in turn, each freed before the next, and every
phase's peak RSS is measured from a reset (`services.benchmark.memory`).

The child reports over a one-way pipe: `("tick", label)` after each phase (progress),
`("result", record)` for every measured record, then `("done", None)` or
`("error", traceback)`. The parent waits with a deadline and kills a child that misses it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from services.benchmark.config import LlamaShape
from services.benchmark.errors import EngineFailed

PROCESSES = ("transformers", "kvrelay")  # transformers' process also runs kvpress
# Allocations above this size get their own mapping and go back to the OS when freed,
# so a phase's resident memory does not keep an earlier phase's buffers (glibc).
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
_JOIN_S = 10.0


@dataclass(frozen=True)
class RandomModel:
    """A random-init Llama that the transformers process writes (save_pretrained) before
    anything is measured; every engine then loads these files."""

    shape: LlamaShape
    checkpoint: Path
    max_positions: int
    seed: int


@dataclass(frozen=True)
class ModelJob:
    """One model of a job. `prompts`: (context, token ids) pairs, the same ids for every
    engine of this model; contexts that do not fit the memory budget are left out."""

    name: str
    checkpoint: Path
    prompts: tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class EngineJob:
    """Everything a measurement process needs. `scratch`: a directory it may write."""

    process: str
    models: tuple[ModelJob, ...]
    budgets: tuple[float, ...]
    kvpress: bool
    decode_steps: int
    warmup_steps: int
    obs_window: int
    pooling_kernel: int
    chunk_size: int
    threads: int
    scratch: Path
    random_models: tuple[RandomModel, ...] = ()

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.decode_steps

    @property
    def compressed_budgets(self) -> tuple[float, ...]:
        return tuple(b for b in self.budgets if b < 1.0)

    @property
    def phases(self) -> int:
        """Ticks this job sends (for the progress bar)."""
        contexts = sum(len(m.prompts) for m in self.models)
        if self.process == "kvrelay":
            return contexts * (2 + len(self.budgets))  # prefill+compress, full cache, each view
        presses = len(self.compressed_budgets) if self.kvpress else 0
        return 1 + contexts * (1 + presses)  # checkpoints written, generate, each press


class Reporter:
    """The child's side of the pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def tick(self, label: str) -> None:
        self._conn.send(("tick", label))

    def result(self, record: object) -> None:
        self._conn.send(("result", record))


def run_engine(
    job: EngineJob,
    timeout_s: float,
    on_tick: Callable[[str], None],
    on_result: Callable[[object], None],
) -> None:
    """Run `job` in a fresh process; forward its ticks and records; raise EngineFailed if it
    fails, dies or does not finish within `timeout_s`."""
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    name = f"bench-{job.process}"
    process = ctx.Process(target=_child_main, args=(job, sender), name=name, daemon=True)
    with _environment(_MALLOC_ENV):
        process.start()
    sender.close()
    try:
        _pump(job, process, receiver, time.monotonic() + timeout_s, on_tick, on_result)
    finally:
        process.join(_JOIN_S)
        if process.is_alive():
            process.kill()
            process.join(_JOIN_S)


def _pump(
    job: EngineJob,
    process: mp.process.BaseProcess,
    receiver: Connection,
    deadline: float,
    on_tick: Callable[[str], None],
    on_result: Callable[[object], None],
) -> None:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise EngineFailed(job.process, "did not finish before the deadline")
        if not receiver.poll(min(remaining, 1.0)):
            if not process.is_alive() and not receiver.poll(0):
                raise EngineFailed(job.process, f"exited with code {process.exitcode}")
            continue
        try:
            kind, payload = receiver.recv()
        except EOFError:
            raise EngineFailed(job.process, f"exited with code {process.exitcode}") from None
        if kind == "done":
            return
        if kind == "error":
            raise EngineFailed(job.process, str(payload))
        (on_tick if kind == "tick" else on_result)(payload)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    # A spawned child inherits os.environ as it is at start(); restore it right after.
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _child_main(job: EngineJob, conn: Connection) -> None:
    try:
        _runner(job.process)(job, Reporter(conn))
        conn.send(("done", None))
    except BaseException:  # the parent re-raises it as EngineFailed with this traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _runner(process: str) -> Callable[[EngineJob, Reporter], None]:
    # Imported here so each child loads only its own engine (no transformers in kvrelay's).
    if process == "kvrelay":
        from services.benchmark.kvrelay_runner import run
    elif process == "transformers":
        from services.benchmark.transformers_runner import run
    else:
        raise ValueError(f"process: unknown {process!r}, expected one of {PROCESSES}")
    return run
