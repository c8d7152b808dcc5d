"""The demo training loop: batches supervise exactly the answers, and a few steps of a tiny
model produce a checkpoint that kvrelay's runtime loads."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from services.model import generate, load, needle
from services.model.train_demo import (
    Stage,
    TrainConfig,
    answer_loss,
    learning_rate,
    make_batch,
    model_config,
    train,
)


def _tiny(tmp_path: Path) -> TrainConfig:
    return TrainConfig(
        out_dir=tmp_path / "ckpt",
        layers=1, d_model=32, heads=4, kv_heads=2, intermediate=64,
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


def test_answer_loss_starts_near_chance(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config(_tiny(tmp_path)))
    batch = make_batch(Stage(64, 0.0, 0.0, 0.0, max_steps=1, min_steps=1), 2, random.Random(0))
    loss, correct = answer_loss(model, batch)
    assert abs(loss.item() - torch.log(torch.tensor(len(needle.vocabulary()))).item()) < 1.0
    assert correct.shape == batch.rows.shape


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
