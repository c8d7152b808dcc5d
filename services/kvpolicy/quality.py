"""Dense vs selected attention: how much a retained subset changes one attention output.

Retained softmax mass is not the same thing as output error: values can cancel, so a
subset with less mass can be closer to the dense output. When the dense output is zero
(up to rounding), a relative error is undefined and is reported as None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.kvpolicy.errors import SelectionError


@dataclass(frozen=True)
class AttentionFidelity:
    """Dense and selected outputs of one query, with the retained mass and the errors."""

    dense_output: torch.Tensor  # [d_v] float64
    selected_output: torch.Tensor  # [d_v] float64
    retained_mass: float
    abs_error: float  # L2 norm of selected - dense
    relative_error: float | None  # abs_error / ||dense||; None when the dense output is zero


def attention_fidelity(
    probs: torch.Tensor,
    values: torch.Tensor,
    selected: Sequence[int],
    zero_tolerance: float | None = None,
) -> AttentionFidelity:
    """Compare sum_t p_t v_t with the renormalized sum over the `selected` positions.

    probs `[T]` are dense softmax probabilities, values `[T]` or `[T, d_v]`. The dense
    output counts as zero when its norm is below `zero_tolerance * sum_t p_t ||v_t||`
    (cancellation noise); by default the tolerance is 8 eps of the inputs' precision.
    """
    if zero_tolerance is None:
        zero_tolerance = 8 * max(_eps(probs.dtype), _eps(values.dtype))
    p = probs.double()  # [T]
    v = values.double().reshape(int(p.shape[0]), -1)  # [T, d_v]
    index = _check(p, selected)
    dense = p @ v  # [d_v]
    mass = float(p[index].sum())
    if mass <= 0.0:
        raise SelectionError("selected", "the selected positions carry no probability mass")
    chosen = (p[index] / mass) @ v[index]  # [d_v]
    error = float(torch.linalg.vector_norm(chosen - dense))
    scale = float((p * torch.linalg.vector_norm(v, dim=1)).sum())
    dense_norm = float(torch.linalg.vector_norm(dense))
    relative = None if dense_norm <= zero_tolerance * scale else error / dense_norm
    return AttentionFidelity(dense, chosen, mass, error, relative)


def _eps(dtype: torch.dtype) -> float:
    return (
        float(torch.finfo(dtype).eps)
        if dtype.is_floating_point
        else float(torch.finfo(torch.float64).eps)
    )


def _check(p: torch.Tensor, selected: Sequence[int]) -> torch.Tensor:
    if p.dim() != 1 or bool((p < 0).any()):
        raise SelectionError("probs", "expected non-negative probabilities [T]")
    positions = list(selected)
    if (
        not positions
        or len(set(positions)) != len(positions)
        or not all(0 <= s < p.shape[0] for s in positions)
    ):
        raise SelectionError(
            "selected", f"{positions} must be distinct positions in [0, {int(p.shape[0])})"
        )
    return torch.tensor(positions, dtype=torch.long)
