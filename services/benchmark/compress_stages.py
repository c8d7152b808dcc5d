"""`kvrelay bench compress`: the stage times of the compression core (score, allocate, select,
pack; `services.kvpolicy.compress`) on a synthetic prompt of a given shape, and the decode
sampler's time per batch step, from one run.

The prefill tensors are synthetic and deterministic: a softmax-like observation (non-negative,
from one seeded generator), random K/V at the contract's dtype. Compression reads what the
prefill worker hands it: the observation's vote (`services.model.observation_vote`, the
reduction the runtime runs on each layer as its rows are made), whose own time is reported
beside the stages (each layer's rows reduced just after a fresh copy wrote them, as in a
prefill). Every stage is timed through
`compress`'s own `observe` hook (what the prefill worker's spans wrap), in CPU time of the
calling thread (torch runs on it alone at 1 thread), so time the thread spends descheduled on a
shared machine is not counted; each figure is the median over `repeats` compressions of the
same prompt, each after the previous one's view was released (as a prefill worker releases
a view once it is sent). The sampler is timed the same way (median of 5 x `repeats` calls)
on a batch of mixed sampling parameters (greedy, seeded temperature, top-k, top-p). Writes a
Markdown summary; with `--baseline` (the JSON of an earlier run, `--json-out`), the before /
after ratios too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from services.benchmark.errors import InvalidBenchConfig
from services.kvpolicy.compress import STAGES, Compressed, StateIdentity, compress
from services.kvpolicy.manifest import DType, TensorContract, default_manifests
from services.kvpolicy.packing import PackedKVView
from services.model import ObservationVote, observation_vote
from services.model.sampler import SamplingParams, sample


@dataclass(frozen=True)
class Shape:
    """`LxHxT`: layers, K/V heads, prompt tokens."""

    layers: int
    kv_heads: int
    tokens: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            reason = f"{text!r} is not LAYERSxKV_HEADSxTOKENS, e.g. 24x4x16384"
            raise InvalidBenchConfig("synthetic_shape", reason)
        return cls(*(int(p) for p in parts))


@dataclass(frozen=True)
class BenchConfig:
    """One run: the prompt shape, the query heads and head dim of its model, the manifests
    (names of `default_manifests`) and their budget fraction, and the sampler's batch."""

    shape: Shape = Shape(24, 4, 16384)
    q_heads: int = 16
    head_dim: int = 64
    manifests: tuple[str, ...] = ("snapkv", "snapkv-adakv", "sink-recent")
    budget_fraction: float = 0.25
    observation_window: int = 16
    repeats: int = 3
    sampler_batch: int = 16
    vocab: int = 49152
    threads: int = 1
    seed: int = 0


@dataclass(frozen=True)
class _Prefill:
    source_k: torch.Tensor  # [L, H_kv, T, d_h]
    source_v: torch.Tensor
    observation: torch.Tensor | None  # [L, H_q, W, T] fp32
    prompt_length: int
    observation_vote: ObservationVote | None = None


@dataclass(frozen=True)
class StageTimes:
    """Median ms per stage of one manifest, and what the compression kept."""

    manifest: str
    ms: dict[str, float]
    retained_rows: int
    digest: str
    view_digest: str  # of the gathered bytes: positions, offsets, K/V (format-independent)

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())


def synthetic_prefill(config: BenchConfig) -> _Prefill:
    """Observation rows that are probabilities over the visible keys, K/V in bf16."""
    shape, window = config.shape, config.observation_window
    g = torch.Generator().manual_seed(config.seed)
    obs = torch.rand(shape.layers, config.q_heads, window, shape.tokens, generator=g)
    obs /= obs.sum(dim=-1, keepdim=True)
    k = torch.randn(shape.layers, shape.kv_heads, shape.tokens, config.head_dim, generator=g)
    v = torch.randn(shape.layers, shape.kv_heads, shape.tokens, config.head_dim, generator=g)
    return _Prefill(k.to(torch.bfloat16), v.to(torch.bfloat16), obs, shape.tokens)


