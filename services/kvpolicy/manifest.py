"""KV visibility policy manifests: the immutable, versioned meaning of a compression policy.

A manifest says what a decode worker may see of a request's KV cache and what it must do
when that is not enough: the tensor contract (shapes, dtypes, GQA map), the selection
contract (method, unit, budgets, protected rows, evidence, cadence, tie rule), the
representation contract (original vs replacement rows, fidelity), the recoverability
contract (whether omitted rows can be recalled and how) and quality fallbacks.

Identity is the SHA-256 of the canonical JSON (object keys sorted recursively, arrays in
order, compact separators, UTF-8). Every contract validates itself in `__post_init__`;
the manifest adds the cross-contract rules. Failures raise `ManifestInvalid` naming the
dotted field path, e.g. `selection.snapkv.observation_window`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from decimal import Decimal
from enum import StrEnum
from functools import cached_property
from typing import Any, get_type_hints

from services.kvpolicy.errors import ManifestInvalid

SCHEMA_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class DType(StrEnum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT8_E4M3FN = "float8_e4m3fn"
    FLOAT8_E5M2 = "float8_e5m2"

    @property
    def nbytes(self) -> int:
        return {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.value, 1)


class GQAGrouping(StrEnum):
    CONTIGUOUS = "contiguous"  # query head q reads K/V head q // (H_q / H_kv)
    CUSTOM = "custom"  # any surjective map declared in q_to_kv_head_map


class KeyPositionalStage(StrEnum):
    POST_ROPE = "post_rope"  # cached keys carry RoPE at their original positions
    PRE_ROPE = "pre_rope"
    NONE = "none"


class SelectionMethod(StrEnum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    SINK_RECENT = "sink_recent"
    SNAPKV = "snapkv"


class SelectionUnit(StrEnum):
    TOKEN = "token"  # one position set shared by every layer and head
    LAYER_TOKEN = "layer-token"  # one set per layer
    LAYER_HEAD_TOKEN = "layer-head-token"  # one set per (layer, owner head)


class Phase(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class EvidenceFamily(StrEnum):
    NONE = "none"
    POSITIONAL = "positional"
    OBSERVATION_ATTENTION = "observation_attention"


class UpdateCadence(StrEnum):
    NEVER = "never"
    PREFILL_ONCE = "prefill_once"
    EVERY_STEP = "every_step"


class TieRule(StrEnum):
    POSITION_ASCENDING = "position_ascending"  # equal scores: the earlier position wins
    POSITION_DESCENDING = "position_descending"  # equal scores: the later position wins


class Pooling(StrEnum):
    AVG = "avg"
    MAX = "max"
    NONE = "none"


class ScoreAggregation(StrEnum):
    SUM = "sum"
    MEAN = "mean"


class GQAReduction(StrEnum):
    MEAN = "mean"  # owners are K/V heads, storage charged at H_kv
    MAX = "max"  # owners are K/V heads, storage charged at H_kv
    EXPAND = "expand"  # owners are query heads, storage charged at H_q


class AllocationMethod(StrEnum):
    UNIFORM = "uniform"
    PYRAMIDKV = "pyramidkv"
    ADAKV = "adakv"
    HEADKV = "headkv"
    ZIGZAGKV = "zigzagkv"


class BudgetScope(StrEnum):
    OWNER = "owner"  # every owner gets exactly its capacity
    LAYER = "layer"  # each layer's total is conserved, redistributed across its owners
    GLOBAL = "global"  # only the total over all layers and owners is conserved


class RowKind(StrEnum):
    ORIGINAL_ROWS = "original_rows"
    REPLACEMENT_ROWS = "replacement_rows"


class Fidelity(StrEnum):
    FULL_CACHE_EXACT = "full_cache_exact"
    LOSSY_SUBSET = "lossy_subset"
    LOSSY_REPLACEMENT = "lossy_replacement"


class RecoverabilityMode(StrEnum):
    OMITTED_IRRECOVERABLE = "omitted_irrecoverable"
    RECALLABLE_REMOTE = "recallable_remote"
    RECALLABLE_LOCAL = "recallable_local"


class TimeoutFallback(StrEnum):
    CONTINUE_LOSSY = "continue_lossy"
    FAIL_REQUEST = "fail_request"


class InvalidStateAction(StrEnum):
    FAIL_REQUEST = "fail_request"
    REPREFILL = "reprefill"  # run prefill again under a new request generation


class CapacityAction(StrEnum):
    FAIL_REQUEST = "fail_request"
    RETRY_OTHER_WORKER = "retry_other_worker"


def _fail(path: str, message: str) -> typing.NoReturn:
    raise ManifestInvalid(path, message)


def _positive(path: str, value: int) -> None:
    if value <= 0:
        _fail(path, f"must be positive, got {value}")


def _non_negative(path: str, value: int | float) -> None:
    if value < 0:
        _fail(path, f"must be non-negative, got {value}")


def _hex64(path: str, value: str) -> None:
    if not _HEX64.match(value):
        _fail(path, "must be 64 lowercase hex characters (a SHA-256 digest)")


def _required_iff(path: str, value: object, needed: bool, why: str) -> None:
    if needed and value is None:
        _fail(path, f"required {why}")
    if not needed and value is not None:
        _fail(path, f"only allowed {why}")


def contiguous_q_to_kv_head_map(num_q_heads: int, num_kv_heads: int) -> tuple[int, ...]:
    """The usual GQA grouping: query head q reads K/V head q // (H_q / H_kv)."""
    group = num_q_heads // num_kv_heads
    return tuple(q // group for q in range(num_q_heads))


@dataclass(frozen=True)
class TensorContract:
    """Shapes and dtypes of the logical KV cache: source K/V are `[L, H_kv, T, d_h]`."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    k_dtype: DType
    v_dtype: DType
    q_to_kv_head_map: tuple[int, ...] = ()  # [H_q]; empty = not declared
    gqa_grouping: GQAGrouping = GQAGrouping.CONTIGUOUS
    key_positional_stage: KeyPositionalStage = KeyPositionalStage.POST_ROPE

    def __post_init__(self) -> None:
        _normalize(self, "tensor")
        for name in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            _positive(f"tensor.{name}", getattr(self, name))
        if self.gqa_grouping is GQAGrouping.CONTIGUOUS and self.num_q_heads % self.num_kv_heads:
            _fail(
                "tensor.gqa_grouping",
                f"contiguous grouping needs H_q ({self.num_q_heads}) divisible by H_kv ({self.num_kv_heads})",
            )
        if self.q_to_kv_head_map:
            self._check_map()

    def _check_map(self) -> None:
        path, head_map = "tensor.q_to_kv_head_map", self.q_to_kv_head_map
        if len(head_map) != self.num_q_heads:
            _fail(path, f"has {len(head_map)} entries, expected H_q = {self.num_q_heads}")
        for q, kv in enumerate(head_map):
            if not 0 <= kv < self.num_kv_heads:
                _fail(
                    path, f"query head {q} maps to K/V head {kv}, outside [0, {self.num_kv_heads})"
                )
        unused = sorted(set(range(self.num_kv_heads)) - set(head_map))
        if unused:
            _fail(path, f"K/V heads {unused} are read by no query head")
        expected = contiguous_q_to_kv_head_map(self.num_q_heads, self.num_kv_heads)
        if self.gqa_grouping is GQAGrouping.CONTIGUOUS and head_map != expected:
            _fail(
                path,
                f"{list(head_map)} contradicts the declared contiguous grouping {list(expected)}",
            )

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one K row plus one V row: d_h (b_K + b_V)."""
        return self.head_dim * (self.k_dtype.nbytes + self.v_dtype.nbytes)

    @property
    def bytes_per_token(self) -> int:
        """Full-cache bytes per token over every layer and K/V head."""
        return self.num_layers * self.num_kv_heads * self.bytes_per_row

    def resolved_q_to_kv_head_map(self) -> tuple[int, ...]:
        """The declared map, or the contiguous one when none is declared."""
        if self.q_to_kv_head_map:
            return self.q_to_kv_head_map
        return contiguous_q_to_kv_head_map(self.num_q_heads, self.num_kv_heads)


@dataclass(frozen=True)
class ProtectedRule:
    """Rows retained outside any budget: the first `sinks` positions and/or the observation suffix."""

    sinks: int = 0
    observation_suffix: bool = False

    def __post_init__(self) -> None:
        _normalize(self, "selection.protected")
        _non_negative("selection.protected.sinks", self.sinks)


@dataclass(frozen=True)
class BudgetSpec:
    """Per-owner capacity (rows retained including protected rows), absolute or a prompt fraction.

    `scope` says over what the allocation conserves the total: each owner, each layer, or globally.
    """

    scope: BudgetScope
    rows_per_owner: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        _normalize(self, "selection.budget")
        if (self.rows_per_owner is None) == (self.fraction is None):
            _fail("selection.budget", "exactly one of rows_per_owner and fraction must be set")
        if self.rows_per_owner is not None:
            _positive("selection.budget.rows_per_owner", self.rows_per_owner)
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            _fail("selection.budget.fraction", f"must be in (0, 1], got {self.fraction}")


@dataclass(frozen=True)
class SnapKVParams:
    """SnapKV evidence: the last `observation_window` prompt queries vote for prefix keys."""

    observation_window: int
    pooling: Pooling = Pooling.AVG
    pooling_kernel: int = 5
    aggregation: ScoreAggregation = ScoreAggregation.SUM
    gqa_reduction: GQAReduction = GQAReduction.MEAN

    def __post_init__(self) -> None:
        _normalize(self, "selection.snapkv")
        _positive("selection.snapkv.observation_window", self.observation_window)
        kernel_path = "selection.snapkv.pooling_kernel"
        if self.pooling_kernel < 1 or self.pooling_kernel % 2 == 0:
            _fail(kernel_path, f"must be a positive odd number, got {self.pooling_kernel}")
        if self.pooling is Pooling.NONE and self.pooling_kernel != 1:
            _fail(kernel_path, "must be 1 when pooling is none")


_ALLOCATION_PARAMS: dict[AllocationMethod, frozenset[str]] = {
    AllocationMethod.UNIFORM: frozenset(),
    AllocationMethod.PYRAMIDKV: frozenset({"beta"}),
    AllocationMethod.ADAKV: frozenset({"alpha"}),
    AllocationMethod.HEADKV: frozenset({"beta", "headkv_profile_sha256"}),
    AllocationMethod.ZIGZAGKV: frozenset({"b_min", "coverage"}),
}
BUDGET_SCOPE_OF: dict[AllocationMethod, BudgetScope] = {
    AllocationMethod.UNIFORM: BudgetScope.OWNER,
    AllocationMethod.ADAKV: BudgetScope.LAYER,
    AllocationMethod.PYRAMIDKV: BudgetScope.GLOBAL,
    AllocationMethod.HEADKV: BudgetScope.GLOBAL,
    AllocationMethod.ZIGZAGKV: BudgetScope.GLOBAL,
}


@dataclass(frozen=True)
class AllocationSpec:
    """How the selection budget is split into integer budgets K[l][h] (exactly conserved).

    beta: PyramidKV top/bottom ratio and HeadKV base shrink (b - b/beta), >= 1.
    alpha: Ada-KV safeguard, the share blended toward uniform, in [0, 1].
    b_min: ZigZagKV per-layer floor (rows summed over the layer's owners).
    coverage: ZigZagKV attention-mass coverage defining each layer's minimum budget.
    floor_rows / cap_rows: per-owner bounds on the selected (non-protected) rows.
    """

    method: AllocationMethod
    beta: float | None = None
    alpha: float | None = None
    b_min: int | None = None
    coverage: float | None = None
    headkv_profile_sha256: str | None = None
    floor_rows: int = 0
    cap_rows: int | None = None

    def __post_init__(self) -> None:
        _normalize(self, "selection.allocation")
        allowed = _ALLOCATION_PARAMS[self.method]
        for name in ("beta", "alpha", "b_min", "coverage", "headkv_profile_sha256"):
            _required_iff(
                f"selection.allocation.{name}",
                getattr(self, name),
                name in allowed,
                f"for method {self.method.value}",
            )
        if self.beta is not None and self.beta < 1.0:
            _fail("selection.allocation.beta", f"must be >= 1, got {self.beta}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            _fail("selection.allocation.alpha", f"must be in [0, 1], got {self.alpha}")
        if self.b_min is not None:
            _non_negative("selection.allocation.b_min", self.b_min)
        if self.coverage is not None and not 0.0 < self.coverage <= 1.0:
            _fail("selection.allocation.coverage", f"must be in (0, 1], got {self.coverage}")
        if self.headkv_profile_sha256 is not None:
            _hex64("selection.allocation.headkv_profile_sha256", self.headkv_profile_sha256)
        _non_negative("selection.allocation.floor_rows", self.floor_rows)
        if self.cap_rows is not None and self.cap_rows < max(self.floor_rows, 1):
            _fail(
                "selection.allocation.cap_rows",
                f"must be >= max(floor_rows, 1), got {self.cap_rows}",
            )


_EVIDENCE_OF: dict[SelectionMethod, EvidenceFamily] = {
    SelectionMethod.FULL: EvidenceFamily.NONE,
    SelectionMethod.SLIDING_WINDOW: EvidenceFamily.POSITIONAL,
    SelectionMethod.SINK_RECENT: EvidenceFamily.POSITIONAL,
    SelectionMethod.SNAPKV: EvidenceFamily.OBSERVATION_ATTENTION,
}
_UNIT_OF: dict[SelectionMethod, SelectionUnit] = {
    SelectionMethod.FULL: SelectionUnit.TOKEN,
    SelectionMethod.SLIDING_WINDOW: SelectionUnit.TOKEN,
    SelectionMethod.SINK_RECENT: SelectionUnit.TOKEN,
    SelectionMethod.SNAPKV: SelectionUnit.LAYER_HEAD_TOKEN,
}


@dataclass(frozen=True)
class SelectionContract:
    """Which original rows stay visible, decided how, when and at what granularity.

    Budgets (`budget`, `allocation`) apply to SnapKV; the static methods are bounded by
    `recent_window` and `protected.sinks`. Protected rows are retained outside the budget.
    """

    method: SelectionMethod
    unit: SelectionUnit
    phase: Phase
    evidence: EvidenceFamily
    update_cadence: UpdateCadence
    tie_rule: TieRule = TieRule.POSITION_ASCENDING
    protected: ProtectedRule = field(default_factory=ProtectedRule)
    recent_window: int | None = None
    budget: BudgetSpec | None = None
    snapkv: SnapKVParams | None = None
    allocation: AllocationSpec | None = None

    def __post_init__(self) -> None:
        _normalize(self, "selection")
        method = self.method
        is_snapkv = method is SelectionMethod.SNAPKV
        is_static_window = method in (SelectionMethod.SLIDING_WINDOW, SelectionMethod.SINK_RECENT)
        _required_iff(
            "selection.recent_window",
            self.recent_window,
            is_static_window,
            "for sliding_window and sink_recent",
        )
        _required_iff("selection.budget", self.budget, is_snapkv, "for snapkv")
        _required_iff("selection.snapkv", self.snapkv, is_snapkv, "for snapkv")
        _required_iff("selection.allocation", self.allocation, is_snapkv, "for snapkv")
        if self.recent_window is not None:
            _positive("selection.recent_window", self.recent_window)
        if self.evidence is not _EVIDENCE_OF[method]:
            _fail(
                "selection.evidence",
                f"method {method.value} uses evidence {_EVIDENCE_OF[method].value}",
            )
        if self.unit is not _UNIT_OF[method]:
            _fail("selection.unit", f"method {method.value} selects per {_UNIT_OF[method].value}")
        self._check_protected()
        self._check_phase_and_cadence()
        if self.budget is not None and self.snapkv is not None and self.allocation is not None:
            self._check_snapkv_budget(self.budget, self.snapkv, self.allocation)

    def _check_protected(self) -> None:
        sinks_allowed = self.method in (SelectionMethod.SINK_RECENT, SelectionMethod.SNAPKV)
        if self.method is SelectionMethod.SINK_RECENT and self.protected.sinks < 1:
            _fail("selection.protected.sinks", "sink_recent needs at least one sink")
        if not sinks_allowed and self.protected.sinks:
            _fail("selection.protected.sinks", f"method {self.method.value} has no sinks")
        if self.protected.observation_suffix != (self.method is SelectionMethod.SNAPKV):
            _fail(
                "selection.protected.observation_suffix",
                "true exactly for snapkv, which always retains its observation window",
            )

    def _check_phase_and_cadence(self) -> None:
        if self.method is SelectionMethod.FULL:
            expected = UpdateCadence.NEVER
        elif self.method is SelectionMethod.SNAPKV or self.phase is Phase.PREFILL:
            expected = UpdateCadence.PREFILL_ONCE
        else:
            expected = UpdateCadence.EVERY_STEP
        if self.method is SelectionMethod.SNAPKV and self.phase is not Phase.PREFILL:
            _fail("selection.phase", "snapkv selects once, at prefill")
        if self.update_cadence is not expected:
            _fail(
                "selection.update_cadence",
                f"method {self.method.value} in phase {self.phase.value} updates {expected.value}",
            )

    def _check_snapkv_budget(
        self, budget: BudgetSpec, snapkv: SnapKVParams, allocation: AllocationSpec
    ) -> None:
        protected = snapkv.observation_window + self.protected.sinks
        if budget.rows_per_owner is not None and budget.rows_per_owner <= protected:
            _fail(
                "selection.budget.rows_per_owner",
                f"capacity {budget.rows_per_owner} must exceed the protected rows (W_obs + sinks = {protected})",
            )
        expected_scope = BUDGET_SCOPE_OF[allocation.method]
        if budget.scope is not expected_scope:
            _fail(
                "selection.budget.scope",
                f"allocation {allocation.method.value} conserves per {expected_scope.value}",
            )

    @property
    def protected_rows(self) -> int:
        """Rows per owner retained outside the budget (sinks + observation window)."""
        window = self.snapkv.observation_window if self.snapkv is not None else 0
        return self.protected.sinks + window

    def capacity(self, prompt_len: int) -> int:
        """Rows per owner this policy may retain from a prompt of `prompt_len` tokens.

        SnapKV: `rows_per_owner`, or ceil(fraction * prompt_len) raised to at least
        protected + 1 so every owner can select one prefix row. Static methods: their
        window (plus sinks); full: the whole prompt.
        """
        if self.method is SelectionMethod.FULL:
            return prompt_len
        if self.budget is None:
            return self.protected.sinks + int(self.recent_window or 0)
        if self.budget.rows_per_owner is not None:
            return self.budget.rows_per_owner
        scaled = math.ceil(Decimal(repr(self.budget.fraction)) * prompt_len)
        return max(scaled, self.protected_rows + 1)


@dataclass(frozen=True)
class RepresentationContract:
    """What a visible row is (an original row or a replacement) and how exact the view is."""

    rows: RowKind
    fidelity: Fidelity
    consumer_schema: str | None = None

    def __post_init__(self) -> None:
        _normalize(self, "representation")
        replacement = self.rows is RowKind.REPLACEMENT_ROWS
        if replacement and self.fidelity is not Fidelity.LOSSY_REPLACEMENT:
            _fail("representation.rows", f"replacement_rows cannot be {self.fidelity.value}")
        if self.fidelity is Fidelity.LOSSY_REPLACEMENT and not self.consumer_schema:
            _fail(
                "representation.consumer_schema",
                "lossy_replacement needs the consumer schema that reads replacement rows",
            )


@dataclass(frozen=True)
class RecoverabilityContract:
    """Whether omitted rows can come back, from where, when, and what a timeout does."""

    mode: RecoverabilityMode
    handoff_id: str | None = None
    recall_threshold: float | None = None  # omitted-mass bound that triggers recall, [0, 1)
    page_size: int | None = None  # contiguous omitted positions per summarized page
    max_pages_per_step: int | None = None
    recall_cadence_steps: int | None = None  # check the bound every N decode steps
    recall_timeout_ms: int | None = None
    timeout_fallback: TimeoutFallback | None = None
    full_recall_on_quality_gate: float | None = (
        None  # recall everything when the bound exceeds this
    )

    _RECALL_FIELDS = (
        "handoff_id",
        "recall_threshold",
        "page_size",
        "max_pages_per_step",
        "recall_cadence_steps",
        "recall_timeout_ms",
        "timeout_fallback",
    )

    def __post_init__(self) -> None:
        _normalize(self, "recoverability")
        for name in self._RECALL_FIELDS:
            _required_iff(
                f"recoverability.{name}",
                getattr(self, name),
                self.recallable,
                "for a recallable mode",
            )
        if not self.recallable and self.full_recall_on_quality_gate is not None:
            _fail(
                "recoverability.full_recall_on_quality_gate", "only allowed for a recallable mode"
            )
        if self.handoff_id is not None and not self.handoff_id.strip():
            _fail("recoverability.handoff_id", "must not be blank")
        # A threshold of 0 recalls every page still omitted (recall as exact fallback);
        # the full-recall gate sits strictly above it.
        threshold, gate = self.recall_threshold, self.full_recall_on_quality_gate
        if threshold is not None and not 0.0 <= threshold < 1.0:
            _fail("recoverability.recall_threshold", f"must be in [0, 1), got {threshold}")
        if gate is not None and not 0.0 < gate < 1.0:
            _fail("recoverability.full_recall_on_quality_gate", f"must be in (0, 1), got {gate}")
        for name in (
            "page_size",
            "max_pages_per_step",
            "recall_cadence_steps",
            "recall_timeout_ms",
        ):
            value = getattr(self, name)
            if value is not None:
                _positive(f"recoverability.{name}", value)
        if gate is not None and threshold is not None and gate <= threshold:
            _fail(
                "recoverability.full_recall_on_quality_gate",
                f"{gate} must exceed recall_threshold {threshold} (the full-recall gate is higher)",
            )

    @property
    def recallable(self) -> bool:
        return self.mode is not RecoverabilityMode.OMITTED_IRRECOVERABLE


@dataclass(frozen=True)
class QualityContract:
    """Fallback actions for an invalid state and for a decode worker without capacity.

    The recall-timeout fallback lives with the rest of recall in `RecoverabilityContract`.
    """

    on_invalid_state: InvalidStateAction = InvalidStateAction.FAIL_REQUEST
    on_capacity_exhausted: CapacityAction = CapacityAction.RETRY_OTHER_WORKER

    def __post_init__(self) -> None:
        _normalize(self, "quality")


@dataclass(frozen=True)
class KVVisibilityPolicyManifest:
    """One immutable, versioned KV visibility policy. Identity: `sha256` of `canonical_json()`."""

    name: str
    policy_manifest_id: str
    policy_generation: int
    logical_cache_abi_sha256: str
    checkpoint_generation: int
    tensor: TensorContract
    selection: SelectionContract
    representation: RepresentationContract
    recoverability: RecoverabilityContract
    quality: QualityContract = field(default_factory=QualityContract)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        _normalize(self, "")
        self.validate()

    def validate(self) -> None:
        """Check the top-level fields and the rules that span contracts."""
        if self.schema_version != SCHEMA_VERSION:
            _fail(
                "schema_version",
                f"unsupported version {self.schema_version}, this build reads {SCHEMA_VERSION}",
            )
        if not _NAME.match(self.name):
            _fail("name", f"{self.name!r} must match {_NAME.pattern}")
        if not self.policy_manifest_id.strip():
            _fail("policy_manifest_id", "must not be blank")
        _positive("policy_generation", self.policy_generation)
        _non_negative("checkpoint_generation", self.checkpoint_generation)
        _hex64("logical_cache_abi_sha256", self.logical_cache_abi_sha256)
        self._check_cross_contract()

    def _check_cross_contract(self) -> None:
        selection = self.selection
        if selection.unit is SelectionUnit.LAYER_HEAD_TOKEN and not self.tensor.q_to_kv_head_map:
            _fail(
                "tensor.q_to_kv_head_map", "head-level selection needs a declared q_to_kv_head_map"
            )
        omits = selection.method is not SelectionMethod.FULL
        exact = self.representation.fidelity is Fidelity.FULL_CACHE_EXACT
        if omits and exact:
            _fail(
                "representation.fidelity",
                f"full_cache_exact cannot omit positions (method {selection.method.value})",
            )
        if not omits and not exact:
            _fail("representation.fidelity", "method full omits nothing, so it is full_cache_exact")
        if not omits and self.recoverability.recallable:
            _fail("recoverability.mode", "method full omits nothing to recall")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVVisibilityPolicyManifest:
        """Build and validate from plain JSON data; unknown fields and enum values are rejected."""
        manifest = _from_plain(cls, data, "")
        assert isinstance(manifest, cls)
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes) -> KVVisibilityPolicyManifest:
        try:
            data = json.loads(
                text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants
            )
        except json.JSONDecodeError as exc:
            raise ManifestInvalid("manifest", f"not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (every field present, enums as strings, tuples as lists)."""
        plain = _to_plain(self)
        assert isinstance(plain, dict)
        return plain

    def canonical_json(self) -> bytes:
        """Keys sorted recursively, arrays in order, compact separators, UTF-8."""
        text = json.dumps(
            self.to_dict(),
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
        )
        return text.encode("utf-8")

    @cached_property
    def sha256(self) -> str:
        """Hex SHA-256 of the canonical JSON: the manifest's identity."""
        return hashlib.sha256(self.canonical_json()).hexdigest()

    @property
    def owners_are_query_heads(self) -> bool:
        """True under GQA reduction `expand`: selections and storage are per query head."""
        snapkv = self.selection.snapkv
        return snapkv is not None and snapkv.gqa_reduction is GQAReduction.EXPAND

    @property
    def num_owners(self) -> int:
        """Owners per layer: H_q under `expand`, H_kv otherwise."""
        return self.tensor.num_q_heads if self.owners_are_query_heads else self.tensor.num_kv_heads

    def owner_to_kv_head(self) -> tuple[int, ...]:
        """The K/V head whose rows each owner reads (identity unless owners are query heads)."""
        if self.owners_are_query_heads:
            return self.tensor.resolved_q_to_kv_head_map()
        return tuple(range(self.tensor.num_kv_heads))


def cache_abi_sha256(tensor: TensorContract) -> str:
    """A logical cache ABI digest derived from the tensor contract alone.

    Services that know more about the checkpoint (RoPE parameters, tokenizer) may publish
    their own digest; this one is what `default_manifests` uses when none is given.
    """
    body = {"abi": "kvrelay.logical_cache.v1", "tensor": _to_plain(tensor)}
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def default_manifests(
    tensor: TensorContract,
    *,
    checkpoint_generation: int = 0,
    logical_cache_abi_sha256: str | None = None,
    budget_fraction: float = 0.25,
    observation_window: int = 16,
    recent_window: int = 256,
    sinks: int = 4,
) -> dict[str, KVVisibilityPolicyManifest]:
    """The named policies every service registers at start-up.

    `full`, `window`, `sink-recent`, `snapkv` (uniform), `snapkv-pyramid` (PyramidKV, beta 20)
    and `snapkv-adakv` (Ada-KV, alpha 0.2); SnapKV budgets are `budget_fraction` of the
    prompt rows per owner. All omit irrecoverably; head-level policies need a declared
    GQA map, which is filled in (contiguous) when the tensor contract has none.
    """
    if not tensor.q_to_kv_head_map:
        tensor = TensorContract(
            **{**_shallow(tensor), "q_to_kv_head_map": tensor.resolved_q_to_kv_head_map()}
        )
    abi = logical_cache_abi_sha256 or cache_abi_sha256(tensor)
    lossy = RepresentationContract(RowKind.ORIGINAL_ROWS, Fidelity.LOSSY_SUBSET)
    selections = {
        "full": SelectionContract(
            SelectionMethod.FULL,
            SelectionUnit.TOKEN,
            Phase.BOTH,
            EvidenceFamily.NONE,
            UpdateCadence.NEVER,
        ),
        "window": _static_selection(SelectionMethod.SLIDING_WINDOW, recent_window, 0),
        "sink-recent": _static_selection(SelectionMethod.SINK_RECENT, recent_window, sinks),
        "snapkv": _snapkv_selection(
            budget_fraction, observation_window, AllocationSpec(AllocationMethod.UNIFORM)
        ),
        "snapkv-pyramid": _snapkv_selection(
            budget_fraction,
            observation_window,
            AllocationSpec(AllocationMethod.PYRAMIDKV, beta=20.0),
        ),
        "snapkv-adakv": _snapkv_selection(
            budget_fraction, observation_window, AllocationSpec(AllocationMethod.ADAKV, alpha=0.2)
        ),
    }
    return {
        name: KVVisibilityPolicyManifest(
            name=name,
            policy_manifest_id=f"{name}@1",
            policy_generation=1,
            logical_cache_abi_sha256=abi,
            checkpoint_generation=checkpoint_generation,
            tensor=tensor,
            selection=selection,
            representation=RepresentationContract(RowKind.ORIGINAL_ROWS, Fidelity.FULL_CACHE_EXACT)
            if name == "full"
            else lossy,
            recoverability=RecoverabilityContract(RecoverabilityMode.OMITTED_IRRECOVERABLE),
        )
        for name, selection in selections.items()
    }


def _static_selection(method: SelectionMethod, recent_window: int, sinks: int) -> SelectionContract:
    return SelectionContract(
        method=method,
        unit=SelectionUnit.TOKEN,
        phase=Phase.BOTH,
        evidence=EvidenceFamily.POSITIONAL,
        update_cadence=UpdateCadence.EVERY_STEP,
        protected=ProtectedRule(sinks=sinks),
        recent_window=recent_window,
    )


def _snapkv_selection(
    fraction: float, observation_window: int, allocation: AllocationSpec
) -> SelectionContract:
    return SelectionContract(
        method=SelectionMethod.SNAPKV,
        unit=SelectionUnit.LAYER_HEAD_TOKEN,
        phase=Phase.PREFILL,
        evidence=EvidenceFamily.OBSERVATION_ATTENTION,
        update_cadence=UpdateCadence.PREFILL_ONCE,
        protected=ProtectedRule(observation_suffix=True),
        budget=BudgetSpec(scope=BUDGET_SCOPE_OF[allocation.method], fraction=fraction),
        snapkv=SnapKVParams(observation_window=observation_window),
        allocation=allocation,
    )


def _shallow(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _from_plain(cls: type, data: Any, path: str) -> Any:
    """Convert plain data to dataclass `cls`, naming the dotted path of the first bad field."""
    if not isinstance(data, Mapping):
        _fail(path or "manifest", f"expected an object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        _fail(_join(path, unknown[0]), "unknown field")
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        sub = _join(path, f.name)
        if f.name in data:
            kwargs[f.name] = _convert(hints[f.name], data[f.name], sub)
        elif f.default is MISSING and f.default_factory is MISSING:
            _fail(sub, "missing required field")
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner, value, path)
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, list | tuple):
            _fail(path, f"expected an array, got {type(value).__name__}")
        item_type = typing.get_args(tp)[0]
        return tuple(_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        allowed = [m.value for m in tp]
        if not isinstance(value, str) or value not in allowed:
            _fail(path, f"unknown value {value!r}; expected one of {allowed}")
        return tp(value)
    if isinstance(tp, type) and is_dataclass(tp):
        return _from_plain(tp, value, path)
    return _convert_scalar(tp, value, path)


def _convert_scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is bool:
        if not isinstance(value, bool):
            _fail(path, f"expected a boolean, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            _fail(path, f"expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(path, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported manifest field type {tp!r} at {path}")


def _normalize(obj: Any, prefix: str) -> None:
    """Accept plain strings for enum fields and lists for tuple fields from Python callers."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        tp, value = hints[f.name], getattr(obj, f.name)
        if isinstance(value, list) or (
            isinstance(value, str) and not isinstance(value, StrEnum) and _is_enum_type(tp)
        ):
            object.__setattr__(obj, f.name, _convert(tp, value, _join(prefix, f.name)))


def _is_enum_type(tp: Any) -> bool:
    candidates = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    return any(isinstance(c, type) and issubclass(c, StrEnum) for c in candidates)


def _to_plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, StrEnum):
        return obj.value
    if isinstance(obj, tuple | list):
        return [_to_plain(v) for v in obj]
    return obj


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            _fail(key, "duplicate key in JSON object")
        out[key] = value
    return out


def _no_constants(token: str) -> Any:
    _fail("manifest", f"JSON constant {token} is not allowed")
