"""Budget allocation: integer budgets K[l][h] for selected (non-protected) rows.

Every method first computes real-valued targets, then `apportion` turns them into
integers that sum exactly to the requested total while respecting per-entry floors and
caps (largest remainder, ties to the lower index). Arithmetic is exact (`Fraction`), so
e.g. targets [5.5, 4.0, 2.5] always round to [6, 4, 2].

Methods (budgets are rows summed over a layer's owners unless noted):
  uniform   every owner gets the same budget;
  PyramidKV k_top = K_total / (beta m), k_bottom = 2 K_total / m - k_top, linear in between;
  ZigZagKV  B_min plus a residual proportional to each layer's sensitivity (its minimum
            budget to cover `coverage` of the attention mass, LMBA);
  Ada-KV    within a layer, the global top-B of head scores gives raw head counts B_i*; the
            safeguard blends toward uniform: u B / H + (1 - u) B_i* with u the manifest's
            `uniform_share` (the official code's alpha; the paper writes the same target as
            alpha B_i* + (1 - alpha) B / H, so its alpha is 1 - u);
  HeadKV    global owner budgets from an importance profile: b - b/beta plus a share of the
            pool L H b / beta proportional to importance.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import torch

from services.kvpolicy.errors import AllocationError
from services.kvpolicy.manifest import (
    AllocationMethod,
    AllocationSpec,
    KVVisibilityPolicyManifest,
    SelectionMethod,
    TieRule,
)
from services.kvpolicy.snapkv import top_k_mask

BudgetGrid = tuple[tuple[int, ...], ...]  # [L][H_owner]
Real = int | float | Fraction


def apportion(
    weights: Sequence[Real],
    total: int,
    floors: Sequence[int] | None = None,
    caps: Sequence[int | None] | None = None,
) -> tuple[int, ...]:
    """Integers x with sum(x) == total and floors <= x <= caps, proportional to `weights`.

    Real targets t_i = clamp(lambda w_i, floor_i, cap_i) with lambda solving sum(t) = total
    (zero weights stay at their floor unless the positive-weight entries are all capped;
    all-zero weights mean uniform). Then floor(t_i) plus one unit for the largest
    fractional parts, ties to the lower index. Raises AllocationError when the floors
    exceed the total or the caps cannot reach it.
    """
    n = len(weights)
    lo = list(floors) if floors is not None else [0] * n
    hi: list[int | None] = list(caps) if caps is not None else [None] * n
    _check_apportion_inputs(weights, total, lo, hi)
    targets = _fill(_fractions(weights), total, lo, hi)
    return _round_largest_remainder(targets, total)


def uniform_budgets(
    total: int, num_layers: int, num_owners: int, floor: int = 0, cap: int | None = None
) -> BudgetGrid:
    """Equal budgets for every (layer, owner), exactly conserving `total`."""
    flat = apportion(
        [1] * (num_layers * num_owners),
        total,
        [floor] * (num_layers * num_owners),
        [cap] * (num_layers * num_owners),
    )
    return _grid(flat, num_layers, num_owners)


def pyramid_layer_targets(total: int, num_layers: int, beta: float) -> list[Fraction]:
    """PyramidKV real layer budgets, bottom (layer 0) to top: a linear schedule."""
    if beta < 1:
        raise AllocationError("selection.allocation.beta", f"must be >= 1, got {beta}")
    if num_layers == 1:
        return [Fraction(total)]
    m = Fraction(num_layers)
    k_top = Fraction(total) / (Fraction(beta) * m)
    k_bottom = 2 * Fraction(total) / m - k_top
    step = (k_bottom - k_top) / (m - 1)
    return [k_bottom - step * layer for layer in range(num_layers)]


def zigzag_layer_targets(total: int, sensitivities: Sequence[Real], b_min: int) -> list[Fraction]:
    """ZigZagKV real layer budgets: B_min + (total - m B_min) * s_l / sum(s)."""
    m = len(sensitivities)
    residual = total - m * b_min
    if residual < 0:
        raise AllocationError(
            "selection.allocation.b_min", f"m * B_min = {m * b_min} exceeds the total {total}"
        )
    weights = _fractions(sensitivities)
    if any(w < 0 for w in weights):
        raise AllocationError("sensitivities", "must be non-negative")
    denominator = sum(weights)
    if denominator == 0:
        return [Fraction(b_min) + Fraction(residual, m)] * m
    return [b_min + residual * w / denominator for w in weights]


def layer_min_budget(scores: torch.Tensor, coverage: float) -> list[float]:
    """LMBA of every layer: rows needed to cover `coverage` of each owner's score mass, averaged.

    scores `[L, H_owner, T_p]`, non-negative. An owner with zero mass needs no rows.
    """
    if scores.dim() != 3:
        raise AllocationError(
            "scores", f"expected [L, H_owner, T_p], got shape {tuple(scores.shape)}"
        )
    ordered = torch.sort(scores.double(), dim=-1, descending=True).values  # [L, H, T_p]
    mass = ordered.cumsum(dim=-1)
    target = mass[..., -1:] * coverage if mass.shape[-1] else mass.new_zeros(mass.shape[:-1] + (1,))
    needed = (mass < target * (1 - 1e-12)).sum(dim=-1) + (target[..., 0] > 0).long()  # [L, H]
    return [float(x) for x in needed.double().mean(dim=-1)]


def adakv_layer_budgets(
    layer_scores: torch.Tensor,
    layer_total: int,
    uniform_share: float,
    floor: int = 0,
    cap: int | None = None,
) -> tuple[int, ...]:
    """Ada-KV budgets of one layer from its owner scores `[H_owner, T_p]`."""
    num_owners, prefix_len = (int(x) for x in layer_scores.shape)
    cap = prefix_len if cap is None else min(cap, prefix_len)
    raw = adakv_raw_counts(layer_scores, min(layer_total, num_owners * prefix_len))
    return adakv_budgets_from_counts(raw, layer_total, uniform_share, floor, cap)


def adakv_budgets_from_counts(
    raw: Sequence[int],
    layer_total: int,
    uniform_share: float,
    floor: int = 0,
    cap: int | None = None,
) -> tuple[int, ...]:
    """One layer's Ada-KV budgets from its raw owner counts B_i*: targets
    `u B/H + (1 - u) B_i*` (u = `uniform_share`, B = `layer_total`, H owners), apportioned to
    integers summing exactly to B within [floor, cap] (largest remainder)."""
    num_owners = len(raw)
    u = Fraction(uniform_share)
    targets = [u * Fraction(layer_total, num_owners) + (1 - u) * r for r in raw]
    return apportion(targets, layer_total, [floor] * num_owners, [cap] * num_owners)


def adakv_raw_counts(layer_scores: torch.Tensor, budget: int) -> list[int]:
    """Owner counts among the layer's global top-`budget` scores (ties: position, then owner):
    the first `budget` of a stable descending sort of the position-major scores, found by one
    k-th-value selection (`snapkv.top_k_mask`) instead of the sort."""
    num_owners, prefix_len = (int(x) for x in layer_scores.shape)
    if budget >= num_owners * prefix_len:
        return [prefix_len] * num_owners
    if budget <= 0:
        return [0] * num_owners
    flat = layer_scores.transpose(0, 1).reshape(-1)  # [T_p * H_owner], position-major
    kept = top_k_mask(flat, budget, TieRule.POSITION_ASCENDING).view(prefix_len, num_owners)
    # One owner at a time: a count over a dimension casts the whole mask to int64 first (8 n).
    return [int(kept[:, owner].count_nonzero()) for owner in range(num_owners)]


def headkv_budgets(
    profile: torch.Tensor, base: int, beta: float, floor: int = 0, cap: int | None = None
) -> BudgetGrid:
    """HeadKV budgets `[L][H]` from an importance profile `[L, H]`, b = `base` rows per owner."""
    if beta < 1:
        raise AllocationError("selection.allocation.beta", f"must be >= 1, got {beta}")
    num_layers, num_owners = (int(x) for x in profile.shape)
    importance = _fractions([float(x) for x in profile.reshape(-1).tolist()])
    if any(s < 0 for s in importance):
        raise AllocationError("head_profile", "importance must be non-negative")
    n = num_layers * num_owners
    b = Fraction(base)
    pool = n * b / Fraction(beta)
    denominator = sum(importance)
    shares = [s / denominator if denominator else Fraction(1, n) for s in importance]
    targets = [b - b / Fraction(beta) + pool * share for share in shares]
    return _grid(apportion(targets, n * base, [floor] * n, [cap] * n), num_layers, num_owners)


def profile_sha256(profile: torch.Tensor) -> str:
    """Identity of a HeadKV profile: shape plus little-endian float32 values."""
    values = np.ascontiguousarray(profile.detach().cpu().to(torch.float32).numpy(), dtype="<f4")
    header = "x".join(str(int(d)) for d in profile.shape).encode() + b":"
    return hashlib.sha256(header + values.tobytes()).hexdigest()


def selection_budget_per_owner(manifest: KVVisibilityPolicyManifest, prompt_len: int) -> int:
    """Average selected (non-protected) rows per owner: capacity minus protected rows."""
    selection = manifest.selection
    if selection.method is not SelectionMethod.SNAPKV:
        raise AllocationError(
            "selection.method", f"{selection.method.value} has no allocated budget"
        )
    return selection.capacity(prompt_len) - selection.protected_rows


def allocate(
    manifest: KVVisibilityPolicyManifest,
    prompt_len: int,
    scores: torch.Tensor | None = None,
    head_profile: torch.Tensor | None = None,
) -> BudgetGrid:
    """Prefix budgets K[l][h] for a SnapKV manifest and a prompt of `prompt_len` tokens.

    A prompt no longer than the capacity is kept whole: every owner's budget is all of its
    candidates. Otherwise the total L * H_owner * (capacity - protected) is conserved
    exactly. `scores [L, H_owner, T_p]` are needed by Ada-KV and ZigZagKV, `head_profile
    [L, H_owner]` (matching the manifest's profile digest) by HeadKV.
    """
    per_owner = selection_budget_per_owner(manifest, prompt_len)
    spec = manifest.selection.allocation
    assert spec is not None  # a snapkv manifest always declares its allocation
    num_layers, num_owners = manifest.tensor.num_layers, manifest.num_owners
    candidates = _candidates(manifest, prompt_len)
    if prompt_len <= manifest.selection.capacity(prompt_len):
        return tuple(tuple(candidates for _ in range(num_owners)) for _ in range(num_layers))
    cap = candidates if spec.cap_rows is None else min(spec.cap_rows, candidates)
    total = num_layers * num_owners * per_owner
    _check_feasible(spec, total, num_layers * num_owners, cap)
    if scores is not None:
        scores = _candidate_scores(
            manifest, _need_scores(scores, num_layers, num_owners), prompt_len, candidates
        )
    return _dispatch(spec, total, num_layers, num_owners, cap, scores, head_profile)


def _dispatch(
    spec: AllocationSpec,
    total: int,
    num_layers: int,
    num_owners: int,
    cap: int,
    scores: torch.Tensor | None,
    head_profile: torch.Tensor | None,
) -> BudgetGrid:
    floor = spec.floor_rows
    if spec.method is AllocationMethod.UNIFORM:
        return uniform_budgets(total, num_layers, num_owners, floor, cap)
    if spec.method is AllocationMethod.PYRAMIDKV:
        assert spec.beta is not None
        return _split_layers(
            pyramid_layer_targets(total, num_layers, spec.beta), total, num_owners, floor, cap
        )
    if spec.method is AllocationMethod.ZIGZAGKV:
        assert spec.b_min is not None and spec.coverage is not None
        lmba = layer_min_budget(_need_scores(scores, num_layers, num_owners), spec.coverage)
        return _split_layers(
            zigzag_layer_targets(total, lmba, spec.b_min), total, num_owners, floor, cap, spec.b_min
        )
    if spec.method is AllocationMethod.ADAKV:
        assert spec.uniform_share is not None
        layer_scores = _need_scores(scores, num_layers, num_owners)
        per_layer = total // num_layers
        return tuple(
            adakv_layer_budgets(layer_scores[layer], per_layer, spec.uniform_share, floor, cap)
            for layer in range(num_layers)
        )
    assert spec.beta is not None
    profile = _need_profile(head_profile, spec, num_layers, num_owners)
    return headkv_budgets(profile, total // (num_layers * num_owners), spec.beta, floor, cap)


def _split_layers(
    layer_targets: list[Fraction],
    total: int,
    num_owners: int,
    floor: int,
    cap: int,
    layer_floor: int = 0,
) -> BudgetGrid:
    """Integer layer budgets from real targets, then an even split across each layer's owners."""
    n = len(layer_targets)
    floors = [max(layer_floor, floor * num_owners)] * n
    layer_budgets = apportion(layer_targets, total, floors, [cap * num_owners] * n)
    return tuple(
        apportion([1] * num_owners, b, [floor] * num_owners, [cap] * num_owners)
        for b in layer_budgets
    )


def _candidates(manifest: KVVisibilityPolicyManifest, prompt_len: int) -> int:
    params = manifest.selection.snapkv
    assert params is not None
    prefix_len = prompt_len - min(params.observation_window, prompt_len)
    return prefix_len - min(manifest.selection.protected.sinks, prefix_len)


def _candidate_scores(
    manifest: KVVisibilityPolicyManifest, scores: torch.Tensor, prompt_len: int, candidates: int
) -> torch.Tensor:
    """Drop the sink columns: sinks are protected, not candidates.  # [L, H_owner, candidates]"""
    params = manifest.selection.snapkv
    assert params is not None
    prefix_len = prompt_len - min(params.observation_window, prompt_len)
    if int(scores.shape[-1]) != prefix_len:
        raise AllocationError(
            "scores", f"{int(scores.shape[-1])} prefix columns, prompt has {prefix_len}"
        )
    return scores[..., prefix_len - candidates :]


def _check_feasible(spec: AllocationSpec, total: int, owners: int, cap: int) -> None:
    if spec.floor_rows * owners > total:
        raise AllocationError(
            "selection.allocation.floor_rows",
            f"floors {spec.floor_rows} x {owners} owners exceed the budget {total}",
        )
    if cap * owners < total:
        raise AllocationError(
            "selection.allocation.cap_rows",
            f"caps {cap} x {owners} owners cannot reach the budget {total}",
        )


def _need_scores(scores: torch.Tensor | None, num_layers: int, num_owners: int) -> torch.Tensor:
    if scores is None:
        raise AllocationError("scores", "this allocation method needs the SnapKV owner scores")
    if scores.dim() != 3 or tuple(scores.shape[:2]) != (num_layers, num_owners):
        raise AllocationError(
            "scores", f"expected [{num_layers}, {num_owners}, T_p], got shape {tuple(scores.shape)}"
        )
    return scores


def _need_profile(
    profile: torch.Tensor | None, spec: AllocationSpec, num_layers: int, num_owners: int
) -> torch.Tensor:
    if profile is None:
        raise AllocationError("head_profile", "headkv needs the importance profile")
    if tuple(profile.shape) != (num_layers, num_owners):
        raise AllocationError(
            "head_profile",
            f"expected shape [{num_layers}, {num_owners}] (one entry per owner: query heads under"
            f" selection.snapkv.gqa_reduction expand, else K/V heads), got {tuple(profile.shape)}",
        )
    if profile_sha256(profile) != spec.headkv_profile_sha256:
        raise AllocationError(
            "selection.allocation.headkv_profile_sha256",
            "the profile does not match the manifest's digest",
        )
    return profile


def _grid(flat: Sequence[int], num_layers: int, num_owners: int) -> BudgetGrid:
    return tuple(
        tuple(flat[layer * num_owners : (layer + 1) * num_owners]) for layer in range(num_layers)
    )


def _fractions(values: Sequence[Real]) -> list[Fraction]:
    out = []
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise AllocationError("weights", f"non-finite weight {v}")
        out.append(Fraction(v))
    return out


def _check_apportion_inputs(
    weights: Sequence[Real], total: int, floors: list[int], caps: list[int | None]
) -> None:
    n = len(weights)
    if len(floors) != n or len(caps) != n:
        raise AllocationError(
            "floors", f"{len(floors)} floors and {len(caps)} caps for {n} weights"
        )
    if total < 0:
        raise AllocationError("total", f"must be non-negative, got {total}")
    if n == 0 and total:
        raise AllocationError("total", f"cannot place {total} rows in zero entries")
    if any(f < 0 for f in floors):
        raise AllocationError("floors", "must be non-negative")
    if any(c is not None and c < f for f, c in zip(floors, caps, strict=True)):
        raise AllocationError("caps", "a cap is below its floor")
    if any(w < 0 for w in _fractions(weights)):
        raise AllocationError("weights", "must be non-negative")
    if sum(floors) > total:
        raise AllocationError("floors", f"floors sum to {sum(floors)} > total {total}")
    if all(c is not None for c in caps) and sum(c for c in caps if c is not None) < total:
        raise AllocationError(
            "caps", f"caps sum to {sum(c for c in caps if c is not None)} < total {total}"
        )


def _fill(
    weights: list[Fraction], total: int, floors: list[int], caps: list[int | None]
) -> list[Fraction]:
    """Real targets clamp(lambda w_i, floor_i, cap_i) summing exactly to `total`."""
    if not any(weights):
        weights = [Fraction(1)] * len(weights)
    positive_caps = [c for w, c in zip(weights, caps, strict=True) if w > 0]
    zero = [i for i, w in enumerate(weights) if w == 0]
    if (
        None in positive_caps
        or sum(c or 0 for c in positive_caps) + sum(floors[i] for i in zero) >= total
    ):
        return _water_level(weights, total, floors, caps)
    # The positive-weight entries are all capped: they take their caps, the zero-weight
    # entries share the rest uniformly.
    rest = total - sum(c or 0 for c in positive_caps)
    inner = _water_level(
        [Fraction(1)] * len(zero), rest, [floors[i] for i in zero], [caps[i] for i in zero]
    )
    targets = [Fraction(c or 0) for c in caps]
    for i, t in zip(zero, inner, strict=True):
        targets[i] = t
    return targets


def _water_level(
    weights: list[Fraction], total: int, floors: list[int], caps: list[int | None]
) -> list[Fraction]:
    """Solve sum_i clamp(lambda w_i, f_i, c_i) = total for lambda by sweeping the breakpoints."""
    events: list[tuple[Fraction, Fraction]] = []
    for w, f, c in zip(weights, floors, caps, strict=True):
        if w > 0:
            events.append((Fraction(f) / w, w))
            if c is not None:
                events.append((Fraction(c) / w, -w))
    events.sort(key=lambda e: e[0])
    level, value, slope = Fraction(0), Fraction(sum(floors)), Fraction(0)
    for at, delta in events:
        reached = value + slope * (at - level)
        if reached >= total and slope > 0:
            break
        level, value, slope = at, reached, slope + delta
    if slope > 0:
        level += (total - value) / slope
    return [_clamp(level * w, f, c) for w, f, c in zip(weights, floors, caps, strict=True)]


def _clamp(x: Fraction, lo: int, hi: int | None) -> Fraction:
    x = max(x, Fraction(lo))
    return x if hi is None else min(x, Fraction(hi))


def _round_largest_remainder(targets: list[Fraction], total: int) -> tuple[int, ...]:
    base = [math.floor(t) for t in targets]
    remainder = total - sum(base)
    order = sorted(range(len(targets)), key=lambda i: (-(targets[i] - base[i]), i))
    for i in order[:remainder]:
        base[i] += 1
    return tuple(base)
