"""`kvrelay eval followup`: the follow-up turn's tokens (what is fed, what is asked), the
summary's arithmetic on hand-made rows, and a smoke run on the real SmolLM2-135M checkpoint
(512-token multi-key prompts) in which the follow-up goes on over the same cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvrelay.cli import app
from services.evaluation import ruler
from services.evaluation.followup import (
    FollowUpConfig,
    FollowUpRow,
    follow_up_turn,
    gap_closed,
    load_rows,
    run,
    summarize,
)
from services.evaluation.recall_ruler import CODES
from services.model.default import default_checkpoint
from services.model.loader import read_checkpoint
from services.model.tokenizer import ChatMessage, TextTokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    found = read_checkpoint(default_checkpoint()).tokenizer
    assert found is not None
    return found


def multikey(tokenizer: TextTokenizer, seed: int = 3) -> ruler.RulerPrompt:
    spec = ruler.PromptSpec(ruler.Task.NIAH_MULTIKEY, ruler.Haystack.NOISE,
                            ruler.Placement.BEFORE_FILLER, 512, 0.4, seed, 32)
    return ruler.build_prompt(tokenizer, spec)


def test_the_follow_up_asks_another_needle_after_the_end_of_the_answer_turn(
        tokenizer: TextTokenizer) -> None:
    prompt = multikey(tokenizer)
    asked = next(n for n in prompt.needles if n.answer)
    answer = tokenizer.encode(f" {asked.value}.", add_special_tokens=False)
    end = tokenizer.token_id("<|im_end|>")
    assert end is not None
    # Turn one ended on its stop token: that token was never fed; the follow-up starts with it.
    turn = follow_up_turn(tokenizer, prompt, [*answer, end], frozenset({end}))
    other = next(n for n in prompt.needles if not n.answer)
    assert (turn.key, turn.answer) == (other.key, other.value) and turn.key != asked.key
    text = tokenizer.decode(list(turn.fed), skip_special_tokens=False)
    assert text == (f"<|im_end|>\n<|im_start|>user\nWhat is the special magic number for "
                    f"{other.key}?<|im_end|>\n<|im_start|>assistant\n"
                    "Answer: The special magic number is")
    # The conversation so far reads as the chat template renders the three turns whole.
    user = prompt.text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
    prefix = ruler.NIAH_ANSWER_PREFIX
    rendered = tokenizer.render_chat([
        ChatMessage("user", user), ChatMessage("assistant", prefix + tokenizer.decode(answer)),
        ChatMessage("user", f"What is the special magic number for {other.key}?")]) + prefix
    assert tokenizer.decode([*prompt.ids, *answer, *turn.fed],
                            skip_special_tokens=False) == rendered
    # Ended at the token limit instead: its last token was sampled but not fed, so it goes first.
    cut = follow_up_turn(tokenizer, prompt, answer, frozenset({end}))
    assert cut.fed == (answer[-1], *turn.fed)


def test_a_follow_up_needs_another_needle(tokenizer: TextTokenizer) -> None:
    spec = ruler.PromptSpec(ruler.Task.NIAH_SINGLE, ruler.Haystack.NOISE,
                            ruler.Placement.BEFORE_FILLER, 512, 0.4, 3, 32)
    with pytest.raises(ValueError, match="multi-key"):
        follow_up_turn(tokenizer, ruler.build_prompt(tokenizer, spec), [5], frozenset())


def row(policy: str, budget: float | None, followup: float, index: int = 0,
        **kwargs: object) -> FollowUpRow:
    return FollowUpRow(policy=policy, budget=budget, length=512, index=index, seed=1,
                       first_output="", first_score=1.0, key="k",
                       followup_output=str(kwargs.pop("followup_output", "")),
                       followup_score=followup, **kwargs)  # type: ignore[arg-type]


def test_summary_gap_closed_recalled_share_and_times(tmp_path: Path) -> None:
    rows = [
        row("full", None, 1.0, followup_output=" 1234567."),
        row("full", None, 1.0, index=1, followup_output=": 7654321 and"),
        row("snapkv", 0.25, 0.0, omitted_rows=100), row("snapkv", 0.25, 0.0, index=1,
                                                       omitted_rows=100),
        row("snapkv+codes", 0.25, 1.0, omitted_rows=100, recalled_rows=4, recalls=1,
            followup_output="1234567. The",
            recalled_bytes=2048, fed_tokens=20, fed_s=0.5, answer_step_s=(0.1, 0.2),
            reprefill_s=2.0),
        row("snapkv+codes", 0.25, 0.0, index=1, omitted_rows=100, recalled_rows=6,
            followup_output=" 76.",
            fed_tokens=22, fed_s=0.7, answer_step_s=(0.3,), reprefill_s=4.0),
    ]
    cells = {(c.policy, c.budget): c for c in summarize(rows)}
    codes = cells["snapkv+codes", 0.25]
    assert codes.followup == 0.5 and codes.recalled_share == pytest.approx(0.05)
    assert codes.agrees == 0.5 and cells["full", None].agrees == 1.0
    assert cells["snapkv", 0.25].agrees == 0.0  # no number at all never agrees
    assert codes.recalled_kib == 1.0 and codes.fed_tokens == 21.0
    assert codes.fed_ms == pytest.approx(600.0) and codes.answer_ms == pytest.approx(200.0)
    assert codes.reprefill_ms == pytest.approx(3000.0)
    assert gap_closed(list(cells.values()), "snapkv+codes", 0.25) == 0.5
    no_gap = [c for c in cells.values() if c.policy != "snapkv"] + [
        *summarize([row("snapkv", 0.25, 1.0), row("snapkv", 0.25, 1.0, index=1)])]
    assert gap_closed(no_gap, "snapkv+codes", 0.25) is None
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r.__dict__) + "\n" for r in rows))
    assert load_rows(path) == rows


@pytest.mark.slow
def test_smoke_run_on_smollm2_asks_twice_over_one_cache(tmp_path: Path) -> None:
    config = FollowUpConfig(length=512, prompts=1, budgets=(0.25,), variants=(CODES,),
                            filler_tokens=32)
    report = run(default_checkpoint(), config, tmp_path, threads=1)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in rows] == ["full", "snapkv", "snapkv+codes"]
    assert len(report.rows) == 3
    # The follow-up over the cache turn one left continues the conversation a prefill of the
    # whole of it would: the full cache's first follow-up token is the one that prefill samples.
    full = rows[0]
    assert full["followup_first_token"] == full["reprefill_first_token"] >= 0
    assert full["first_output"] and full["followup_output"]
    assert all(r["fed_tokens"] >= 15 and r["fed_s"] > 0 and r["reprefill_s"] > 0 for r in rows)
    assert len({r["reprefill_s"] for r in rows}) == 1 and len({r["key"] for r in rows}) == 1
    assert all(r["recalled_rows"] == 0 for r in rows[:2])
    assert rows[2]["omitted_rows"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "| snapkv+codes | 25% |" in text and "followup.png" in text
    assert "in 1 of 1 prompts" in text
    assert (tmp_path / "followup.png").stat().st_size > 0


def test_followup_refuses_unknown_variants() -> None:
    result = CliRunner().invoke(app, ["eval", "followup", "--variants", "codes,nope"])
    assert result.exit_code == 2 and "nope" in result.output
    result = CliRunner().invoke(app, ["eval", "followup", "--prompts", "0"])
    assert result.exit_code == 2 and "prompts" in result.output
