"""The demo training loop: batches supervise exactly the answers, and a few steps of a tiny
model produce a checkpoint that kvrelay's runtime loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from services.demo import needle
from services.demo.needle import DocumentMix
from services.demo.train import (
    Stage,
    TrainConfig,
    attention_targets,
    head_attention_loss,
    learning_rate,
    make_batch,
    model_config,
    name_probe_targets,
    train,
    training_loss,
)
from services.model import generate, load


def _tiny(tmp_path: Path) -> TrainConfig:
    return TrainConfig(
        out_dir=tmp_path / "ckpt",
        layers=3, d_model=32, heads=4, kv_heads=2, head_dim=8, intermediate=64, attention_layer=2,
        tokens_per_step=256, warmup_steps=2, final_decay_steps=2, eval_every=1000,
        curriculum=(Stage(64, 0.0, 0.1, 0.0, max_steps=3, min_steps=1),
                    Stage(128, 0.3, 0.5, 0.5, max_steps=2, min_steps=2, gap_max=16)),
    )


def test_batch_marks_every_answer_and_only_answers() -> None:
    batch = make_batch(Stage(256, 0.2, 0.6, 0.5, max_steps=1, min_steps=1, gap_max=32), 4, random.Random(3))
    words = needle.vocabulary()
    assert batch.input_ids.shape == (4, 256)
    answers = [words[i] for i in batch.input_ids[batch.rows, batch.positions].tolist()]
    cues = [words[i] for i in batch.input_ids[batch.rows, batch.positions - 1].tolist()]
    assert answers and set(answers) <= set(needle.CODES) and set(cues) == {":"}
    assert len(answers) == int((batch.input_ids == words.index("what")).sum())


def test_name_probe_targets_fact_codes_and_answer_cues() -> None:
    mix = DocumentMix(300, 0.3, 0.5, gap_min=8, gap_max=32)
    document = needle.build_training_sequence(mix, random.Random(7))
    words = document.words
    targets = dict(name_probe_targets(document))
    facts = [i for i in range(len(words)) if words[i] in needle.CODES and words[i - 1] == "is"]
    cues = [p - 1 for p in document.answer_positions]
    assert sorted(targets) == sorted(facts + cues)
    for at in facts:
        assert needle.NAMES[targets[at]] == words[at - 2]
    for at in cues:
        asked = max(i for i in range(at) if words[i] == "what")
        assert needle.NAMES[targets[at]] == words[asked + 5]


def test_attention_targets_link_cues_question_marks_facts_and_names() -> None:
    mix = DocumentMix(400, 0.3, 0.5, gap_min=8, gap_max=32, min_facts=4)
    document = needle.build_training_sequence(mix, random.Random(3))
    words = document.words
    targets = attention_targets(document)
    assert len(targets.answers) == len(document.answer_positions) > 0
    for answer, link in zip(document.answer_positions, targets.answers, strict=True):
        asked = max(i for i in range(answer) if words[i] == "what")
        assert link.mark == asked + 6 and words[link.mark] == "?"
        assert words[link.source - 3 : link.source] == ("of", words[asked + 5], "is")
        assert words[link.source] == words[answer] and link.source < asked
    facts = sum(1 for i, word in enumerate(words) if word == "is" and words[i - 2] == "of")
    assert len(targets.gathers) == facts + len(targets.answers)
    for query, key in targets.gathers:
        assert words[key] in needle.NAMES and words[query] in {"?", *needle.CODES}
        assert query - key == (1 if words[query] == "?" else 2)


def test_head_attention_loss_equals_the_eager_attention_of_head_0(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = model_config(_tiny(tmp_path))
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    batch = make_batch(Stage(128, 0.0, 0.2, 0.0, max_steps=1, min_steps=1, min_facts=3), 2,
                       random.Random(0))
    output = model.model(input_ids=batch.input_ids, output_hidden_states=True,
                         output_attentions=True)
    weights = output.attentions[0][:, 0]  # [B, T, T] query head 0 of layer 0
    cues = batch.positions - 1
    expected = -weights[batch.rows, cues, batch.sources].log().mean()
    loss = head_attention_loss(model, output.hidden_states, 0, batch.rows, cues, batch.sources)
    assert torch.allclose(loss, expected, atol=1e-5)


def test_answer_loss_starts_near_chance(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(_tiny(tmp_path)))
    batch = make_batch(Stage(64, 0.0, 0.0, 0.0, max_steps=1, min_steps=1, min_facts=2), 2,
                       random.Random(0))
    assert batch.rows.numel() > 0
    result = training_loss(model, batch)
    chance = torch.log(torch.tensor(len(needle.vocabulary()))).item()
    assert abs(result.total.item() - chance) < 1.0 and set(result.parts) == {"answer"}
    assert result.correct.shape == batch.rows.shape


def test_learning_rate_warms_up_and_decays_in_the_last_stage(tmp_path: Path) -> None:
    config = _tiny(tmp_path)
    assert learning_rate(config, 0, None) < learning_rate(config, 5, None) == config.lr
    assert learning_rate(config, 9, 1) < learning_rate(config, 9, 2) <= config.lr


def test_tiny_training_run_writes_a_checkpoint_the_runtime_loads(tmp_path: Path) -> None:
    config = _tiny(tmp_path)
    lines: list[str] = []
    train(config, lines.append)
    assert lines[-1].startswith("done steps 5")
    assert {p.name for p in config.out_dir.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"
    }
    assert json.loads((config.out_dir / "config.json").read_text())["rope_theta"] == 10000.0
    loaded = load(config.out_dir, "cpu", "float32")
    prompt = needle.build_prompt(128, 0.5, needle.Placement.END, seed=0)
    tokens = generate(loaded, loaded.require_tokenizer().encode(prompt.text), 2)
    assert len(tokens) == 2 and all(0 <= t < len(needle.vocabulary()) for t in tokens)
