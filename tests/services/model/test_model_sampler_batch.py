"""The batch-vectorized sampler against an independent per-row reference (a full stable sort for
top-p, splitmix64 written out here for the seeded uniform, a Python scan of the cumulative mass
for the inverse CDF): the same tokens and the same float64 distributions, whatever shares the
batch and wherever the row sits."""

from __future__ import annotations

import pytest
import torch

from services.model import SamplingParams, sample
from services.model.errors import NonFiniteLogits
from services.model.sampler import NUCLEUS_CANDIDATES, batch_sampling_probs, seeded_uniform

torch.set_num_threads(1)


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits.double()
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        order = torch.sort(logits, descending=True, stable=True).indices  # ties: lower id first
        ordered = probs[order]
        mass_before = torch.cumsum(ordered, dim=-1) - ordered
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = mass_before >= params.top_p
        probs = probs.masked_fill(drop, 0.0)
    return probs


def _splitmix_uniform(seed: int, step: int) -> float:
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z = (z ^ (z >> 31)) & ((1 << 63) - 1)
    return (z >> 10) / float(1 << 53)


def _reference_token(row: torch.Tensor, params: SamplingParams, step: int) -> int:
    if params.greedy:
        return int(row.argmax())
    probs = _reference_probs(row, params)
    cdf = torch.cumsum(probs, dim=0).tolist()
    target = _splitmix_uniform(params.seed or 0, step) * cdf[-1]
    for token, mass in enumerate(cdf):
        if mass > target:
            return token
    raise AssertionError("no token drawn")


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=5, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, seed=3),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.5, seed=4),
    SamplingParams(temperature=1e-300, seed=5),
    SamplingParams(temperature=1e300, top_k=3, seed=6),
    SamplingParams(temperature=2.0, top_k=1, seed=7),
    SamplingParams(temperature=1.0, top_p=1e-300, seed=8),
    SamplingParams(temperature=1.0, top_k=10_000, seed=9),  # k >= V: no top-k
]


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 7] = logits[:, 3]  # ties at the top of every row
    logits[:, 11] = float("-inf")  # a token that cannot be drawn
    return logits


def test_batched_tokens_equal_the_per_row_reference() -> None:
    for trial in range(4):
        logits = _logits(len(PARAMS), 257, trial)
        steps = [trial * 13 + b for b in range(len(PARAMS))]
        got = sample(logits, PARAMS, steps).tolist()
        want = [_reference_token(r, p, s) for r, p, s in zip(logits, PARAMS, steps, strict=True)]
        assert got == want


def test_batched_distributions_are_bitwise_the_per_row_ones() -> None:
    sampled = [p for p in PARAMS if not p.greedy]
    logits = _logits(len(sampled), 1000, 5).to(torch.bfloat16)
    got = batch_sampling_probs(logits, sampled)
    for row, params, probs in zip(logits, sampled, got, strict=True):
        assert torch.equal(probs, _reference_probs(row, params))


def test_a_request_draws_the_same_tokens_whatever_shares_the_batch() -> None:
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    row = _logits(1, 512, 9)[0]
    alone = [int(sample(row[None], [mine], [s])[0]) for s in range(12)]
    for size in (2, 5, 16):
        others = _logits(size - 1, 512, size)
        position = size // 2
        batch = torch.cat([others[:position], row[None], others[position:]])
        params = [PARAMS[(b + size) % len(PARAMS)] for b in range(size)]
        params[position] = mine
        together = [
            int(sample(batch, params, [s] * size)[position]) for s in range(12)
        ]
        assert together == alone
    assert len(set(alone)) > 3  # fresh randomness at every step


def test_unsound_rows_are_named_and_the_sound_rows_sample_as_alone() -> None:
    logits = _logits(4, 64, 3)
    logits[2, 5] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=b + 1) for b in range(4)]
    with pytest.raises(NonFiniteLogits) as failure:
        sample(logits, params, [0, 0, 0, 0])
    assert failure.value.rows == (2,)
    live = [0, 1, 3]
    got = sample(logits[live], [params[b] for b in live], [0, 0, 0]).tolist()
    assert got == [_reference_token(logits[b], params[b], 0) for b in live]


def test_unseeded_rows_draw_inside_their_support() -> None:
    logits = _logits(3, 100, 1)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 3
    allowed = torch.topk(logits, 2, dim=-1).indices
    for _ in range(20):
        tokens = sample(logits, params, [0, 1, 2])
        assert bool((allowed == tokens[:, None]).any(dim=-1).all())


def test_the_seeded_uniform_is_splitmix64_of_seed_and_step() -> None:
    for seed, step in ((1, 0), (2, 1), (2**62, 7), (12345, 10**6)):
        assert seeded_uniform(seed, step) == _splitmix_uniform(seed, step)
        assert 0.0 <= seeded_uniform(seed, step) < 1.0


def test_a_wide_nucleus_is_ranked_by_the_full_sort() -> None:
    """Flat logits put the nucleus past the ranked candidates (and ties at their boundary): the
    row falls back to the full stable sort, and the distribution is still the reference's."""
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = torch.zeros(3, vocab)
    logits[1, ::3] = 0.5  # many equal logits straddling the candidates' boundary
    logits[2, :10] = 30.0  # a narrow nucleus: the fast path alone
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s + 1) for s in range(3)]
    got = batch_sampling_probs(logits, params)
    for row, p, probs in zip(logits, params, got, strict=True):
        assert torch.equal(probs, _reference_probs(row, p))
    tokens = sample(logits, params, [3, 3, 3]).tolist()
    assert tokens == [_reference_token(r, p, 3) for r, p in zip(logits, params, strict=True)]
    assert int((got[0] > 0).sum()) > NUCLEUS_CANDIDATES  # the full-sort path really ran
