"""Dense vs selected attention: retained mass is not output error, and 0/0 is not a number."""

from __future__ import annotations

import pytest
import torch

from services.kvpolicy.errors import SelectionError
from services.kvpolicy.quality import attention_fidelity

P = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
V = torch.tensor([0.0, 1.0, 0.0, -3.0], dtype=torch.float64)


def test_dense_output_is_zero() -> None:
    report = attention_fidelity(P, V, [0, 1, 2, 3])
    assert float(report.dense_output[0]) == pytest.approx(0.0, abs=1e-12)
    assert report.retained_mass == pytest.approx(1.0)


def test_lower_retained_mass_can_have_lower_error() -> None:
    heavy = attention_fidelity(P, V, [0, 1])  # mass 0.7, output 0.3 / 0.7
    light = attention_fidelity(P, V, [0, 2])  # mass 0.6, output 0
    assert light.retained_mass < heavy.retained_mass
    assert light.abs_error < heavy.abs_error
    assert float(heavy.selected_output[0]) == pytest.approx(3 / 7)
    assert heavy.abs_error == pytest.approx(3 / 7)
    assert light.abs_error == pytest.approx(0.0, abs=1e-12)


def test_relative_error_is_undefined_when_the_dense_output_is_zero() -> None:
    assert attention_fidelity(P, V, [0, 1]).relative_error is None
    assert attention_fidelity(P, V, [0, 2]).relative_error is None
    # float32 inputs: the dense output is ~1e-8 of rounding noise, still zero at that precision
    assert attention_fidelity(P.float(), V.float(), [0, 1]).relative_error is None


def test_relative_error_is_reported_when_defined() -> None:
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 0.0]])  # [T, d_v]
    report = attention_fidelity(P, values, [0, 1])
    dense = torch.tensor([0.4 + 0.2 + 0.2, 0.3 + 0.2])
    selected = torch.tensor([0.4, 0.3]) / 0.7
    assert report.relative_error == pytest.approx(float((selected - dense).norm() / dense.norm()))


def test_rejects_bad_selections() -> None:
    for selected in ([], [0, 0], [4], [-1]):
        with pytest.raises(SelectionError) as info:
            attention_fidelity(P, V, selected)
        assert info.value.field == "selected"
    with pytest.raises(SelectionError) as mass:
        attention_fidelity(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 2.0]), [1])
    assert mass.value.field == "selected"
    with pytest.raises(SelectionError) as probs:
        attention_fidelity(torch.tensor([1.0, -0.1]), torch.tensor([1.0, 2.0]), [0])
    assert probs.value.field == "probs"
