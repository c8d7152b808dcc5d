"""`kvrelay eval --suite ruler` on the bundled SmolLM2 GGUF: RULER-style prompts are exact (length
in the model's tokens, needles at their depth, answers extractable from the needle tokens,
placements laid out as specified, seeds reproducible), RULER's string-match scorer agrees
with a brute-force count, the HeadKV profile of a GGUF file is found beside it or shipped by
digest, RULER calibration scores heads, and the smoke preset runs end to end on the real
model (report, heat maps, JSONL) and resumes without redoing finished trials."""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from services.evaluation import ruler
from services.evaluation.calibrate import (
    RulerCalibrationConfig,
    calibrate_ruler,
    ruler_calibration_prompts,
    speaks_needle_language,
)
from services.evaluation.ruler_eval import PolicySet
from services.evaluation.ruler_suite import (
    RESULTS_FILE,
    SUMMARY_FILE,
    SuiteOptions,
    run_suite,
)
from services.kvpolicy.head_profile import (
    PROFILE_SUFFIX,
    HeadProfile,
    ProfileProvenance,
    checkpoint_sha256,
    load_profile,
    profile_path,
    save_profile,
    shipped_profile_path,
)
from services.model import LoadedModel, load
from services.model.default import default_checkpoint
from services.model.loader import read_checkpoint
from services.model.tokenizer import TextTokenizer

WINDOW = PolicySet().shape.observation_window  # the suite's SnapKV observation window


@pytest.fixture(scope="module")
def gguf() -> Path:
    return default_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(gguf: Path) -> TextTokenizer:
    return read_checkpoint(gguf).require_tokenizer()


@pytest.fixture(scope="module")
def smol(gguf: Path) -> LoadedModel:
    return load(gguf)


def build(tokenizer: TextTokenizer, task: ruler.Task, haystack: ruler.Haystack,
          placement: ruler.Placement, length: int, depth: float = 0.5, seed: int = 1
          ) -> ruler.RulerPrompt:
    return ruler.build_prompt(tokenizer, ruler.PromptSpec(task, haystack, placement, length,
                                                          depth, seed))


GRID = list(itertools.product(ruler.Task, ruler.Haystack, ruler.Placement))


@pytest.mark.parametrize(("task", "haystack", "placement"), GRID)
def test_prompt_is_exact_and_its_answers_are_in_the_needle_tokens(
    tokenizer: TextTokenizer, task: ruler.Task, haystack: ruler.Haystack,
    placement: ruler.Placement,
) -> None:
    for length, depth in ((400, 0.1), (1024, 0.8)):
        prompt = build(tokenizer, task, haystack, placement, length, depth, seed=length)
        assert len(prompt.ids) == length
        assert list(prompt.ids) == tokenizer.encode(prompt.text, add_special_tokens=False)
        assert prompt.prefix + prompt.cue == prompt.ids and len(prompt.cue) == ruler.CUE_TOKENS
        assert prompt.text.startswith("<|im_start|>system")  # the checkpoint's chat template
        for needle, (a, b), (c, d) in zip(prompt.needles, prompt.needle_spans, prompt.value_spans,
                                          strict=True):
            assert tokenizer.decode(list(prompt.ids[a:b])).strip() == needle.text
            assert tokenizer.decode(list(prompt.ids[c:d])).strip() == needle.value
            assert a <= c < d <= b
        assert prompt.answers == tuple(n.value for n in prompt.needles if n.answer)
        expected = {ruler.Task.NIAH_MULTIVALUE: ruler.MULTIVALUE_VALUES,
                    ruler.Task.VARIABLE_TRACKING: ruler.VT_VARIABLES}.get(task, 1)
        assert len(set(prompt.answers)) == expected
        start, stop = prompt.context_span
        assert all(start <= a and b <= stop for a, b in prompt.needle_spans)


def test_a_prompt_the_paragraph_separator_cannot_complete_is_still_exact(
    tokenizer: TextTokenizer,
) -> None:
    # 24 whole paragraphs give 2046 tokens and "\n\n" + one character already 3 more: the
    # cut then continues the last paragraph (a prompt of the full preset).
    spec = ruler.PromptSpec(ruler.Task.VARIABLE_TRACKING, ruler.Haystack.PROSE,
                            ruler.Placement.BEFORE_FILLER, 2048, 0.6628305814890793, 23120480)
    prompt = ruler.build_prompt(tokenizer, spec)
    assert len(prompt.ids) == 2048 and len(prompt.answers) == ruler.VT_VARIABLES


