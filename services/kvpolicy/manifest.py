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

Validation is cheap whatever the input: every integer is range-checked (the bounds below)
before anything is expanded per head or per position, arrays are length-checked before their
items are read, and a bad value is echoed in at most ~100 characters (`services.echo`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from decimal import Decimal
from enum import StrEnum
from functools import cached_property
from typing import Any

from services.echo import echo
from services.kvpolicy.errors import ManifestInvalid
from services.kvpolicy.manifest_json import (
    MAX_ARRAY_ITEMS,
    OMIT_IF_NULL,
    from_plain,
    load_json,
    normalize,
    to_plain,
)
from services.kvpolicy.retention_contract import (
    RetentionContract,
    RetentionMethod,
    ScoreOwner,
)

SCHEMA_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_NAME_CHARS = 64
_NAME = re.compile(rf"^[a-z0-9][a-z0-9._-]{{0,{MAX_NAME_CHARS - 1}}}$")

# Bounds on every integer of a manifest, checked before any per-head or per-position structure
# is built. They cover real models with room to spare: Llama 3.1 405B has 126 layers, 128 query
# and 8 K/V heads of dimension 128; Gemma 2 uses head_dim 256, DeepSeek-V3's MLA 192; context
# windows reach 10M tokens (Llama 4 Scout). Generations are stored as Lua numbers (IEEE doubles)
# in Redis and sent as int64 on the wire, so they stay below 2**53.
MAX_LAYERS = 1024
# query heads, hence K/V heads and entries of q_to_kv_head_map (the longest array)
MAX_HEADS = MAX_ARRAY_ITEMS
MAX_HEAD_DIM = 4096
MAX_LAYER_HEADS = 2**17  # layers x query heads: how many (layer, head) owners a manifest may imply
MAX_TOKENS = 2**24  # windows, sinks, budgets, pages, cadences: 16M positions
MAX_POOLING_KERNEL = 1023  # SnapKV pools votes over 5-13 positions
MAX_RECALL_TIMEOUT_MS = 3_600_000
MAX_GENERATION = 2**53 - 1
MAX_TEXT_CHARS = 256  # free-text identifiers: policy_manifest_id, handoff_id, consumer_schema
# JSON integers longer than this are not parsed into Python ints at all (no field takes one).


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
    """When the selection rule runs. Decode appends every new row to every owner; only a
    declared `selection.retention` (phase `both`, cadence `every_step`) evicts rows while
    decoding, and then by that contract's parameters."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


class EvidenceFamily(StrEnum):
    NONE = "none"
    POSITIONAL = "positional"
    OBSERVATION_ATTENTION = "observation_attention"


class UpdateCadence(StrEnum):
    NEVER = "never"  # nothing is ever dropped (full): decode only appends
    PREFILL_ONCE = "prefill_once"  # selected once at prefill, then decode only appends
    EVERY_STEP = "every_step"  # re-selected at every decode step (decode-time retention)


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


class GQAOrder(StrEnum):
    """Whether SnapKV pools each query head's votes before reducing them over the K/V group
    (kvrelay's order) or reduces the group's votes first and pools the result (the order of
    e.g. Ada-KV's and kvpress's GQA code). Equal when both steps are linear (mean + avg) or
    both are maxima (max + max); different for mean + max pooling and max + avg pooling."""

    POOL_THEN_REDUCE = "pool_then_reduce"
    REDUCE_THEN_POOL = "reduce_then_pool"


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
    REPREFILL = "reprefill"  # prefill again under a new request generation (the gateway's way)


class CapacityAction(StrEnum):
    FAIL_REQUEST = "fail_request"
    RETRY_OTHER_WORKER = "retry_other_worker"


def is_policy_name(value: str) -> bool:
    """The rule of a manifest's `name`: 1-64 of a-z, 0-9, `.`, `_`, `-`, not starting with
    punctuation."""
    return bool(_NAME.fullmatch(value))


def _fail(path: str, message: str) -> typing.NoReturn:
    raise ManifestInvalid(path, message)


def _in_range(path: str, value: int, low: int, high: int) -> None:
    """An integer (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"expected an integer, got {echo(value)}")
    if not low <= value <= high:
        _fail(path, f"{echo(value)} is not in [{low}, {high}]")


def _optional_in_range(path: str, value: int | None, low: int, high: int) -> None:
    if value is not None:
        _in_range(path, value, low, high)


def _hex64(path: str, value: str) -> None:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        _fail(path, f"must be 64 lowercase hex characters (a SHA-256 digest), got {echo(value)}")


def _text(path: str, value: str | None) -> None:
    """A free-text identifier: not blank, at most MAX_TEXT_CHARS characters."""
    if value is None:
        return
    if len(value) > MAX_TEXT_CHARS:
        _fail(path, f"{len(value)} characters exceeds the limit of {MAX_TEXT_CHARS}")
    if not value.strip():
        _fail(path, "must not be blank")


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
        normalize(self, "tensor")
        self._check_sizes()
        custom = self.gqa_grouping is GQAGrouping.CUSTOM
        if custom and not self.q_to_kv_head_map:
            _fail("tensor.gqa_grouping", "custom needs a declared tensor.q_to_kv_head_map")
        if not custom and self.num_q_heads % self.num_kv_heads:
            _fail(
                "tensor.gqa_grouping",
                f"contiguous grouping needs tensor.num_q_heads ({self.num_q_heads}) divisible by"
                f" tensor.num_kv_heads ({self.num_kv_heads})",
            )
        if self.q_to_kv_head_map:
            self._check_map()

    def _check_sizes(self) -> None:
        """Cheap bounds first: nothing below is sized by a value these have not bounded."""
        _in_range("tensor.num_layers", self.num_layers, 1, MAX_LAYERS)
        _in_range("tensor.num_q_heads", self.num_q_heads, 1, MAX_HEADS)
        # Every K/V head is read by at least one query head.
        _in_range("tensor.num_kv_heads", self.num_kv_heads, 1, self.num_q_heads)
        _in_range("tensor.head_dim", self.head_dim, 1, MAX_HEAD_DIM)
        if self.num_layers * self.num_q_heads > MAX_LAYER_HEADS:
            _fail(
                "tensor.num_q_heads",
                f"{self.num_layers} layers x {self.num_q_heads} query heads exceeds the limit of"
                f" {MAX_LAYER_HEADS} (layer, head) pairs",
            )
        if len(self.q_to_kv_head_map) > self.num_q_heads:
            _fail(
                "tensor.q_to_kv_head_map",
                f"has {len(self.q_to_kv_head_map)} entries, expected tensor.num_q_heads ="
                f" {self.num_q_heads}",
            )

    def _check_map(self) -> None:
        path, head_map = "tensor.q_to_kv_head_map", self.q_to_kv_head_map
        if len(head_map) != self.num_q_heads:
            _fail(
                path,
                f"has {len(head_map)} entries, expected tensor.num_q_heads = {self.num_q_heads}",
            )
        for q, kv in enumerate(head_map):
            if isinstance(kv, bool) or not isinstance(kv, int):
                _fail(f"{path}[{q}]", f"expected an integer, got {echo(kv)}")
            if not 0 <= kv < self.num_kv_heads:
                _fail(
                    path,
                    f"query head {q} maps to K/V head {echo(kv)}, outside"
                    f" [0, tensor.num_kv_heads = {self.num_kv_heads})",
                )
        unused = sorted(set(range(self.num_kv_heads)) - set(head_map))
        if unused:
            _fail(path, f"K/V heads {echo(unused)} are read by no query head")
        # The label says what the map is, so neither can change alone.
        divisible = self.num_q_heads % self.num_kv_heads == 0
        is_contiguous = divisible and head_map == contiguous_q_to_kv_head_map(
            self.num_q_heads, self.num_kv_heads
        )
        if self.gqa_grouping is GQAGrouping.CONTIGUOUS and not is_contiguous:
            _fail(
                path,
                f"{echo(list(head_map))} contradicts the declared contiguous tensor.gqa_grouping",
            )
        if self.gqa_grouping is GQAGrouping.CUSTOM and is_contiguous:
            _fail(
                "tensor.gqa_grouping",
                "custom, but tensor.q_to_kv_head_map is the contiguous map: declare contiguous",
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
        normalize(self, "selection.protected")
        _in_range("selection.protected.sinks", self.sinks, 0, MAX_TOKENS)


@dataclass(frozen=True)
class BudgetSpec:
    """Per-owner capacity (rows retained including protected rows), absolute or a prompt fraction.

    `scope` says over what the allocation conserves the total: each owner, each layer, or globally.
    """

    scope: BudgetScope
    rows_per_owner: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        normalize(self, "selection.budget")
        if (self.rows_per_owner is None) == (self.fraction is None):
            _fail("selection.budget", "exactly one of rows_per_owner and fraction must be set")
        _optional_in_range("selection.budget.rows_per_owner", self.rows_per_owner, 1, MAX_TOKENS)
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            _fail("selection.budget.fraction", f"must be in (0, 1], got {echo(self.fraction)}")


@dataclass(frozen=True)
class SnapKVParams:
    """SnapKV evidence: the last `observation_window` prompt queries vote for prefix keys.

    `aggregation`: the vote over the window queries. Only `sum` (the paper's) is accepted:
    `mean` divides every score of a prompt by the same W, which ranks every row, owner and layer
    exactly as `sum` does, so declaring it would change nothing that is served.
    `pooling_kernel` 1 pools nothing, so it goes with `pooling: none` and only with it.
    `gqa_order`: pool each query head's votes then reduce over the K/V group (default), or
    reduce then pool (`GQAOrder`). `reduce_then_pool` is accepted only where the two orders
    give different scores: gqa_reduction mean with max pooling, or max with avg pooling.
    """

    observation_window: int
    pooling: Pooling = Pooling.AVG
    pooling_kernel: int = 5
    aggregation: ScoreAggregation = ScoreAggregation.SUM
    gqa_reduction: GQAReduction = GQAReduction.MEAN
    gqa_order: GQAOrder = GQAOrder.POOL_THEN_REDUCE

    def __post_init__(self) -> None:
        normalize(self, "selection.snapkv")
        _in_range("selection.snapkv.observation_window", self.observation_window, 1, MAX_TOKENS)
        kernel_path = "selection.snapkv.pooling_kernel"
        _in_range(kernel_path, self.pooling_kernel, 1, MAX_POOLING_KERNEL)
        if self.pooling_kernel % 2 == 0:
            _fail(kernel_path, f"must be a positive odd number, got {self.pooling_kernel}")
        if (self.pooling is Pooling.NONE) != (self.pooling_kernel == 1):
            _fail(
                kernel_path,
                f"{self.pooling_kernel} with selection.snapkv.pooling {self.pooling.value}: a"
                " kernel of 1 pools nothing, so it is exactly pooling none",
            )
        if self.aggregation is not ScoreAggregation.SUM:
            _fail(
                "selection.snapkv.aggregation",
                f"{self.aggregation.value} ranks every row as sum does (one 1/W scale):"
                " declare sum",
            )
        if self.gqa_order is GQAOrder.REDUCE_THEN_POOL and not self.orders_differ:
            _fail(
                "selection.snapkv.gqa_order",
                f"with selection.snapkv.gqa_reduction {self.gqa_reduction.value} and"
                f" selection.snapkv.pooling {self.pooling.value} (kernel {self.pooling_kernel})"
                " both orders give the same scores: declare pool_then_reduce",
            )

    @property
    def orders_differ(self) -> bool:
        """Whether pooling before or after the GQA reduction can give different scores."""
        if self.pooling_kernel == 1 or self.pooling is Pooling.NONE:
            return False
        return (self.gqa_reduction, self.pooling) in (
            (GQAReduction.MEAN, Pooling.MAX),
            (GQAReduction.MAX, Pooling.AVG),
        )


_ALLOCATION_PARAMS: dict[AllocationMethod, frozenset[str]] = {
    AllocationMethod.UNIFORM: frozenset(),
    AllocationMethod.PYRAMIDKV: frozenset({"beta"}),
    AllocationMethod.ADAKV: frozenset({"uniform_share"}),
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
    uniform_share: Ada-KV's safeguard, in [0, 1]: the share of a layer's budget B spread
        evenly over its H owners. Owner i's target is `u B/H + (1 - u) B_i*` with u the
        uniform share and B_i* its count among the layer's global top-B scores. This is the
        official Ada-KV code's `alpha`; the paper's alpha weighs the other term
        (`alpha B_i* + (1 - alpha) B/H`), so the paper's alpha is 1 - uniform_share.
        (Renamed from `alpha`, which read as the paper's; old JSON naming `alpha` is refused,
        naming it, rather than guessed.)
    b_min: ZigZagKV per-layer floor (rows summed over the layer's owners).
    coverage: ZigZagKV attention-mass coverage defining each layer's minimum budget.
    floor_rows / cap_rows: per-owner bounds on the selected (non-protected) rows. Not for
        uniform, which gives every owner the same budget (a bound either changes nothing or
        cannot be met).
    """

    method: AllocationMethod
    beta: float | None = None
    uniform_share: float | None = None
    b_min: int | None = None
    coverage: float | None = None
    headkv_profile_sha256: str | None = None
    floor_rows: int = 0
    cap_rows: int | None = None

    def __post_init__(self) -> None:
        normalize(self, "selection.allocation")
        allowed = _ALLOCATION_PARAMS[self.method]
        for name in ("beta", "uniform_share", "b_min", "coverage", "headkv_profile_sha256"):
            _required_iff(
                f"selection.allocation.{name}",
                getattr(self, name),
                name in allowed,
                f"for selection.allocation.method {self.method.value}",
            )
        if self.beta is not None and self.beta < 1.0:
            _fail("selection.allocation.beta", f"must be >= 1, got {echo(self.beta)}")
        share = self.uniform_share
        if share is not None and not 0.0 <= share <= 1.0:
            _fail("selection.allocation.uniform_share", f"must be in [0, 1], got {echo(share)}")
        # b_min sums over a layer's owners (at most MAX_HEADS of them).
        _optional_in_range("selection.allocation.b_min", self.b_min, 0, MAX_TOKENS * MAX_HEADS)
        if self.coverage is not None and not 0.0 < self.coverage <= 1.0:
            _fail("selection.allocation.coverage", f"must be in (0, 1], got {echo(self.coverage)}")
        if self.headkv_profile_sha256 is not None:
            _hex64("selection.allocation.headkv_profile_sha256", self.headkv_profile_sha256)
        _in_range("selection.allocation.floor_rows", self.floor_rows, 0, MAX_TOKENS)
        _optional_in_range("selection.allocation.cap_rows", self.cap_rows, 1, MAX_TOKENS)
        if self.cap_rows is not None and self.cap_rows < max(self.floor_rows, 1):
            _fail(
                "selection.allocation.cap_rows",
                f"must be >= max(selection.allocation.floor_rows, 1), got {self.cap_rows}",
            )
        if self.method is AllocationMethod.UNIFORM:
            for name, unset in (("floor_rows", 0), ("cap_rows", None)):
                if getattr(self, name) != unset:
                    _fail(
                        f"selection.allocation.{name}",
                        "uniform gives every owner the same budget (selection.allocation.method"
                        " uniform): a bound would change nothing or could not be met",
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
    `tie_rule` orders equal SnapKV scores; the static methods score nothing, so they take the
    default. `phase` and `update_cadence` say when selection runs (see `Phase`): without
    `retention`, SnapKV and the static policies select once, at prefill (`prefill`,
    `prefill_once`), and decode appends every new row; with it (`both`, `every_step`), the
    method selects at prefill and `retention` bounds the rows at every decode step.
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
    retention: RetentionContract | None = field(default=None, metadata=OMIT_IF_NULL)

    def __post_init__(self) -> None:
        normalize(self, "selection")
        method = self.method
        is_snapkv = method is SelectionMethod.SNAPKV
        is_static_window = method in (SelectionMethod.SLIDING_WINDOW, SelectionMethod.SINK_RECENT)
        _required_iff(
            "selection.recent_window",
            self.recent_window,
            is_static_window,
            "for selection.method sliding_window and sink_recent",
        )
        for name in ("budget", "snapkv", "allocation"):
            _required_iff(
                f"selection.{name}", getattr(self, name), is_snapkv, "for selection.method snapkv"
            )
        _optional_in_range("selection.recent_window", self.recent_window, 1, MAX_TOKENS)
        if self.evidence is not _EVIDENCE_OF[method]:
            _fail(
                "selection.evidence",
                f"selection.method {method.value} uses evidence {_EVIDENCE_OF[method].value}",
            )
        if self.unit is not _UNIT_OF[method]:
            _fail(
                "selection.unit",
                f"selection.method {method.value} selects per {_UNIT_OF[method].value}",
            )
        if not is_snapkv and self.tie_rule is not TieRule.POSITION_ASCENDING:
            _fail(
                "selection.tie_rule",
                f"selection.method {method.value} scores nothing, so it has no ties to order",
            )
        self._check_protected()
        self._check_phase_and_cadence()
        self._check_retention()
        if self.budget is not None and self.snapkv is not None and self.allocation is not None:
            self._check_snapkv_budget(self.budget, self.snapkv, self.allocation)

    def _check_protected(self) -> None:
        sinks_allowed = self.method in (SelectionMethod.SINK_RECENT, SelectionMethod.SNAPKV)
        if self.method is SelectionMethod.SINK_RECENT and self.protected.sinks < 1:
            _fail(
                "selection.protected.sinks", "selection.method sink_recent needs at least one sink"
            )
        if not sinks_allowed and self.protected.sinks:
            _fail(
                "selection.protected.sinks", f"selection.method {self.method.value} has no sinks"
            )
        if self.protected.observation_suffix != (self.method is SelectionMethod.SNAPKV):
            _fail(
                "selection.protected.observation_suffix",
                "true exactly for selection.method snapkv, which always retains its observation"
                " window",
            )

    def _check_phase_and_cadence(self) -> None:
        """Without `retention` every method selects at most once, at prefill; with it, the
        method selects at prefill and the retention contract at every decode step (`both`)."""
        if self.retention is not None:
            expected = UpdateCadence.EVERY_STEP
            if self.phase is not Phase.BOTH:
                _fail("selection.phase", "selection.retention retains at every decode step after"
                      " selection.method selects at prefill: both")
        elif self.method is SelectionMethod.FULL:
            expected = UpdateCadence.NEVER
            if self.phase is not Phase.BOTH:
                _fail("selection.phase", "selection.method full keeps every row in both phases:"
                      " both")
        else:
            expected = UpdateCadence.PREFILL_ONCE
            if self.method is SelectionMethod.SNAPKV and self.phase is not Phase.PREFILL:
                _fail("selection.phase", "selection.method snapkv selects once, at prefill")
            if self.phase is not Phase.PREFILL:
                _fail("selection.retention", f"required for selection.phase {self.phase.value}:"
                      " decode-time retention declares its parameters")
        if self.update_cadence is not expected:
            _fail(
                "selection.update_cadence",
                f"selection.method {self.method.value} in selection.phase {self.phase.value}"
                f" {'with' if self.retention else 'without'} selection.retention updates"
                f" {expected.value}",
            )

    def _check_retention(self) -> None:
        """A static method selects at prefill what its decode-time retention keeps after."""
        retention, method = self.retention, self.method
        static = {SelectionMethod.SLIDING_WINDOW: RetentionMethod.WINDOW,
                  SelectionMethod.SINK_RECENT: RetentionMethod.SINK_RECENT}
        if retention is None or method not in static:
            return
        if retention.method is not static[method]:
            _fail("selection.retention.method", f"selection.method {method.value} retains as"
                  f" {static[method].value}")
        for name, declared in (("recent_window", self.recent_window),
                               ("sinks", self.protected.sinks)):
            if getattr(retention, name) != declared:
                _fail(f"selection.retention.{name}", f"{getattr(retention, name)} differs from"
                      f" the prefill selection's {declared}")

    def _check_snapkv_budget(
        self, budget: BudgetSpec, snapkv: SnapKVParams, allocation: AllocationSpec
    ) -> None:
        protected = snapkv.observation_window + self.protected.sinks
        if budget.rows_per_owner is not None and budget.rows_per_owner <= protected:
            _fail(
                "selection.budget.rows_per_owner",
                f"capacity {budget.rows_per_owner} must exceed the protected rows"
                f" (selection.snapkv.observation_window + selection.protected.sinks = {protected})",
            )
        expected_scope = BUDGET_SCOPE_OF[allocation.method]
        if budget.scope is not expected_scope:
            _fail(
                "selection.budget.scope",
                f"selection.allocation.method {allocation.method.value} conserves per"
                f" {expected_scope.value}",
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
    """What a visible row is (an original row or a replacement) and how exact the view is.

    `consumer_schema` names the reader of replacement rows, so it is declared exactly for
    `lossy_replacement`. No producer of replacement rows exists yet: the fit check refuses
    `replacement_rows`. `full_cache_exact` binds every row of every owner: a state or view
    that omits one is refused (`services.kvpolicy.receipt.check_fidelity`).
    """

    rows: RowKind
    fidelity: Fidelity
    consumer_schema: str | None = None

    def __post_init__(self) -> None:
        normalize(self, "representation")
        _text("representation.consumer_schema", self.consumer_schema)
        replacement = self.rows is RowKind.REPLACEMENT_ROWS
        if replacement != (self.fidelity is Fidelity.LOSSY_REPLACEMENT):
            _fail(
                "representation.rows",
                f"{self.rows.value} cannot be representation.fidelity {self.fidelity.value}",
            )
        _required_iff(
            "representation.consumer_schema",
            self.consumer_schema,
            replacement,
            "for representation.fidelity lossy_replacement (the reader of replacement rows)",
        )


KEY_CODE_BITS = (1, 2, 4)


@dataclass(frozen=True)
class RecoverabilityContract:
    """Whether omitted rows can come back, from where, when, and what a timeout does.

    `handoff_id` stays null: a handoff id names one stored state's rows and is assigned by the
    prefill worker's offload tier per state (it travels in the transfer descriptor), so a
    policy cannot declare one. The field is kept so that manifests written with it null parse.
    """

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
    # Bits per key coordinate of every omitted row's code inside its page's min/max box
    # (1, 2 or 4; null: page min/max only). The codes travel with the page summaries and let
    # the decode worker rank omitted pages by estimated logits, not only by the bound.
    key_code_bits: int | None = field(default=None, metadata=OMIT_IF_NULL)
    # True: every omitted page also carries its mean value row, and each decode step adds
    # the still-omitted pages' code-estimated attention mass carrying those means to the
    # attention over the resident rows (an estimate of what the omitted rows would add; pages
    # leave it when recalled). Needs key_code_bits; null: attention reads resident rows only.
    omitted_value_term: bool | None = field(default=None, metadata=OMIT_IF_NULL)

    _RECALL_FIELDS = (
        "recall_threshold",
        "page_size",
        "max_pages_per_step",
        "recall_cadence_steps",
        "recall_timeout_ms",
        "timeout_fallback",
    )

    def __post_init__(self) -> None:
        normalize(self, "recoverability")
        for name in self._RECALL_FIELDS:
            _required_iff(
                f"recoverability.{name}",
                getattr(self, name),
                self.recallable,
                "for a recallable recoverability.mode",
            )
        if not self.recallable and self.full_recall_on_quality_gate is not None:
            _fail(
                "recoverability.full_recall_on_quality_gate",
                "only allowed for a recallable recoverability.mode",
            )
        if self.key_code_bits is not None:
            if not self.recallable:
                _fail("recoverability.key_code_bits", "only allowed for a recallable recoverability.mode")
            if isinstance(self.key_code_bits, bool) or self.key_code_bits not in KEY_CODE_BITS:
                _fail("recoverability.key_code_bits",
                      f"must be one of {', '.join(map(str, KEY_CODE_BITS))}, got {echo(self.key_code_bits)}")
        if self.omitted_value_term is not None:
            if self.omitted_value_term is not True:
                _fail("recoverability.omitted_value_term",
                      f"must be true or left out, got {echo(self.omitted_value_term)}")
            if self.key_code_bits is None:
                _fail("recoverability.omitted_value_term",
                      "needs recoverability.key_code_bits (the codes estimate each page's mass)")
        if self.handoff_id is not None:
            _fail(
                "recoverability.handoff_id",
                "handoff ids are assigned per stored state by the prefill worker's offload tier;"
                " a manifest leaves it null",
            )
        # A threshold of 0 recalls every page still omitted (recall as exact fallback);
        # the full-recall gate sits strictly above it.
        threshold, gate = self.recall_threshold, self.full_recall_on_quality_gate
        if threshold is not None and not 0.0 <= threshold < 1.0:
            _fail("recoverability.recall_threshold", f"must be in [0, 1), got {echo(threshold)}")
        if gate is not None and not 0.0 < gate < 1.0:
            _fail(
                "recoverability.full_recall_on_quality_gate", f"must be in (0, 1), got {echo(gate)}"
            )
        for name in ("page_size", "max_pages_per_step", "recall_cadence_steps"):
            _optional_in_range(f"recoverability.{name}", getattr(self, name), 1, MAX_TOKENS)
        _optional_in_range(
            "recoverability.recall_timeout_ms", self.recall_timeout_ms, 1, MAX_RECALL_TIMEOUT_MS
        )
        if gate is not None and threshold is not None and gate <= threshold:
            _fail(
                "recoverability.full_recall_on_quality_gate",
                f"{gate} must exceed recoverability.recall_threshold {threshold} (the full-recall"
                " gate is higher)",
            )

    @property
    def recallable(self) -> bool:
        return self.mode is not RecoverabilityMode.OMITTED_IRRECOVERABLE


@dataclass(frozen=True)
class QualityContract:
    """Fallback actions for an invalid state and for a decode worker without capacity.

    The defaults are what the gateway does: a state that fails verification before the first
    token is prefilled again under a new request generation, and a worker without room is
    replaced by another, within the request's retry and admission limits. The fit check
    refuses the other values until the gateway performs them. The recall-timeout fallback
    lives with the rest of recall in `RecoverabilityContract`.
    """

    on_invalid_state: InvalidStateAction = InvalidStateAction.REPREFILL
    on_capacity_exhausted: CapacityAction = CapacityAction.RETRY_OTHER_WORKER

    def __post_init__(self) -> None:
        normalize(self, "quality")


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
        normalize(self, "")
        self.validate()

    def validate(self) -> None:
        """Check the top-level fields and the rules that span contracts."""
        if self.schema_version != SCHEMA_VERSION:
            _fail(
                "schema_version",
                f"unsupported version {echo(self.schema_version)}, this build reads {SCHEMA_VERSION}",
            )
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            _fail("name", f"{echo(self.name)} must match {_NAME.pattern}")
        if not isinstance(self.policy_manifest_id, str):
            _fail("policy_manifest_id", f"expected a string, got {echo(self.policy_manifest_id)}")
        _text("policy_manifest_id", self.policy_manifest_id)
        _in_range("policy_generation", self.policy_generation, 1, MAX_GENERATION)
        expected_id = f"{self.name}@{self.policy_generation}"
        if self.policy_manifest_id != expected_id:
            _fail(
                "policy_manifest_id",
                f"{echo(self.policy_manifest_id)} is not name@policy_generation = {expected_id!r}",
            )
        _in_range("checkpoint_generation", self.checkpoint_generation, 0, MAX_GENERATION)
        _hex64("logical_cache_abi_sha256", self.logical_cache_abi_sha256)
        self._check_cross_contract()

    def _check_cross_contract(self) -> None:
        selection = self.selection
        if selection.unit is SelectionUnit.LAYER_HEAD_TOKEN and not self.tensor.q_to_kv_head_map:
            _fail(
                "tensor.q_to_kv_head_map",
                "head-level selection (selection.unit layer-head-token) needs a declared map",
            )
        omits = selection.method is not SelectionMethod.FULL or selection.retention is not None
        exact = self.representation.fidelity is Fidelity.FULL_CACHE_EXACT
        if omits and exact:
            _fail(
                "representation.fidelity",
                "full_cache_exact cannot omit positions"
                f" (selection.method {selection.method.value})",
            )
        if not omits and not exact:
            _fail(
                "representation.fidelity",
                "selection.method full omits nothing, so it is full_cache_exact",
            )
        if not omits and self.recoverability.recallable:
            _fail("recoverability.mode", "selection.method full omits nothing to recall")
        bits = self.recoverability.key_code_bits
        if bits is not None and self.tensor.head_dim * bits % 8:
            _fail("recoverability.key_code_bits",
                  f"{bits}-bit codes of tensor.head_dim {self.tensor.head_dim} do not fill whole bytes")
        self._check_score_owner()

    def _check_score_owner(self) -> None:
        """A scoring retention's owners are the manifest's: query heads exactly under GQA
        `expand`, whose rows each belong to one query head."""
        retention = self.selection.retention
        if retention is None or not retention.method.scores:
            return
        per_query = retention.score_owner is ScoreOwner.QUERY_HEAD
        if per_query != self.owners_are_query_heads:
            _fail("selection.retention.score_owner",
                  f"{retention.score_owner.value} with owners that are"
                  f" {'query' if self.owners_are_query_heads else 'K/V'} heads"
                  " (query_head exactly under selection.snapkv.gqa_reduction expand)")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVVisibilityPolicyManifest:
        """Build and validate from plain JSON data; unknown fields and enum values are rejected."""
        manifest = from_plain(cls, data, "")
        assert isinstance(manifest, cls)
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes) -> KVVisibilityPolicyManifest:
        try:
            data = load_json(text)
        except json.JSONDecodeError as exc:
            raise ManifestInvalid("manifest", f"not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (every field present but a null `selection.retention`, enums as
        strings, tuples as lists)."""
        plain = to_plain(self)
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

    @property
    def expanded_owner_map(self) -> tuple[int, ...] | None:
        """`owner_to_kv_head()` when owners are query heads (GQA `expand`), else None: the
        argument packing, page summaries and decode caches take (None = owners are K/V heads)."""
        return self.owner_to_kv_head() if self.owners_are_query_heads else None


def cache_abi_sha256(tensor: TensorContract) -> str:
    """A logical cache ABI digest derived from the tensor contract alone.

    Services that know more about the checkpoint (RoPE parameters, tokenizer) may publish
    their own digest; this one is what `default_manifests` uses when none is given, and what a
    deployment serves unless it says otherwise (`services.kvpolicy.fit.Deployment`). The
    contiguous map is filled in when none is declared, so both spellings have one digest.
    """
    if not tensor.q_to_kv_head_map:
        tensor = TensorContract(
            **{**_shallow(tensor), "q_to_kv_head_map": tensor.resolved_q_to_kv_head_map()}
        )
    body = {"abi": "kvrelay.logical_cache.v1", "tensor": to_plain(tensor)}
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
    and `snapkv-adakv` (Ada-KV, uniform share 0.2: the official code's alpha 0.2, the paper's
    alpha 0.8); SnapKV budgets are `budget_fraction` of the prompt rows per owner. All omit
    irrecoverably; head-level policies need a declared GQA map, which is filled in
    (contiguous) when the tensor contract has none. Every policy selects at prefill and
    decode appends (`window` and `sink-recent` too: no decode-time retention is performed
    yet, so none is declared).
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
            budget_fraction,
            observation_window,
            AllocationSpec(AllocationMethod.ADAKV, uniform_share=0.2),
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
        phase=Phase.PREFILL,
        evidence=EvidenceFamily.POSITIONAL,
        update_cadence=UpdateCadence.PREFILL_ONCE,
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
