"""Decode-time retention decisions against a per-owner Python reference (issue 18): every
method, ragged owners, ties, the bounded-memory invariant, and the gather of K, V, scores and
positions with the same indices."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch

from services.kvpolicy.errors import SelectionError
from services.kvpolicy.retention import (
    PAD_POSITION,
    ScoreState,
    _gumbel,
    append,
    gather_rows,
    new_state,
    reduce_query_heads,
    state_bytes_per_row,
    step,
)
from services.kvpolicy.retention_contract import (
    KeyformerNoise,
    KeyformerParams,
    RetentionContract,
    RetentionMethod,
    ScissorhandsParams,
    ScoreOwner,
)


@dataclass
class Row:
    position: int
    score: float = 0.0
    history: list[bool] = field(default_factory=list)  # newest last


def reference_step(contract: RetentionContract, rows: list[Row], attn: list[float],
                   step_index: int, noise: list[float] | None) -> list[Row]:
    """One owner, one step, written from the issue's description, one row at a time."""
    n = len(rows)
    if contract.method is RetentionMethod.H2O:
        for row, a in zip(rows, attn, strict=True):
            row.score += a
    elif contract.method is RetentionMethod.KEYFORMER:
        params = contract.keyformer
        assert params is not None and params.schedule_steps is not None
        tau = params.tau_start + min(step_index, params.schedule_steps) / params.schedule_steps * (
            params.tau_end - params.tau_start)
        logits = [(math.log(max(a, 1.1754943508222875e-38)) + (noise[i] if noise else 0.0)) / tau
                  for i, a in enumerate(attn)]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        for row, w in zip(rows, weights, strict=True):
            row.score += w / sum(weights)
    elif contract.method is RetentionMethod.SCISSORHANDS:
        params = contract.scissorhands
        assert params is not None
        threshold = params.threshold if params.threshold is not None else 1.0 / n
        for row, a in zip(rows, attn, strict=True):
            row.history = (row.history + [a < threshold])[-params.history_window:]
    protected = set(range(min(contract.sinks, n))) | set(range(max(0, n - contract.recent_window), n))
    if contract.method is RetentionMethod.SCISSORHANDS:
        assert contract.scissorhands is not None
        if n <= contract.budget_rows:
            return rows
        drop = max(contract.scissorhands.drop_batch, n - contract.budget_rows)
        candidates = sorted((i for i in range(n) if i not in protected),
                            key=lambda i: (-sum(rows[i].history), i))  # most low steps, oldest
        dropped = set(candidates[:drop])
        return [row for i, row in enumerate(rows) if i not in dropped]
    keep = min(n, contract.budget_rows)
    if not contract.method.scores:
        kept = set(range(n)) if n <= keep else protected
    else:
        historical = sorted((i for i in range(n) if i not in protected),
                            key=lambda i: (-rows[i].score, i))  # equal scores: older kept
        kept = protected | set(historical[: keep - len(protected)])
    return [row for i, row in enumerate(rows) if i in kept]


def contracts() -> dict[str, RetentionContract]:
    return {
        "window": RetentionContract(RetentionMethod.WINDOW, 6, 6),
        "sink_recent": RetentionContract(RetentionMethod.SINK_RECENT, 7, 5, sinks=2),
        "h2o": RetentionContract(RetentionMethod.H2O, 7, 3),
        "h2o-sinks": RetentionContract(RetentionMethod.H2O, 8, 3, sinks=1),
        "scissorhands": RetentionContract(
            RetentionMethod.SCISSORHANDS, 8, 2,
            scissorhands=ScissorhandsParams(history_window=4, drop_batch=3)),
        "scissorhands-fixed": RetentionContract(
            RetentionMethod.SCISSORHANDS, 6, 2, sinks=1,
            scissorhands=ScissorhandsParams(history_window=63, drop_batch=1, threshold=0.2)),
        "keyformer": RetentionContract(
            RetentionMethod.KEYFORMER, 7, 2,
            keyformer=KeyformerParams(schedule_steps=5, tau_start=1.0, tau_end=2.0,
                                      noise_seed=7)),
        "keyformer-no-noise": RetentionContract(
            RetentionMethod.KEYFORMER, 7, 2,
            keyformer=KeyformerParams(schedule_steps=3, noise=KeyformerNoise.NONE)),
    }


def tied_attention(lengths: torch.Tensor, width: int, generator: torch.Generator) -> torch.Tensor:
    """[N, width] probabilities over each owner's real rows, quantized so that ties occur."""
    levels = torch.randint(0, 4, (lengths.shape[0], width), generator=generator).float()
    valid = torch.arange(width)[None, :] < lengths[:, None]
    weights = torch.where(valid, 2.0 ** levels, torch.zeros(()))
    return weights / weights.sum(1, keepdim=True)