def time_stages(config: BenchConfig) -> list[StageTimes]:
    shape = config.shape
    dtype = DType.BFLOAT16
    tensor = TensorContract(
        shape.layers, config.q_heads, shape.kv_heads, config.head_dim, dtype, dtype
    )
    manifests = default_manifests(
        tensor, budget_fraction=config.budget_fraction, observation_window=config.observation_window
    )
    unknown = [name for name in config.manifests if name not in manifests]
    if unknown:
        raise InvalidBenchConfig("manifest", f"{unknown} not among {sorted(manifests)}")
    raw = synthetic_prefill(config)
    observation = raw.observation
    assert observation is not None
    prefill = _Prefill(raw.source_k, raw.source_v, None, raw.prompt_length,
                       observation_vote(observation))
    del raw, observation
    out = []
    for name in config.manifests:
        samples: dict[str, list[float]] = {stage: [] for stage in STAGES}

        @contextlib.contextmanager
        def observe(stage: str, samples: dict[str, list[float]] = samples) -> Iterator[None]:
            start = time.thread_time()
            yield
            samples[stage].append((time.thread_time() - start) * 1e3)

        compressed: Compressed | None = None
        for _ in range(config.repeats):
            identity = StateIdentity("bench", 1)
            # The previous view is released first, as a prefill worker releases a view once
            # it is sent: each repeat gathers into memory the process just gave back.
            compressed = None
            compressed = compress(manifests[name], prefill, identity, observe=observe)
        ms = {stage: statistics.median(samples[stage]) for stage in STAGES}
        assert compressed is not None
        view = compressed.view
        out.append(StageTimes(name, ms, view.total_rows, compressed.receipt.digest,
                              view_digest(view)))
    return out


def view_digest(view: PackedKVView) -> str:
    """SHA-256 of what a view holds: its position map, row offsets, packed K and V bytes (the
    same for two runs that gathered the same rows, whatever their receipt format)."""
    hasher = hashlib.sha256()
    for tensor in (view.original_position_map, view.row_offsets, view.packed_k, view.packed_v):
        hasher.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def time_vote(config: BenchConfig) -> float:
    """Median ms of the runtime's reduction of every layer's window rows into the vote, each
    layer's rows reduced just after they were written (a fresh copy, as the prefill reduces a
    layer's rows right after its attention made them); only the reduction is timed."""
    observation = synthetic_prefill(config).observation
    assert observation is not None
    samples = []
    for _ in range(config.repeats):
        elapsed = 0.0
        for layer in range(int(observation.shape[0])):
            rows = observation[layer : layer + 1].clone()  # just made: in cache, as in a prefill
            start = time.thread_time()
            observation_vote(rows)
            elapsed += time.thread_time() - start
        samples.append(elapsed * 1e3)
    return statistics.median(samples)


def time_sampler(config: BenchConfig) -> float:
    """Median ms of one `sample` call on a batch of mixed parameters."""
    kinds = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.7, top_k=50, seed=2),
        SamplingParams(temperature=1.0, top_p=0.9, seed=3),
    ]
    batch = config.sampler_batch
    params = [kinds[b % len(kinds)] for b in range(batch)]
    g = torch.Generator().manual_seed(config.seed)
    logits = torch.randn(batch, config.vocab, generator=g) * 4
    samples = []
    for step in range(1 + 5 * config.repeats):  # the first call warms up
        start = time.thread_time()
        sample(logits, params, [step] * batch)
        samples.append((time.thread_time() - start) * 1e3)
    return statistics.median(samples[1:])


