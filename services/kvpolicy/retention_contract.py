"""The decode-time retention contract of a manifest (`selection.retention`).

A manifest with a retention contract evicts rows while decoding: after each step every
(layer, owner) keeps at most `budget_rows` rows, chosen by `method` (sliding window,
StreamingLLM sinks + recent, H2O, Scissorhands, Keyformer) from the candidate rows (the
retained ones plus the step's new row). The decisions themselves are pure functions in
`services.kvpolicy.retention`; this module only declares and validates their parameters,
naming the dotted field (`selection.retention.budget_rows`) of the first bad one.

Absent (`null`), nothing is evicted at decode: a manifest written before this contract
existed keeps its canonical JSON, hence its identity (the field is omitted when null).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from enum import StrEnum

from services.echo import echo
from services.kvpolicy.errors import ManifestInvalid
from services.kvpolicy.manifest_json import normalize

PATH = "selection.retention"
# The manifest's bound on windows, sinks, budgets and cadences (`manifest.MAX_TOKENS`).
MAX_ROWS = 2**24
# Scissorhands keeps each row's low-attention history as the bits of one int64.
MAX_HISTORY_WINDOW = 63
MAX_TEMPERATURE = 1e4
MAX_SEED = 2**63 - 1


class RetentionMethod(StrEnum):
    WINDOW = "window"  # the newest `recent_window` rows
    SINK_RECENT = "sink_recent"  # StreamingLLM: the first `sinks` rows + the newest
    H2O = "h2o"  # heavy hitters by accumulated attention + the newest
    SCISSORHANDS = "scissorhands"  # drop a batch of rows most often below a threshold
    KEYFORMER = "keyformer"  # accumulated Gumbel-regularized scores + the newest

    @property
    def scores(self) -> bool:
        """Whether the method keeps score state (positional methods keep only positions)."""
        return self not in (RetentionMethod.WINDOW, RetentionMethod.SINK_RECENT)


class PositionContract(StrEnum):
    """Which positions a retained key is rotated at."""

    ORIGINAL = "original"  # keys post-RoPE at their original positions (what prefill sends)
    CACHE_LOCAL = "cache_local"  # stored pre-RoPE, rotated by their slot in the cache


class ScoreOwner(StrEnum):
    """Whose attention a row's score is: the query heads of its K/V group reduced (as SnapKV's
    GQA reduction), or one query head when owners are query heads (GQA `expand`)."""

    KV_HEAD_MEAN = "kv_head_mean"
    KV_HEAD_MAX = "kv_head_max"
    QUERY_HEAD = "query_head"


class PublishCadence(StrEnum):
    """When the decode worker tells the policy service its successor state."""

    EVERY_N_STEPS = "every_n_steps"  # every `publish_every_steps` steps, and at the end
    AT_END = "at_end"  # only when the request ends


class KeyformerNoise(StrEnum):
    GUMBEL = "gumbel"  # Gumbel noise from the declared seed (per layer and step)
    NONE = "none"  # the deterministic limit: accumulated tempered softmax


def _fail(path: str, message: str) -> typing.NoReturn:
    raise ManifestInvalid(path, message)


def _in_range(path: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"expected an integer, got {echo(value)}")
    if not low <= value <= high:
        _fail(path, f"{echo(value)} is not in [{low}, {high}]")


def _finite_in(path: str, value: object, low: float, high: float) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(typing.cast(float, value))):
        _fail(path, f"expected a finite number, got {echo(value)}")
    if not low < float(typing.cast(float, value)) <= high:
        _fail(path, f"{echo(value)} is not in ({low}, {high}]")


@dataclass(frozen=True)
class ScissorhandsParams:
    """Scissorhands (Liu et al. 2023): over the last `history_window` steps, count the steps in
    which a row's attention was below `threshold` (null: 1/t, t the candidate rows of that
    step, the paper's choice); when the buffer is over budget, drop `drop_batch` rows (or as
    many as bring it back to the budget, if more) with the highest counts outside the
    protected partition; equal counts drop the older row first."""

    history_window: int
    drop_batch: int
    threshold: float | None = None

    def __post_init__(self) -> None:
        normalize(self, f"{PATH}.scissorhands")
        _in_range(f"{PATH}.scissorhands.history_window", self.history_window, 1,
                  MAX_HISTORY_WINDOW)
        _in_range(f"{PATH}.scissorhands.drop_batch", self.drop_batch, 1, MAX_ROWS)
        if self.threshold is not None:
            _finite_in(f"{PATH}.scissorhands.threshold", self.threshold, 0.0, 1.0)


@dataclass(frozen=True)
class KeyformerParams:
    """Keyformer (Adnan et al. 2024): each step adds softmax((log p + g) / tau) to a row's
    score, p the row's attention, g Gumbel noise, and tau rising linearly from `tau_start`
    to `tau_end` over `schedule_steps` decode steps (then held). Scores accumulate only over
    the rows that survive. `noise_seed` declares the randomness: the same seed, layer and
    step give the same noise."""

    schedule_steps: int | None = None
    tau_start: float = 1.0
    tau_end: float = 2.0
    noise: KeyformerNoise = KeyformerNoise.GUMBEL
    noise_seed: int = 0

    def __post_init__(self) -> None:
        normalize(self, f"{PATH}.keyformer")
        path = f"{PATH}.keyformer"
        if self.schedule_steps is None:
            _fail(f"{path}.schedule_steps", "required: the temperature schedule's length")
        _in_range(f"{path}.schedule_steps", self.schedule_steps, 1, MAX_ROWS)
        _finite_in(f"{path}.tau_start", self.tau_start, 0.0, MAX_TEMPERATURE)
        _finite_in(f"{path}.tau_end", self.tau_end, 0.0, MAX_TEMPERATURE)
        _in_range(f"{path}.noise_seed", self.noise_seed, 0, MAX_SEED)
        if self.noise is KeyformerNoise.NONE and self.noise_seed:
            _fail(f"{path}.noise_seed", f"only meaningful with {path}.noise gumbel: leave it 0")

    def temperature(self, step: int) -> float:
        """tau at decode step `step` (0-based): linear from tau_start, held at tau_end."""
        steps = typing.cast(int, self.schedule_steps)
        frac = min(max(step, 0), steps) / steps
        return self.tau_start + frac * (self.tau_end - self.tau_start)


@dataclass(frozen=True)
class RetentionContract:
    """Decode-time retention: at most `budget_rows` rows per (layer, owner) after every step.

    `recent_window` newest rows and the first `sinks` rows form the protected partition; the
    positional methods keep exactly it (window: `budget_rows == recent_window`, sink_recent:
    `== sinks + recent_window`); the scoring ones select the rest of the budget from the
    historical rows and need room for at least one (`budget_rows > sinks + recent_window`).
    `score_owner` declares whose attention scores a row (scoring methods only).
    """

    method: RetentionMethod
    budget_rows: int
    recent_window: int
    sinks: int = 0
    positions: PositionContract = PositionContract.ORIGINAL
    score_owner: ScoreOwner = ScoreOwner.KV_HEAD_MEAN
    publish_cadence: PublishCadence = PublishCadence.EVERY_N_STEPS
    publish_every_steps: int | None = 64
    scissorhands: ScissorhandsParams | None = None
    keyformer: KeyformerParams | None = None

    def __post_init__(self) -> None:
        normalize(self, PATH)
        _in_range(f"{PATH}.budget_rows", self.budget_rows, 1, MAX_ROWS)
        _in_range(f"{PATH}.recent_window", self.recent_window, 1, MAX_ROWS)
        _in_range(f"{PATH}.sinks", self.sinks, 0, MAX_ROWS)
        if self.recent_window > self.budget_rows:
            _fail(f"{PATH}.recent_window", f"{self.recent_window} exceeds {PATH}.budget_rows"
                  f" {self.budget_rows}")
        self._check_partition()
        self._check_params()
        self._check_cadence()

    @property
    def protected_rows(self) -> int:
        return self.sinks + self.recent_window

    def _check_partition(self) -> None:
        method, protected = self.method, self.protected_rows
        named = f"{PATH}.method {method.value}"
        partition = f"{PATH}.sinks + {PATH}.recent_window = {protected}"
        if method is RetentionMethod.WINDOW and self.sinks:
            _fail(f"{PATH}.sinks", f"{named} has no sinks (sink_recent has)")
        if method is RetentionMethod.SINK_RECENT and self.sinks < 1:
            _fail(f"{PATH}.sinks", f"{named} needs at least one sink")
        if not method.scores and self.budget_rows != protected:
            _fail(f"{PATH}.budget_rows", f"{named} keeps exactly {partition} rows, got"
                  f" {self.budget_rows}")
        if method.scores and self.budget_rows <= protected:
            _fail(f"{PATH}.budget_rows", f"{self.budget_rows} leaves {named} no row to select"
                  f" beyond the protected partition ({partition})")
        if not method.scores and self.score_owner is not ScoreOwner.KV_HEAD_MEAN:
            _fail(f"{PATH}.score_owner", f"{named} scores nothing: leave the default")

    def _check_params(self) -> None:
        for name, method in (("scissorhands", RetentionMethod.SCISSORHANDS),
                             ("keyformer", RetentionMethod.KEYFORMER)):
            declared = getattr(self, name) is not None
            if declared != (self.method is method):
                _fail(f"{PATH}.{name}", f"{'required' if not declared else 'only allowed'} for"
                      f" {PATH}.method {method.value}")
        params = self.scissorhands
        if params is not None:
            droppable = self.budget_rows + 1 - self.protected_rows
            if params.drop_batch > droppable:
                _fail(f"{PATH}.scissorhands.drop_batch", f"{params.drop_batch} exceeds the"
                      f" {droppable} rows a full buffer holds outside the protected partition"
                      f" ({PATH}.budget_rows + 1 - {PATH}.sinks - {PATH}.recent_window)")

    def _check_cadence(self) -> None:
        every = self.publish_cadence is PublishCadence.EVERY_N_STEPS
        cadence = f"{PATH}.publish_cadence every_n_steps"
        if every and self.publish_every_steps is None:
            _fail(f"{PATH}.publish_every_steps", f"required for {cadence}")
        if not every and self.publish_every_steps is not None:
            _fail(f"{PATH}.publish_every_steps", f"only allowed for {cadence}")
        if self.publish_every_steps is not None:
            _in_range(f"{PATH}.publish_every_steps", self.publish_every_steps, 1, MAX_ROWS)

    def publishes_after(self, step: int, last: bool) -> bool:
        """Whether the successor committed by decode step `step` (0-based) is published."""
        if last:
            return True
        every = self.publish_every_steps
        return every is not None and (step + 1) % every == 0