@pytest.mark.parametrize("name", list(contracts()))
def test_each_method_matches_the_reference_step_by_step(name: str) -> None:
    contract = contracts()[name]
    generator = torch.Generator().manual_seed(11)
    start = torch.tensor([0, 3, 9, 12])  # ragged owners, one over the budget already
    positions = torch.full((4, 12), PAD_POSITION)
    for n, length in enumerate(start.tolist()):
        positions[n, :length] = torch.arange(length) * 2 + n  # gaps: a prompt view's positions
    state = new_state(contract, positions, start)
    reference = [[Row(int(p)) for p in positions[n, :length]]
                 for n, length in enumerate(start.tolist())]
    for t in range(40):
        new = torch.tensor([100 + t] * 4)
        state = append(contract, state, new)
        for rows in reference:
            rows.append(Row(100 + t))
        attn = tied_attention(state.lengths, state.rows, generator)
        stream = 3
        out = step(contract, state, attn if contract.method.scores else None, t, stream)
        noise = None
        if contract.keyformer is not None and contract.keyformer.noise is KeyformerNoise.GUMBEL:
            noise = _gumbel(attn.shape, contract.keyformer.noise_seed, stream, t)
        for n in range(4):
            length = len(reference[n])
            row_noise = None if noise is None else noise[n, :length].tolist()
            reference[n] = reference_step(contract, reference[n], attn[n, :length].tolist(), t,
                                          row_noise)
        state = out.state
        assert bool((state.lengths <= contract.budget_rows).all())  # bounded every step
        for n, rows in enumerate(reference):
            held = int(state.lengths[n])
            assert state.positions[n, :held].tolist() == [r.position for r in rows], (t, n)
            assert bool((state.positions[n, held:] == PAD_POSITION).all())
            if state.scores is not None:
                assert state.scores[n, :held].tolist() == pytest.approx(
                    [r.score for r in rows], rel=1e-5, abs=1e-6)
            if state.low_count is not None:
                assert state.low_count[n, :held].tolist() == [sum(r.history) for r in rows]


def test_scissorhands_worked_example_of_the_issue() -> None:
    """Six rows, low-attention counts [3, 0, 1, 2, 1, 1], recent 2 (rows 4, 5), drop 2:
    rows 0 and 3 go, [1, 2, 4, 5] are published."""
    contract = RetentionContract(RetentionMethod.SCISSORHANDS, 5, 2,
                                 scissorhands=ScissorhandsParams(history_window=8, drop_batch=2))
    history = [[1, 1, 1], [0, 0, 0], [0, 0, 1], [1, 0, 1], [0, 1, 0], [1, 0, 0]]
    bits = torch.tensor([[sum(b << i for i, b in enumerate(reversed(h))) for h in history]])
    counts = torch.tensor([[sum(h) for h in history]], dtype=torch.int32)
    assert counts.tolist() == [[3, 0, 1, 2, 1, 1]]
    state = ScoreState(torch.arange(6)[None], torch.tensor([6]), None, counts, bits)
    threshold = replace(contract, scissorhands=ScissorhandsParams(8, 2, threshold=1e-9))
    out = step(threshold, state, torch.full((1, 6), 1 / 6), 0)  # nothing below: counts stay
    assert out.keep.tolist() == [[1, 2, 4, 5]]
    assert out.state.positions.tolist() == [[1, 2, 4, 5]]
    assert out.dropped.tolist() == [[True, False, False, True, False, False]]
    assert out.state.low_count is not None and out.state.low_count.tolist() == [[0, 1, 1, 1]]


def test_h2o_evicts_one_row_per_step_once_over_budget() -> None:
    contract = RetentionContract(RetentionMethod.H2O, 5, 2)
    state = new_state(contract, torch.empty((2, 0), dtype=torch.int64), torch.zeros(2).long())
    generator = torch.Generator().manual_seed(3)
    for t in range(12):
        state = append(contract, state, torch.tensor([t, t]))
        before = state.lengths.clone()
        out = step(contract, state, tied_attention(state.lengths, state.rows, generator), t)
        expected_drops = (before > 5).long()
        assert (out.dropped.sum(1) == expected_drops).all()
        assert out.lengths.tolist() == before.clamp_max(5).tolist()
        state = out.state


def test_keyformer_noise_is_the_declared_seed() -> None:
    contract = contracts()["keyformer"]
    state = append(contract, new_state(contract, torch.arange(7)[None], torch.tensor([7])),
                   torch.tensor([7]))
    attn = torch.full((1, 8), 1 / 8)
    again = [step(contract, state, attn, 2, stream=1).state.scores for _ in range(2)]
    assert again[0] is not None and torch.equal(again[0], again[1])
    other_seed = replace(contract, keyformer=replace(contract.keyformer, noise_seed=8))
    other = step(other_seed, state, attn, 2, stream=1).state.scores
    other_stream = step(contract, state, attn, 2, stream=2).state.scores
    assert not torch.equal(again[0], other) and not torch.equal(again[0], other_stream)
    # Uniform attention, no noise: every row scores 1/8, whatever the temperature.
    quiet = replace(contract, keyformer=KeyformerParams(5, noise=KeyformerNoise.NONE))
    scores = step(quiet, state, attn, 2).state.scores
    assert scores is not None and scores[0].tolist() == pytest.approx([1 / 8] * 7)


