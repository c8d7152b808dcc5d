"""Sampling: greedy, temperature, top-k, top-p, stop decisions, seeded reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from services.model import InvalidModelInput, SamplingParams, finish_reason, sample
from services.model.sampler import sampling_probs

torch.set_num_threads(1)


def _draws(logits: torch.Tensor, params: SamplingParams, steps: range) -> list[int]:
    return [int(sample(logits[None], [params], [step])[0]) for step in steps]


def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, -1.0, 4.9]])
    greedy = SamplingParams()
    assert sample(logits, [greedy, greedy], [0, 7]).tolist() == [1, 0]
    top1 = SamplingParams(temperature=2.0, top_k=1, seed=3)
    assert _draws(logits[1], top1, range(20)) == [0] * 20


def test_seed_and_step_determine_the_token_whatever_the_batch():
    logits = torch.zeros(2, 1000)
    a, b = SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=1.0, seed=12)
    alone = _draws(logits[0], a, range(10))
    assert _draws(logits[0], a, range(10)) == alone
    batched = [int(sample(logits, [b, a], [step, step])[1]) for step in range(10)]
    assert batched == alone
    assert _draws(logits[0], b, range(10)) != alone
    assert len(set(alone)) > 5  # fresh randomness at every step


def test_top_k_restricts_support():
    logits = torch.tensor([4.0, 3.9, 3.8, 3.7, 3.6, 0.0])
    draws = set(_draws(logits, SamplingParams(temperature=1.0, top_k=3, seed=5), range(200)))
    assert draws == {0, 1, 2}


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    kept = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.75)) > 0
    assert kept.tolist() == [False, True, False, True]
    kept = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.85)) > 0
    assert kept.tolist() == [False, True, True, True]
    kept = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.01)) > 0
    assert kept.tolist() == [False, True, False, False]
    draws = set(_draws(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=1), range(200)))
    assert draws == {1, 3}


def test_low_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0])
    cold = _draws(logits, SamplingParams(temperature=0.05, seed=2), range(100))
    hot = _draws(logits, SamplingParams(temperature=1.0, seed=2), range(300))
    assert set(cold) == {0}
    share = hot.count(1) / len(hot)
    assert abs(share - 1 / (1 + math.e)) < 0.08


def test_finish_reasons():
    params = SamplingParams(stop_token_ids=(9,))
    assert finish_reason(2, 1, 10, params, eos_token_ids=(2,)) == "eos"
    assert finish_reason(9, 1, 10, params, eos_token_ids=(2,)) == "stop"
    assert finish_reason(4, 10, 10, params, eos_token_ids=(2,)) == "length"
    assert finish_reason(4, 3, 10, params, eos_token_ids=(2,)) is None
    assert finish_reason(2, 3, 10, SamplingParams(ignore_eos=True), (2,)) is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"stop_token_ids": (-1,)}, "sampling.stop_token_ids[0]"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidModelInput) as error:
        SamplingParams(**kwargs)
    assert error.value.field == field


def test_one_params_per_row_is_required():
    with pytest.raises(InvalidModelInput, match="sampling"):
        sample(torch.zeros(2, 4), [SamplingParams()], [0, 0])
