"""`kvrelay eval retention`'s teacher forcing against independent references on the demo
checkpoint: the model's own prefill (nothing evicted), dense masked attention (sinks + window
at original positions), and a per-token loop that stores keys pre-RoPE and rotates every one
by its slot (sinks + window, cache-local positions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.evaluation.retention_chunked import candidate_rows, chunked_teacher_forced
from services.evaluation.retention_eval import (
    METHODS,
    Cell,
    cells,
    full_cache_nll,
    nll_of,
    teacher_forced,
)
from services.evaluation.retention_report import RetentionEvalOptions, run
from services.kvpolicy.retention_contract import (
    PositionContract,
    RetentionContract,
    RetentionMethod,
)
from services.model.attention import Attend
from services.model.default import DEMO_CHECKPOINT
from services.model.layers import rotate
from services.model.loader import LoadedModel, load

SINKS, RECENT = 2, 6


@pytest.fixture(scope="module")
def demo() -> LoadedModel:
    torch.set_num_threads(1)
    return load(DEMO_CHECKPOINT)


def tokens(model: LoadedModel, count: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(4)
    return torch.randint(0, model.config.vocab_size, (count,), generator=generator)


def sink_recent(positions: PositionContract) -> RetentionContract:
    return RetentionContract(RetentionMethod.SINK_RECENT, SINKS + RECENT, RECENT, SINKS,
                             positions=positions)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H_q, d], keys/values [K, H_kv, d], visible [Q, K] -> [Q, H_q, d], dense."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~visible[None], -torch.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@torch.no_grad()
def dense_sink_recent_nll(model: LoadedModel, ids: torch.Tensor) -> list[float]:
    """Original positions: token t sees the sinks and positions t - RECENT .. t."""
    t = torch.arange(ids.numel())
    visible = (t[None, :] <= t[:, None]) & ((t[None, :] < SINKS)
                                            | (t[:, None] - t[None, :] <= RECENT))

    def attention(layer: int) -> Attend:
        return lambda q, k, v: grouped_attention(q, k, v, visible, model.model.scale)

    logits = model.model(ids, t, attention)
    return nll_of(logits[:-1], ids[1:]).tolist()


@torch.no_grad()
def pre_rope_loop_nll(model: LoadedModel, ids: torch.Tensor) -> list[float]:
    """Cache-local positions, the StreamingLLM way: keys kept pre-RoPE, every one rotated by
    its slot at every step, the query at the newest slot."""
    lm, rotary = model.model, model.model.rotary
    kept: list[int] = []
    store: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [
        {} for _ in range(model.config.num_layers)]
    out = []
    for t in range(ids.numel() - 1):
        kept.append(t)
        slot = len(kept) - 1

        def attention(layer: int, t: int = t, slot: int = slot, kept: list[int] = kept
                      ) -> Attend:
            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                store[layer][t] = (rotate(k[0], torch.tensor(-slot), rotary), v[0])
                keys = torch.stack([store[layer][p][0] for p in kept])  # [n, H_kv, d] pre-RoPE
                keys = rotate(keys, torch.arange(len(kept)), rotary)
                values = torch.stack([store[layer][p][1] for p in kept])
                visible = torch.ones((1, len(kept)), dtype=torch.bool)
                return grouped_attention(q, keys, values, visible, lm.scale)
            return attend

        logits = lm(ids[t: t + 1], torch.tensor([slot]), attention)
        out.extend(nll_of(logits, ids[t + 1: t + 2]).tolist())
        if len(kept) > SINKS + RECENT:
            kept = kept[:SINKS] + kept[-RECENT:]
    return out


def test_without_eviction_the_token_loop_is_the_models_prefill(demo: LoadedModel) -> None:
    ids = tokens(demo, 40)
    roomy = [Cell("window", 64, RetentionContract(RetentionMethod.WINDOW, 64, 64)),
             Cell("local", 64, RetentionContract(RetentionMethod.SINK_RECENT, 64, 60, 4,
                                                 positions=PositionContract.CACHE_LOCAL))]
    full = torch.tensor(full_cache_nll(demo, ids, chunk=16))
    for result in teacher_forced(demo, ids, roomy):
        assert torch.allclose(torch.tensor(result.nll), full, atol=1e-4), result.cell.label


def test_sinks_and_window_match_the_references_at_both_position_contracts(
        demo: LoadedModel) -> None:
    ids = tokens(demo, 36)
    group = [Cell("original", SINKS + RECENT, sink_recent(PositionContract.ORIGINAL)),
             Cell("local", SINKS + RECENT, sink_recent(PositionContract.CACHE_LOCAL))]
    original, local = teacher_forced(demo, ids, group)
    dense = torch.tensor(dense_sink_recent_nll(demo, ids))
    assert torch.allclose(torch.tensor(original.nll), dense, atol=1e-4)
    loop = torch.tensor(pre_rope_loop_nll(demo, ids))
    assert torch.allclose(torch.tensor(local.nll), loop, atol=1e-3)
    # Past the budget the two contracts see the same rows at different distances.
    assert not torch.allclose(torch.tensor(local.nll[12:]), dense[12:], atol=1e-3)
    assert original.max_rows == local.max_rows == SINKS + RECENT


def test_positional_cells_in_chunks_are_the_token_loop(demo: LoadedModel) -> None:
    ids = tokens(demo, 50)
    group = cells(("window-decode", "sink-recent-decode", "sink-recent-local"), (8,), sinks=2)
    for cell, looped in zip(group, teacher_forced(demo, ids, group), strict=True):
        chunked = chunked_teacher_forced(demo, ids, cell, chunk=16)
        assert torch.allclose(torch.tensor(chunked.nll), torch.tensor(looped.nll), atol=1e-4)
        assert chunked.max_rows == looped.max_rows == 8
    with pytest.raises(ValueError, match="reads attention"):
        candidate_rows(cells(("h2o",), (8,), sinks=2)[0].contract, 4)  # type: ignore[arg-type]


def test_every_method_stays_within_its_budget(demo: LoadedModel) -> None:
    group = cells(METHODS, (8, 12), sinks=2)
    results = teacher_forced(demo, tokens(demo, 30), group)
    assert [r.cell.label for r in results] == [c.label for c in group]
    for result in results:
        assert result.cell.budget is not None and result.max_rows == result.cell.budget
        assert len(result.nll) == 29 and all(x > 0 for x in result.nll)


def test_the_command_writes_its_report(demo: LoadedModel, tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    options = RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path / "out", text=text, skip_lines=0,
                                   tokens=24, budgets=(8,),
                                   methods=("window-decode", "h2o", "scissorhands"),
                                   sinks=2, long_tokens=20, long_budget=8, dtype="float32")
    summary = run(options)
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["perplexity-long.png", "perplexity-sweep.png", "results.json",
                     "retention.md"]
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["runs"][1]["cells"][1]["nll"] == summary["runs"][1]["cells"][1]["nll"]
    sweep = summary["runs"][0]["cells"]
    assert [c["cell"] for c in sweep] == ["full", "window-decode@8", "h2o@8", "scissorhands@8"]
    assert all(c["bounded"] for run_ in summary["runs"] for c in run_["cells"])
    assert [row["cell"] for row in summary["costs"]["cells"]] == [c["cell"] for c in sweep[1:]]
    with pytest.raises(ValueError, match="unknown methods"):
        RetentionEvalOptions(DEMO_CHECKPOINT, tmp_path, methods=("lru",))