def test_sinks_and_window_keep_a_fifo_after_the_sinks() -> None:
    contract = RetentionContract(RetentionMethod.SINK_RECENT, 6, 4, sinks=2)
    state = new_state(contract, torch.empty((1, 0), dtype=torch.int64), torch.zeros(1).long())
    for t in range(20):
        state = step(contract, append(contract, state, torch.tensor([t])), None, t).state
        held = list(range(t + 1)) if t < 6 else [0, 1, *range(t - 3, t + 1)]
        assert state.positions[0, : int(state.lengths[0])].tolist() == held


def symbolic_rows(positions: torch.Tensor, d_h: int, scale: int) -> torch.Tensor:
    """[N, R, d_h] rows whose value names their owner, position and column: K/V stand-ins."""
    owners = torch.arange(positions.shape[0])[:, None, None]
    return (1000 * owners + 10 * positions[:, :, None] * scale
            + torch.arange(d_h)[None, None, :]).float()


def rows_agree(k: torch.Tensor, v: torch.Tensor, state: ScoreState, scores: torch.Tensor,
               kept_scores: torch.Tensor | None) -> bool:
    """K, V and the score rows of each owner's kept rows all belong to its kept positions."""
    real = state.valid()
    ok = torch.equal(k[real], symbolic_rows(state.positions, k.shape[2], 1)[real])
    ok &= torch.equal(v[real], symbolic_rows(state.positions, v.shape[2], -1)[real])
    return ok and kept_scores is not None and torch.equal(kept_scores[real], scores[real])


def test_k_v_scores_and_positions_are_gathered_with_the_same_indices() -> None:
    contract = RetentionContract(RetentionMethod.H2O, 6, 2)
    generator = torch.Generator().manual_seed(5)
    positions = torch.arange(9).repeat(3, 1)
    state = append(contract, new_state(contract, positions, torch.tensor([9, 9, 9])),
                   torch.tensor([9, 9, 9]))
    k, v = symbolic_rows(state.positions, 4, 1), symbolic_rows(state.positions, 4, -1)
    attn = tied_attention(state.lengths, state.rows, generator)
    out = step(contract, state, attn, 0)
    assert out.state.scores is not None
    gathered = gather_rows((state.scores if state.scores is not None else attn) + attn, out.keep)
    assert rows_agree(gather_rows(k, out.keep), gather_rows(v, out.keep), out.state,
                      out.state.scores, gathered)
    shifted = (out.keep + 1).clamp_max(state.rows - 1)  # a valid shape, the wrong rows
    assert not rows_agree(gather_rows(k, out.keep), gather_rows(v, shifted), out.state,
                          out.state.scores, gathered)
    assert not rows_agree(gather_rows(k, out.keep), gather_rows(v, out.keep), out.state,
                          out.state.scores, gather_rows(attn, shifted))


def test_query_heads_reduce_to_their_owner() -> None:
    probs = torch.tensor([[0.1, 0.9], [0.3, 0.7], [0.6, 0.4], [0.2, 0.8]])  # [H_q=4, R=2]
    mean = reduce_query_heads(probs, 2, ScoreOwner.KV_HEAD_MEAN)
    assert torch.allclose(mean, torch.tensor([[0.2, 0.8], [0.4, 0.6]]))
    top = reduce_query_heads(probs, 2, ScoreOwner.KV_HEAD_MAX)
    assert torch.equal(top, torch.tensor([[0.3, 0.9], [0.6, 0.8]]))
    assert torch.equal(reduce_query_heads(probs, 2, ScoreOwner.QUERY_HEAD), probs)


def test_bad_step_inputs_name_the_argument() -> None:
    contract = contracts()["h2o"]
    state = new_state(contract, torch.arange(4)[None], torch.tensor([4]))
    with pytest.raises(SelectionError) as caught:
        step(contract, state, None, 0)
    assert caught.value.field == "attn"
    with pytest.raises(SelectionError) as caught:
        step(contract, state, torch.ones(1, 3), 0)
    assert caught.value.field == "attn"
    with pytest.raises(SelectionError) as caught:
        append(contract, state, torch.tensor([1, 2]))
    assert caught.value.field == "new_positions"
    with pytest.raises(SelectionError) as caught:
        new_state(contract, torch.arange(4)[None], torch.tensor([5]))
    assert caught.value.field == "lengths"


def test_score_state_bytes_per_row() -> None:
    named = contracts()
    assert [state_bytes_per_row(named[n]) for n in ("window", "h2o", "scissorhands")] == [
        8, 12, 20]