@pytest.mark.parametrize("haystack", list(ruler.Haystack))
def test_the_asked_needle_sits_at_the_requested_depth(
    tokenizer: TextTokenizer, haystack: ruler.Haystack
) -> None:
    # One haystack unit is the resolution: noise units are ~22 tokens, prose paragraphs
    # up to a few hundred (2048 tokens of context).
    tolerance = 0.03 if haystack is ruler.Haystack.NOISE else 0.12
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        prompt = build(tokenizer, ruler.Task.NIAH_SINGLE, haystack, ruler.Placement.END, 2048,
                       depth)
        (measured,) = prompt.needle_depths()
        assert abs(measured - depth) <= tolerance, (depth, measured)
    multi = build(tokenizer, ruler.Task.NIAH_MULTIVALUE, haystack, ruler.Placement.END, 2048, 0.1)
    depths = multi.needle_depths()
    assert depths == tuple(sorted(depths)) and depths[-1] - depths[0] > 0.5  # spread out


def test_placements_move_only_the_question(tokenizer: TextTokenizer) -> None:
    task, haystack = ruler.Task.NIAH_MULTIKEY, ruler.Haystack.PROSE
    prompts = {p: build(tokenizer, task, haystack, p, 1024, 0.4, seed=7) for p in ruler.Placement}
    needles = {tuple(n.text for n in prompt.needles) for prompt in prompts.values()}
    assert len(needles) == 1 and len({p.answers for p in prompts.values()}) == 1
    (asked,) = [n for n in prompts[ruler.Placement.END].needles if n.answer]
    key = asked.text.split(" for ")[1].split(" is:")[0]
    key_ids = tokenizer.encode(" " + key, add_special_tokens=False)
    end, first, filler = (prompts[p] for p in ruler.Placement)
    # question-aware: after the context, its key inside the observation window
    assert end.question_span[0] >= end.context_span[1]
    assert _contains(end.prefix[-WINDOW:], key_ids)
    # question-agnostic: before the context, or before >= filler_tokens of filler
    assert first.question_span[1] <= first.context_span[0]
    assert filler.question_span[0] >= filler.context_span[1]
    assert filler.cue_start - filler.question_span[1] >= ruler.DEFAULT_FILLER_TOKENS
    for agnostic in (first, filler):
        assert not _contains(agnostic.prefix[-WINDOW:], key_ids)
        assert not _contains(agnostic.prefix[-ruler.DEFAULT_FILLER_TOKENS:], key_ids)
    assert len({p.text for p in prompts.values()}) == 3


def _contains(ids: tuple[int, ...], part: list[int]) -> bool:
    core = part[1:]  # the leading space merges differently at the start of the key
    return any(list(ids[i : i + len(core)]) == core for i in range(len(ids) - len(core) + 1))


def test_seeds_reproduce_prompts_and_differ_between_seeds(tokenizer: TextTokenizer) -> None:
    args = (ruler.Task.VARIABLE_TRACKING, ruler.Haystack.PROSE, ruler.Placement.BEFORE_FILLER, 512)
    first, again = build(tokenizer, *args, seed=3), build(tokenizer, *args, seed=3)
    assert first == again
    other = build(tokenizer, *args, seed=4)
    assert other.ids != first.ids and other.answers != first.answers
    chain = [n.text for n in first.needles]
    assert chain[0].endswith(f"= {first.needles[0].text.split('= ')[1]}")
    assert all(f"VAR {b.value} = VAR {a.value}." == b.text
               for a, b in itertools.pairwise(first.needles))


def test_spec_errors_name_the_field(tokenizer: TextTokenizer) -> None:
    with pytest.raises(ruler.PromptSpecInvalid) as depth:
        ruler.PromptSpec(ruler.Task.NIAH_SINGLE, ruler.Haystack.NOISE, ruler.Placement.END, 512,
                         1.5, 0)
    assert depth.value.field == "depth"
    with pytest.raises(ruler.PromptSpecInvalid) as length:
        build(tokenizer, ruler.Task.NIAH_MULTIVALUE, ruler.Haystack.NOISE,
              ruler.Placement.BEFORE_FILLER, 160)
    assert length.value.field == "length"


def test_string_match_all_is_the_share_of_answers_found() -> None:
    rng = random.Random(0)
    for _ in range(300):
        answers = [str(rng.randrange(10**6, 10**7)) for _ in range(rng.randint(1, 4))]
        found = [a for a in answers if rng.random() < 0.5]
        noise = [str(rng.randrange(10**6, 10**7)) for _ in range(rng.randint(0, 3))]
        words = found + noise
        rng.shuffle(words)
        text = ", ".join(words)
        brute = sum(any(a == w or a in w for w in words) for a in answers) / len(answers)
        assert ruler.string_match_all(text, answers) == brute
    assert ruler.string_match_all("The numbers: ABCDE and fghij", ["abcde", "FGHIJ"]) == 1.0
    assert ruler.string_match_all("", ["1"]) == 0.0
    with pytest.raises(ValueError, match="answers"):
        ruler.string_match_all("x", [])


