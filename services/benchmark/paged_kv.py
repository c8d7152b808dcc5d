"""`kvrelay bench paged-kv`: decode memory and step time of the padded slab cache (before issue
17) and the paged cache (after), side by side, on the same packed views in one run.

Every batch is admitted into both caches from the same views (random K/V, a random subset of
positions per (layer, owner)); the caches are sized as the decode worker sizes them. Per batch:

- ledger: rows held x bytes per row (K and V at the cache dtype, an int32 position);
- allocated: bytes of what holds them: the slabs (padded) or the pool pages in use (paged; the
  pool's own preallocation is the budget, reported separately);
- step: median ms of one decode step of the whole batch, after warm-up steps, in CPU time of
  the stepping thread (torch runs on it alone at 1 thread), so time the thread spends
  descheduled on a shared machine is not counted.

Also: the step of a mixed batch against what its rows predict from the homogeneous batch of
the same run, batch-1 full-cache ms/token at several contexts, and how many 10%-budget vs
full-cache requests one fixed KV byte budget admits. Writes a Markdown summary.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from services.kvpolicy.packing import PackedKVView, pack
from services.model.errors import InvalidModelInput, KVPoolExhausted
from services.model.kvcache import DecodeCache
from services.model.loader import LoadedModel, load
from services.model.padded_cache import PaddedDecodeCache
from services.model.paged import PagePool
from services.model.runtime import decode_step

MIB = 1024 * 1024
WARMUP_STEPS = 2
DEMO_CHECKPOINT = Path(__file__).resolve().parents[1] / "model" / "demo_checkpoint"


@dataclass(frozen=True)
class BenchConfig:
    """One run. `batch`: requests per batch (the worker's max_batch); `fraction`: the
    compressed requests' share of the context; `budget_mib`: the fixed budget of the
    admission count; `pool_mib`: the fixed page pool the timed paged caches draw from (a
    worker's KV budget; the OS backs only the pages written)."""

    checkpoint: Path = DEMO_CHECKPOINT
    context: int = 4096
    fraction: float = 0.10
    batch: int = 8
    steps: int = 16
    full_contexts: tuple[int, ...] = (1024, 4096, 16384)
    budget_mib: int = 256
    pool_mib: int = 512
    threads: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise InvalidModelInput("bench.fraction", "must be in (0, 1)")
        if self.batch < 2 or self.steps < 1 or self.context < 16:
            raise InvalidModelInput("bench", "need batch >= 2, steps >= 1, context >= 16")


@dataclass(frozen=True)
class CacheRun:
    """One cache over one batch: bytes held and median step ms."""

    ledger_bytes: int
    allocated_bytes: int
    step_ms: float
    rows: int

    @property
    def ratio(self) -> float:
        return self.allocated_bytes / self.ledger_bytes


@dataclass(frozen=True)
class BatchResult:
    label: str
    requests: int
    padded: CacheRun
    paged: CacheRun


class ViewMaker:
    """Packed views of random K/V keeping given rows per (layer, owner) of a context."""

    def __init__(self, loaded: LoadedModel, seed: int) -> None:
        self.config = loaded.config
        self.generator = torch.Generator().manual_seed(seed)

    def view(self, context: int, kept: list[list[int]]) -> PackedKVView:
        """kept[l][h]: rows that (layer, owner) keeps (the last position always among them)."""
        shape = (self.config.num_layers, self.config.num_kv_heads, context, self.config.head_dim)
        keys = torch.randn(shape, generator=self.generator)
        values = torch.randn(shape, generator=self.generator)
        selected = [[self._positions(context, n) for n in per_layer] for per_layer in kept]
        return pack(keys, values, selected)

    def uniform(self, context: int, fraction: float) -> PackedKVView:
        rows = max(1, round(fraction * context))
        owners = self.config.num_kv_heads
        return self.view(context, [[rows] * owners for _ in range(self.config.num_layers)])

    def uneven(self, context: int, fraction: float) -> PackedKVView:
        """Ada-KV-like: owners alternate 0.2x and 1.8x the mean budget (same total)."""
        owners = self.config.num_kv_heads
        shares = [0.2 if (layer + head) % 2 == 0 else 1.8 for layer in range(self.config.num_layers)
                  for head in range(owners)]
        rows = [max(1, round(share * fraction * context)) for share in shares]
        return self.view(context, [rows[layer * owners:(layer + 1) * owners]
                                   for layer in range(self.config.num_layers)])

    def _positions(self, context: int, rows: int) -> list[int]:
        if rows >= context:
            return list(range(context))
        chosen = torch.randperm(context - 1, generator=self.generator)[: rows - 1]
        return sorted(int(p) for p in chosen) + [context - 1]


def measure(loaded: LoadedModel, caches: list[DecodeCache | PaddedDecodeCache],
            views: list[PackedKVView], context: int, steps: int) -> list[CacheRun]:
    """Admit every view into each cache, warm up, then time `steps` batch steps per cache,
    alternating between the caches step by step (so both see the same machine load); bytes
    at the end."""
    tokens = [5] * len(views)
    stepped = [cast(DecodeCache, cache) for cache in caches]  # the padded one: same interface
    for cache in stepped:
        for index, view in enumerate(views):
            cache.admit_view(f"r{index}", view, frontier=context)
        for _ in range(WARMUP_STEPS):
            decode_step(loaded.model, cache, tokens)
    times: list[list[float]] = [[] for _ in caches]
    for _ in range(steps):
        for cache, spent in zip(stepped, times, strict=True):
            started = time.thread_time()
            decode_step(loaded.model, cache, tokens)
            spent.append(time.thread_time() - started)
    row_bytes = 2 * loaded.config.head_dim * loaded.dtype.itemsize + 4
    runs = []
    for held, spent in zip(caches, times, strict=True):
        if isinstance(held, DecodeCache):
            ledger = held.ledger()
            rows, allocated = ledger.rows, ledger.allocated_bytes
        else:
            rows = sum(int(held.lengths(r).sum()) for r in held.request_ids)
            allocated = held.allocated_bytes
        runs.append(CacheRun(rows * row_bytes, allocated, 1000.0 * statistics.median(spent), rows))
    return runs


def run_batch(loaded: LoadedModel, label: str, views: list[PackedKVView], context: int,
              config: BenchConfig) -> BatchResult:
    capacity = max(config.batch, len(views))
    # The paged cache draws from a fixed pool of the run's KV budget, as a decode worker's does
    # (what it allocates is the pages in use, not the pool).
    pool = PagePool.for_budget(config.pool_mib * MIB, loaded.config.head_dim, loaded.dtype,
                               loaded.device)
    padded, paged = measure(loaded, [
        PaddedDecodeCache(loaded.config, loaded.dtype, loaded.device, batch_capacity=capacity),
        DecodeCache(loaded.config, loaded.dtype, loaded.device, batch_capacity=capacity,
                    pool=pool),
    ], views, context, config.steps)
    return BatchResult(label, len(views), padded, paged)


def admitted(loaded: LoadedModel, budget_bytes: int, view: PackedKVView, context: int) -> int:
    """How many copies of `view` a fixed page pool of `budget_bytes` admits."""
    pool = PagePool.for_budget(budget_bytes, loaded.config.head_dim, loaded.dtype, loaded.device)
    cache = DecodeCache(loaded.config, loaded.dtype, loaded.device, pool=pool)
    count = 0
    try:
        while True:
            cache.admit_view(f"r{count}", view, frontier=context)
            count += 1
    except KVPoolExhausted:
        return count


def run(config: BenchConfig, out: Path | None) -> str:
    """Run every batch, print and return the Markdown report (written to `out` if given)."""
    torch.set_num_threads(config.threads)  # thread CPU time measures a step only at 1 thread
    loaded = load(config.checkpoint, dtype="float32")
    maker = ViewMaker(loaded, config.seed)
    ctx, frac, batch = config.context, config.fraction, config.batch
    small = [maker.uniform(ctx, frac) for _ in range(batch)]
    full = maker.uniform(ctx, 1.0)
    mixed16 = [full, full] + [maker.uniform(ctx, f) for f in (0.5,) * 4 + (0.25,) * 4 + (frac,) * 6]
    batches = [
        run_batch(loaded, f"{batch} requests x {frac:.0%} of {ctx}", small, ctx, config),
        run_batch(loaded, f"1 full {ctx} + {batch - 1} x {frac:.0%} of {ctx}",
                  [full, *small[: batch - 1]], ctx, config),
        run_batch(loaded, f"{batch} x uneven Ada-KV (0.2x/1.8x of {frac:.0%}) of {ctx}",
                  [maker.uneven(ctx, frac) for _ in range(batch)], ctx, config),
        run_batch(loaded, f"16 mixed: 2 full + 4 x 50% + 4 x 25% + 6 x {frac:.0%} of {ctx}",
                  mixed16, ctx, config),
    ]
    singles = [(t, run_batch(loaded, f"1 full {t}", [maker.uniform(t, 1.0)], t, config))
               for t in config.full_contexts]
    budget = config.budget_mib * MIB
    counts = (admitted(loaded, budget, small[0], ctx), admitted(loaded, budget, full, ctx))
    report = render(config, loaded, batches, singles, counts)
    print(report)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
    return report


def render(config: BenchConfig, loaded: LoadedModel, batches: list[BatchResult],
           singles: list[tuple[int, BatchResult]], counts: tuple[int, int]) -> str:
    model = loaded.config
    lines = [
        "# Paged KV: decode memory and step time follow the ledger (issue 17)",
        "",
        f"`kvrelay bench paged-kv`, one run: {config.checkpoint.name} ({model.num_layers} layers, "
        f"{model.num_kv_heads} K/V heads, d_h {model.head_dim}, {loaded.dtype}), "
        f"{config.threads} CPU thread(s), median of {config.steps} decode steps after "
        f"{WARMUP_STEPS} warm-up steps, padded and paged steps alternating; step ms is the "
        "stepping thread's CPU time. Ledger: rows held x (K + V + int32 position); allocated: "
        "the padded slabs, or the pool pages in use (16 rows each) of the fixed "
        f"{config.pool_mib} MiB page pool each paged batch draws from, as a worker's does.",
        "",
        "| batch | cache | ledger | allocated | allocated / ledger | step ms |",
        "|---|---|---|---|---|---|",
    ]
    for result in batches:
        for name, run_ in (("padded (before)", result.padded), ("paged (after)", result.paged)):
            lines.append(f"| {result.label} | {name} | {run_.ledger_bytes / MIB:.1f} MiB | "
                         f"{run_.allocated_bytes / MIB:.1f} MiB | {run_.ratio:.2f} | "
                         f"{run_.step_ms:.1f} |")
    homogeneous, mixed, _, sixteen = batches
    lines += ["", "## Mixed batch against what its rows predict", "",
              "| cache | mixed / compressed-only step | predicted by rows | mixed / predicted |",
              "|---|---|---|---|"]
    for name, pick in (("padded (before)", "padded"), ("paged (after)", "paged")):
        homo, mix = getattr(homogeneous, pick), getattr(mixed, pick)
        predicted = homo.step_ms * mix.rows / homo.rows
        lines.append(f"| {name} | {mix.step_ms / homo.step_ms:.2f} | {predicted:.1f} ms | "
                     f"{mix.step_ms / predicted:.2f} |")
    lines += ["", "## Batch-1 full cache, ms/token", "",
              "| context | padded | paged | paged / padded |", "|---|---|---|---|"]
    for context, result in singles:
        lines.append(f"| {context} | {result.padded.step_ms:.2f} | {result.paged.step_ms:.2f} | "
                     f"{result.paged.step_ms / result.padded.step_ms:.2f} |")
    lines += ["", "## Decode tokens/s at batch 16, mixed budgets", "",
              f"padded {sixteen.requests * 1000 / sixteen.padded.step_ms:.0f} tokens/s, paged "
              f"{sixteen.requests * 1000 / sixteen.paged.step_ms:.0f} tokens/s.", "",
              "## One fixed KV budget", "",
              f"A {config.budget_mib} MiB page pool admits {counts[0]} requests of "
              f"{config.fraction:.0%} of {config.context} and {counts[1]} full ones "
              f"({counts[0] / max(1, counts[1]):.1f}x).", ""]
    return "\n".join(lines)
