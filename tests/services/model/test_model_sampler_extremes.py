"""Sampling is numerically safe for every value `check_sampling` admits: subnormal and huge
temperatures, a vanishing top_p, top-k of 1, extreme seeds, over logits as large as a real
model's, with ties and with -inf entries, in float32, bfloat16 and float16. A logits row no
token can come from (NaN, +inf, nothing finite) is refused by name, never sampled."""

from __future__ import annotations

import sys

import pytest
import torch

from services.model import SamplingParams, sample
from services.model.errors import NonFiniteLogits
from services.model.sampler import check_sampling, finite_rows, sampling_probs
from services.transfer.codec import sampling_from_proto, sampling_to_proto

torch.set_num_threads(1)
VOCAB = 512
TEMPERATURES = (
    4.6e-38,
    3.7e-38,
    1e-38,  # the issue's: they broke prefill (<= 3.7e-38) and the decode loop
    1e-45,
    5e-324,
    sys.float_info.min,
    1e-300,
    1e-6,
    1.0,
    1e6,
    3.4e38,
    1e300,
    sys.float_info.max,
)
FILTERS: tuple[dict[str, float], ...] = (
    {},
    {"top_k": 1},
    {"top_k": 3},
    {"top_p": 5e-324},
    {"top_p": 1e-300},
    {"top_p": 1e-7},
    {"top_p": 0.5, "top_k": 5},
    {"top_p": 1.0, "top_k": VOCAB + 10},
)
SEEDS = (None, 1, 2**63, 2**64 - 1)


def _logits() -> torch.Tensor:
    """Rows `[6, V]`: LLM-sized (|z| ~ 40), tiny, tied maxima, -inf entries, float16's range."""
    generator = torch.Generator().manual_seed(3)
    large = torch.randn(VOCAB, generator=generator) * 40
    tiny = torch.randn(VOCAB, generator=generator) * 1e-30
    tied = torch.zeros(VOCAB)
    tied[[7, 9]] = 5.0
    masked = torch.randn(VOCAB, generator=generator).masked_fill(
        torch.arange(VOCAB) % 3 == 0, float("-inf")
    )
    wide = torch.randn(VOCAB, generator=generator).sign() * 65000.0
    constant = torch.full((VOCAB,), -6.0e4)  # every token tied
    return torch.stack([large, tiny, tied, masked, wide, constant])


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_every_admitted_temperature_samples_a_valid_token(temperature: float) -> None:
    logits = _logits()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = logits.to(dtype)
        assert finite_rows(rows).all(), dtype
        for filters in FILTERS:
            for seed in SEEDS:
                params = SamplingParams(temperature=temperature, seed=seed, **filters)
                check_sampling(params)
                tokens = sample(rows, [params] * len(rows), list(range(len(rows)))).tolist()
                for row, token in zip(rows, tokens, strict=True):
                    _assert_valid(row, token, params)


def _assert_valid(row: torch.Tensor, token: int, params: SamplingParams) -> None:
    where = (params, row.dtype)
    probs = sampling_probs(row, params)
    assert probs.dtype == torch.float64 and probs.isfinite().all() and (probs >= 0).all(), where
    assert probs[row == row.max()].sum() > 0, where  # a best token always survives
    assert 0 <= token < VOCAB and torch.isfinite(row[token]), where
    assert probs[token] > 0, where
    if 0 < params.top_k < VOCAB:
        assert (row > row[token]).sum() < params.top_k, where
    if params.top_p <= 1e-7 or params.top_k == 1 or params.temperature <= 1e-38:
        assert row[token] == row.max(), where  # these can only pick a best token


def test_vanishing_temperature_is_greedy_and_huge_is_uniform_over_the_support() -> None:
    row = torch.tensor([1.0, 3.0, 2.0, 3.0 - 1e-6, -5.0])
    cold = sampling_probs(row, SamplingParams(temperature=5e-324))
    assert cold.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    hot = sampling_probs(row, SamplingParams(temperature=sys.float_info.max, top_k=3))
    assert torch.allclose(hot, torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))
    nucleus = sampling_probs(row, SamplingParams(temperature=1e300, top_p=1e-300))
    assert nucleus.nonzero().flatten().tolist() == [1]  # ties made by rounding keep the logit order


def test_wire_temperatures_stay_admitted_and_safe() -> None:
    # The proto carries float32: 1e-45 arrives as the smallest subnormal, 1e-46 as 0 (greedy).
    logits = _logits()[:1]
    for temperature in (1e-45, 1e-46, 3.7e-38, 4.6e-38):
        params, max_tokens = sampling_from_proto(
            sampling_to_proto(SamplingParams(temperature=temperature), 4)
        )
        assert max_tokens == 4
        assert int(sample(logits, [params], [0])[0]) == int(
            logits[0].argmax()
        )  # |z| ~ 40: cold enough


def test_rows_no_token_can_come_from_are_refused_by_index() -> None:
    logits = torch.randn(6, VOCAB)
    logits[1, 5] = float("nan")
    logits[3, 0] = float("inf")
    logits[4] = float("-inf")
    logits[5, :10] = float("-inf")  # some impossible tokens: still sound
    assert finite_rows(logits).tolist() == [True, False, True, False, False, True]
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams()] * 3
    with pytest.raises(NonFiniteLogits) as refused:
        sample(logits, params, [0] * 6)
    assert refused.value.rows == (1, 3, 4)
    assert "[1, 3, 4]" in str(refused.value)
    sound = finite_rows(logits)
    tokens = sample(
        logits[sound], [p for p, ok in zip(params, sound.tolist(), strict=True) if ok], [0] * 3
    )
    assert all(torch.isfinite(logits[sound][i, t]) for i, t in enumerate(tokens.tolist()))
