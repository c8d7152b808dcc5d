"""What the measurement processes report: frozen records, picklable across the process
boundary and plain enough for `dataclasses.asdict` (bench.json)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from services.benchmark.config import BenchConfig

# Engine names, one per contender.
KVRELAY_FULL = "kvrelay-full"  # DecodeCache admitted from the dense prefill K/V
KVRELAY_SNAPKV = "kvrelay-snapkv"  # SnapKV packed view (budget 1.0 packs every row)
TRANSFORMERS = "transformers"  # HF `generate`, greedy, its own DynamicCache
KVPRESS = "kvpress-snapkv"  # kvpress SnapKVPress during prefill, then greedy decode
ENGINES = (KVRELAY_FULL, KVRELAY_SNAPKV, TRANSFORMERS, KVPRESS)
COMPRESSION_STAGES = ("score", "allocate", "select", "pack")


@dataclass(frozen=True)
class PhaseMemory:
    """Resident memory of one phase of a measurement process, in bytes.

    `peak` is VmHWM after the peak was reset (/proc/self/clear_refs) when the phase began,
    so it counts everything resident during the phase (weights, runtime, caches), not
    earlier phases. `scope` is "phase", or "process" where the reset is unavailable and
    `peak` is the process lifetime peak.
    """

    start: int
    peak: int
    scope: str


@dataclass(frozen=True)
class TransactionPeak:
    """One compression's transaction peak as its ledger states it, beside what the prefill
    process measured (`Ledger.transaction_phases`, bytes; `compression` is the RSS peak
    while this compression ran, its `start` the RSS before the prompt's forward, so its Δ
    covers the source cache and observation the forward left, as the ledger does)."""

    ledger_peak: int
    phases: dict[str, int]
    compression: PhaseMemory

    @property
    def peak_stage(self) -> str:
        return max(self.phases, key=lambda stage: self.phases[stage])

    @property
    def measured(self) -> int:
        """RSS the compression added over the process before the forward (its Δ)."""
        return self.compression.peak - self.compression.start

    @property
    def ratio(self) -> float | None:
        """Ledger peak over the measured Δ (None when nothing was measured)."""
        return self.ledger_peak / self.measured if self.measured > 0 else None


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of one model, reported by the process that loaded it."""

    name: str
    description: str
    weight_bytes: int
    weight_bytes_read_per_step: (
        int  # every matrix a decode step multiplies (not the embedding rows)
    )
    kv_bytes_per_token: int  # K + V over every layer and K/V head
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class DecodeRun:
    """One engine decoding one prompt from one cache configuration.

    `step_s` holds every step, warm-up included; `tokens` starts with the token sampled
    from the prefill logits. `compression_s` are kvrelay's score/allocate/select/pack stage
    times (empty for the anchors). `kv_bytes` and `kept_rows` describe the cache the decode
    starts from (rows counted per layer and K/V head). `transaction`: kvrelay SnapKV only,
    the ledger's transaction peak of the compression this cache came from, and the
    memory measured while it ran.
    """

    model: str
    engine: str
    context: int
    budget: float
    prefill_s: float
    step_s: tuple[float, ...]
    warmup_steps: int
    tokens: tuple[int, ...]
    kept_rows: int
    kv_bytes: int
    prefill_memory: PhaseMemory
    decode_memory: PhaseMemory
    compression_s: dict[str, float] = field(default_factory=dict)
    transaction: TransactionPeak | None = None

    @property
    def ms_per_token(self) -> float:
        """Median decode step after the warm-up steps, in ms."""
        return 1000 * statistics.median(self.step_s[self.warmup_steps :])

    @property
    def tokens_per_s(self) -> float:
        return 1000 / self.ms_per_token

    @property
    def compression_overhead(self) -> float | None:
        """score+allocate+select+pack time as a fraction of the prefill forward."""
        if not self.compression_s:
            return None
        return sum(self.compression_s.values()) / self.prefill_s


@dataclass(frozen=True)
class Skip:
    """A (model, context, engine) cell left out, and why."""

    model: str
    context: int
    engine: str
    reason: str


@dataclass(frozen=True)
class Bandwidth:
    """The memory-bandwidth reference: `nbytes` copied tensor to tensor, `repeats` times.
    Counted as STREAM does for its Copy kernel: bytes read plus bytes written."""

    nbytes: int
    seconds: tuple[float, ...]
    threads: int

    @property
    def bytes_per_s(self) -> float:
        """Best repeat (the reference is a ceiling)."""
        return 2 * self.nbytes / min(self.seconds)

    def merged(self, other: Bandwidth) -> Bandwidth:
        """Both measurements' repeats (same size and threads)."""
        assert (self.nbytes, self.threads) == (other.nbytes, other.threads)
        return Bandwidth(self.nbytes, self.seconds + other.seconds, self.threads)


@dataclass(frozen=True)
class TransferNumbers:
    """The packed view moved through a gloo pair group vs a loopback TCP copy."""

    bytes_per_transfer: int
    gloo_bytes_per_s: float
    tcp_bytes_per_s: float
    layers: int
    kv_heads: int
    rows_per_head: int
    head_dim: int
    dtype: str

    @property
    def ratio(self) -> float:
        return self.gloo_bytes_per_s / self.tcp_bytes_per_s


@dataclass(frozen=True)
class GoalVerdict:
    """One of the issue's goals: PASS, FAIL or N/A (not measured in this run), with numbers."""

    goal: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:<4} {self.goal}: {self.detail}"


@dataclass(frozen=True)
class BenchReport:
    """Everything one `kvrelay bench` run measured, in one place (bench.json mirrors it)."""

    config: BenchConfig
    environment: dict[str, str]
    models: tuple[ModelFacts, ...]
    bandwidth: Bandwidth
    runs: tuple[DecodeRun, ...]
    skips: tuple[Skip, ...]
    transfer: TransferNumbers | None
    goals: tuple[GoalVerdict, ...]

    def facts(self, model: str) -> ModelFacts:
        for facts in self.models:
            if facts.name == model:
                return facts
        raise KeyError(model)