def test_gguf_profile_lives_beside_the_file_or_ships_by_digest(
    tmp_path: Path, gguf: Path
) -> None:
    copy = tmp_path / "model.gguf"
    copy.write_bytes(b"GGUF not a model, only bytes to digest")
    assert load_profile(copy) is None
    profile = HeadProfile(torch.rand(2, 1), torch.rand(2, 3), ProfileProvenance(
        "retrieval-top1-ruler", 1, 0, (256,), ("end",), 3, checkpoint_sha256(copy), 1.0))
    written = save_profile(copy, profile)
    assert written == profile_path(copy) == tmp_path / f"model.gguf{PROFILE_SUFFIX}"
    loaded = load_profile(copy)
    assert loaded is not None and loaded.sha256 == profile.sha256
    shipped = load_profile(gguf)  # site-packages holds no profile: the shipped one, by digest
    assert not profile_path(gguf).exists()
    assert shipped is not None and shipped_profile_path(checkpoint_sha256(gguf)).is_file()
    assert shipped.provenance.checkpoint_sha256 == checkpoint_sha256(gguf)
    assert shipped.provenance.method == "retrieval-top1-ruler"
    assert tuple(shipped.kv_head.shape) == (30, 3) and tuple(shipped.query_head.shape) == (30, 9)


def test_ruler_calibration_scores_heads_on_the_real_model(
    smol: LoadedModel, tokenizer: TextTokenizer
) -> None:
    assert not speaks_needle_language(tokenizer)
    config = RulerCalibrationConfig(context_lengths=(256,), prompts=1,
                                    placements=(ruler.Placement.END,))
    prompts = ruler_calibration_prompts(tokenizer, config)
    for prompt in prompts:
        (start, stop), = [s for s, n in zip(prompt.value_spans, prompt.needles, strict=True)
                          if n.answer]
        assert tokenizer.decode(list(prompt.ids[start - 1 : stop])) == " " + prompt.answers[0]
    profile = calibrate_ruler(smol, config, "d" * 64)
    assert tuple(profile.query_head.shape) == (30, 9) and tuple(profile.kv_head.shape) == (30, 3)
    assert float(profile.query_head.min()) >= 0.0 and float(profile.query_head.max()) <= 1.0
    assert float(profile.query_head.max()) > 0.0  # some head copies the needle's digits
    assert profile.provenance.prompts == len(prompts) == 3


def test_smoke_preset_writes_the_report_and_resumes(tmp_path: Path, gguf: Path) -> None:
    out = tmp_path / "ruler"
    run_suite(SuiteOptions(gguf, out, "smoke", threads=1))
    for name in ("ruler.md", "heatmap_policy_budget.png", "heatmap_task_length_end.png",
                 "heatmap_task_length_before_filler.png", SUMMARY_FILE):
        assert (out / name).is_file(), name
    lines = (out / RESULTS_FILE).read_text().splitlines()
    trials = [json.loads(line) for line in lines]
    # 2 placements x (full, window, sink-recent, snapkv uniform, + recallable_local) + kvpress
    assert len(trials) == 12
    assert {t["engine"] for t in trials} == {"kvrelay", "kvpress"}
    full = [t for t in trials if t["policy"] == "full"]
    assert all(t["score"] == 1.0 for t in full), full  # SmolLM2 finds a needle at 256 tokens
    report = (out / "ruler.md").read_text()
    assert "kvrelay vs kvpress" in report and "snapkv/uniform/mean / snapkv" in report
    # an interrupted run: the second placement's trials are gone and the last line is torn
    first = [line for line, t in zip(lines, trials, strict=True) if t["placement"] == "end"]
    (out / RESULTS_FILE).write_text("\n".join(first) + '\n{"engine": "kvre')
    shutil.copy(out / "ruler.md", tmp_path / "before.md")
    run_suite(SuiteOptions(gguf, out, "smoke", threads=1, resume=True))
    resumed = (out / RESULTS_FILE).read_text().splitlines()
    assert resumed[: len(first)] == first and len(resumed) == 12
    assert sorted(resumed) == sorted(lines)  # the same trials, the finished ones not redone