def render(config: BenchConfig, stages: list[StageTimes], sampler_ms: float, command: str,
           vote_ms: float | None = None) -> str:
    shape = config.shape
    lines = [
        "# Compression stages and sampler (issue 17, item 4)",
        "",
        f"`{command}` — synthetic prompt {shape.layers} layers x {shape.kv_heads} K/V heads x"
        f" {shape.tokens} tokens, {config.q_heads} query heads, d_h {config.head_dim}, bf16 K/V,"
        f" W_obs {config.observation_window}, budget fraction {config.budget_fraction};"
        f" {config.threads} torch thread(s); CPU ms of the calling thread, median of"
        f" {config.repeats} (each after the previous compression's view was released, as a"
        " prefill worker releases a view once it is sent).",
        "",
        "| manifest | " + " | ".join(STAGES) + " | total | retained rows | receipt digest |",
        "|---|" + "---|" * (len(STAGES) + 3),
    ]
    for s in stages:
        cells = " | ".join(f"{s.ms[stage]:.1f}" for stage in STAGES)
        tail = f"{s.total_ms:.1f} | {s.retained_rows} | `{s.digest[:16]}`"
        lines.append(f"| {s.manifest} | {cells} | {tail} |")
    if vote_ms is not None:
        lines += [
            "",
            f"Runtime vote (`observation_vote`: every layer's window rows reduced to the vote"
            f" compression reads, each layer just after its rows were made, as in a prefill):"
            f" {vote_ms:.1f} ms.",
        ]
    lines += [
        "",
        f"Sampler: one `sample` call, batch {config.sampler_batch} (greedy, seeded temperature,"
        f" top-k 50, top-p 0.9 in turn), vocab {config.vocab}: {sampler_ms:.2f} ms.",
        "",
    ]
    return "\n".join(lines)


def to_json(stages: list[StageTimes], sampler_ms: float) -> dict[str, object]:
    """What `--json-out` writes and `--baseline` reads back."""
    return {
        "stages": {
            s.manifest: {"ms": s.ms, "digest": s.digest, "view_digest": s.view_digest}
            for s in stages
        },
        "sampler_ms": sampler_ms,
    }


def render_baseline(stages: list[StageTimes], sampler_ms: float, baseline: dict[str, object],
                    label: str) -> str:
    """Before (a baseline run's JSON, e.g. of the tree before a change) against this run: ms
    per stage, their ratio, and whether the receipt digests agree."""
    before = baseline.get("stages")
    if not isinstance(before, dict):
        raise InvalidBenchConfig("baseline", "no 'stages' object")
    lines = [
        f"## Before ({label}) and after (this run)",
        "",
        "| manifest | stage | before ms | after ms | before / after |",
        "|---|---|---|---|---|",
    ]
    for s in stages:
        old = before.get(s.manifest)
        if not isinstance(old, dict):
            continue
        rows = [*STAGES, "total"]
        old_ms = {**old["ms"], "total": sum(old["ms"].values())}
        new_ms = {**s.ms, "total": s.total_ms}
        for stage in rows:
            ratio = old_ms[stage] / new_ms[stage] if new_ms[stage] > 0 else float("nan")
            cells = f"{old_ms[stage]:.1f} | {new_ms[stage]:.1f} | {ratio:.1f}x"
            lines.append(f"| {s.manifest} | {stage} | {cells} |")
        if "view_digest" in old:  # format-independent: the gathered bytes themselves
            same = "the same" if old["view_digest"] == s.view_digest else "DIFFERENT"
            lines.append(f"| {s.manifest} | gathered view (positions, offsets, K, V) | | | {same} |")
        else:
            same = "the same" if old["digest"] == s.digest else "DIFFERENT"
            lines.append(f"| {s.manifest} | receipt digest | | | {same} |")
    old_sampler = baseline.get("sampler_ms")
    if isinstance(old_sampler, int | float):
        lines.append(f"| sampler | one call | {old_sampler:.2f} | {sampler_ms:.2f} |"
                     f" {old_sampler / sampler_ms:.2f}x |")
    return "\n".join(lines) + "\n"


def run(
    config: BenchConfig,
    out: Path,
    command: str,
    *,
    baseline: Path | None = None,
    baseline_label: str = "baseline",
    json_out: Path | None = None,
) -> str:
    """Time, print and write the summary (with the baseline's comparison when given);
    returns it."""
    torch.set_num_threads(config.threads)
    stages = time_stages(config)
    vote_ms = time_vote(config)
    sampler_ms = time_sampler(config)
    report = render(config, stages, sampler_ms, command, vote_ms)
    if baseline is not None:
        try:
            data = json.loads(baseline.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidBenchConfig("baseline", f"{baseline}: {exc}") from exc
        report += "\n" + render_baseline(stages, sampler_ms, data, baseline_label)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(to_json(stages, sampler_ms), indent=1) + "\n")
    return report
