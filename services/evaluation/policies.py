"""The policies the quality sweep compares, built from the manifest dataclasses.

Every policy is a complete, validated `KVVisibilityPolicyManifest` (the same contract a
served request names): `full`; the positional baselines `window` and `sink-recent`, sized to
the SnapKV capacity of the same budget; and SnapKV under every (allocation method, GQA
reduction) pair. A budget is the fraction of the prompt each owner retains, observation
window included, so all policies of one budget keep the same number of rows per owner.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.kvpolicy.head_profile import HeadProfile
from services.kvpolicy.manifest import (
    BUDGET_SCOPE_OF,
    AllocationMethod,
    AllocationSpec,
    BudgetSpec,
    EvidenceFamily,
    Fidelity,
    GQAReduction,
    KVVisibilityPolicyManifest,
    Phase,
    Pooling,
    ProtectedRule,
    RecoverabilityContract,
    RecoverabilityMode,
    RepresentationContract,
    RowKind,
    ScoreAggregation,
    SelectionContract,
    SelectionMethod,
    SelectionUnit,
    SnapKVParams,
    TensorContract,
    UpdateCadence,
    cache_abi_sha256,
)

# Allocation parameters of the sweep (PyramidKV and Ada-KV as in `default_manifests`).
PYRAMID_BETA = 20.0
# Ada-KV's share of each layer budget spread uniformly (the official code's and kvpress's
# `alpha_safeguard`; the paper's alpha 0.8).
ADAKV_UNIFORM_SHARE = 0.2
HEADKV_BETA = 1.2  # HeadKV's base shrink: 1/1.2 of every owner's budget goes to the shared pool
ZIGZAG_COVERAGE = 0.9


@dataclass(frozen=True)
class SnapKVShape:
    """The SnapKV scoring every swept manifest shares (one prompt forward serves them all)."""

    observation_window: int = 16
    pooling: Pooling = Pooling.AVG
    pooling_kernel: int = 5
    aggregation: ScoreAggregation = ScoreAggregation.SUM
    sinks: int = 4  # sinks of the sink-recent baseline (SnapKV protects none)


@dataclass(frozen=True)
class PolicyCell:
    """One evaluated policy: its family, allocation and GQA reduction, budget and manifest."""

    family: str  # full | window | sink-recent | snapkv
    allocation: AllocationMethod | None
    reduction: GQAReduction | None
    budget: float | None  # None for full
    manifest: KVVisibilityPolicyManifest

    @property
    def label(self) -> str:
        """The policy without its budget, e.g. `snapkv/adakv/max`, `window`, `full`."""
        if self.allocation is None or self.reduction is None:
            return self.family
        return f"{self.family}/{self.allocation.value}/{self.reduction.value}"


def tensor_with_map(tensor: TensorContract) -> TensorContract:
    """The contract with its GQA map declared (head-level selection needs it)."""
    if tensor.q_to_kv_head_map:
        return tensor
    return dataclasses.replace(tensor, q_to_kv_head_map=tensor.resolved_q_to_kv_head_map())


def policy_grid(
    tensor: TensorContract,
    prompt_len: int,
    budgets: Sequence[float],
    allocations: Sequence[AllocationMethod],
    reductions: Sequence[GQAReduction],
    profile: HeadProfile | None = None,
    shape: SnapKVShape = SnapKVShape(),
) -> list[PolicyCell]:
    """`full`, then per budget the positional baselines and every SnapKV (allocation, reduction).

    Positional baselines are sized for prompts of `prompt_len` tokens. HeadKV needs `profile`
    (its manifests name the profile tensor of their owners by digest); without one it is left out.
    """
    tensor = tensor_with_map(tensor)
    cells = [PolicyCell("full", None, None, None, _manifest(tensor, "full", _full_selection()))]
    for budget in budgets:
        capacity = _capacity(budget, prompt_len, shape.observation_window)
        cells.append(_window_cell(tensor, budget, capacity))
        cells.append(_sink_recent_cell(tensor, budget, capacity, shape.sinks))
        for method in allocations:
            if method is AllocationMethod.HEADKV and profile is None:
                continue
            for reduction in reductions:
                allocation = _allocation(method, reduction, tensor, profile)
                selection = _snapkv_selection(budget, shape, reduction, allocation)
                name = f"snapkv-{method.value}-{reduction.value}-{_percent(budget)}"
                manifest = _manifest(tensor, name, selection)
                cells.append(PolicyCell("snapkv", method, reduction, budget, manifest))
    return cells


def _capacity(budget: float, prompt_len: int, window: int) -> int:
    """Rows per owner a SnapKV manifest of this budget retains (`SelectionContract.capacity`)."""
    return max(math.ceil(budget * prompt_len), window + 1)


def _percent(budget: float) -> str:
    return f"b{round(100 * budget)}"


def _allocation(
    method: AllocationMethod,
    reduction: GQAReduction,
    tensor: TensorContract,
    profile: HeadProfile | None,
) -> AllocationSpec:
    if method is AllocationMethod.PYRAMIDKV:
        return AllocationSpec(method, beta=PYRAMID_BETA)
    if method is AllocationMethod.ADAKV:
        return AllocationSpec(method, uniform_share=ADAKV_UNIFORM_SHARE)
    if method is AllocationMethod.ZIGZAGKV:
        owners = tensor.num_q_heads if reduction is GQAReduction.EXPAND else tensor.num_kv_heads
        return AllocationSpec(method, b_min=owners, coverage=ZIGZAG_COVERAGE)
    if method is AllocationMethod.HEADKV:
        assert profile is not None  # policy_grid skips HeadKV without a profile
        digest = profile.query_head_sha256 if reduction is GQAReduction.EXPAND else profile.sha256
        return AllocationSpec(method, beta=HEADKV_BETA, headkv_profile_sha256=digest)
    return AllocationSpec(method)


def _full_selection() -> SelectionContract:
    return SelectionContract(
        SelectionMethod.FULL, SelectionUnit.TOKEN, Phase.BOTH, EvidenceFamily.NONE,
        UpdateCadence.NEVER,
    )


def _window_cell(tensor: TensorContract, budget: float, capacity: int) -> PolicyCell:
    selection = SelectionContract(
        SelectionMethod.SLIDING_WINDOW, SelectionUnit.TOKEN, Phase.PREFILL,
        EvidenceFamily.POSITIONAL, UpdateCadence.PREFILL_ONCE, recent_window=capacity,
    )
    manifest = _manifest(tensor, f"window-{_percent(budget)}", selection)
    return PolicyCell("window", None, None, budget, manifest)


def _sink_recent_cell(
    tensor: TensorContract, budget: float, capacity: int, sinks: int
) -> PolicyCell:
    selection = SelectionContract(
        SelectionMethod.SINK_RECENT, SelectionUnit.TOKEN, Phase.PREFILL,
        EvidenceFamily.POSITIONAL, UpdateCadence.PREFILL_ONCE, protected=ProtectedRule(sinks=sinks),
        recent_window=max(capacity - sinks, 1),
    )
    manifest = _manifest(tensor, f"sink-recent-{_percent(budget)}", selection)
    return PolicyCell("sink-recent", None, None, budget, manifest)


def _snapkv_selection(
    budget: float, shape: SnapKVShape, reduction: GQAReduction, allocation: AllocationSpec
) -> SelectionContract:
    return SelectionContract(
        method=SelectionMethod.SNAPKV,
        unit=SelectionUnit.LAYER_HEAD_TOKEN,
        phase=Phase.PREFILL,
        evidence=EvidenceFamily.OBSERVATION_ATTENTION,
        update_cadence=UpdateCadence.PREFILL_ONCE,
        protected=ProtectedRule(observation_suffix=True),
        budget=BudgetSpec(scope=BUDGET_SCOPE_OF[allocation.method], fraction=budget),
        snapkv=SnapKVParams(
            observation_window=shape.observation_window,
            pooling=shape.pooling,
            pooling_kernel=shape.pooling_kernel,
            aggregation=shape.aggregation,
            gqa_reduction=reduction,
        ),
        allocation=allocation,
    )


def _manifest(
    tensor: TensorContract, name: str, selection: SelectionContract
) -> KVVisibilityPolicyManifest:
    exact = selection.method is SelectionMethod.FULL
    return KVVisibilityPolicyManifest(
        name=f"eval-{name}",
        policy_manifest_id=f"eval-{name}@1",
        policy_generation=1,
        logical_cache_abi_sha256=cache_abi_sha256(tensor),
        checkpoint_generation=0,
        tensor=tensor,
        selection=selection,
        representation=RepresentationContract(
            RowKind.ORIGINAL_ROWS, Fidelity.FULL_CACHE_EXACT if exact else Fidelity.LOSSY_SUBSET
        ),
        recoverability=RecoverabilityContract(RecoverabilityMode.OMITTED_IRRECOVERABLE),
    )
