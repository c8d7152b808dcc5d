"""Training of the bundled demo checkpoint (``kvrelay train-demo``).

A small GQA Llama-family model learns the needle language (:mod:`services.model.needle`) on CPU.
Retrieval barely emerges from long sparse documents, so training uses dense supervision (many
questions per document, loss on every answer token and nothing else) and a curriculum: facts
packed back to back in short documents first, then more filler and longer documents, up to 2K
tokens. A stage ends when the running answer accuracy reaches its target (or after its step
cap), so the schedule is deterministic for a given seed and thread count.

The result is written in Hugging Face format (``config.json``, ``model.safetensors``,
``generation_config.json``) together with the needle ``tokenizer.json``.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from services.model import needle

DEMO_CHECKPOINT = Path(__file__).resolve().parent / "demo_checkpoint"


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: document length, filler range and placement-(b) share."""

    tokens: int
    filler_min: float
    filler_max: float
    before_filler_share: float
    max_steps: int
    min_steps: int = 50
    target_accuracy: float = 0.95  # running answer accuracy that ends the stage early
    gap_max: int = 128

    def __post_init__(self) -> None:
        if not 0.0 <= self.filler_min <= self.filler_max < 1.0:
            raise ValueError(
                f"filler_min/filler_max must satisfy 0 <= min <= max < 1, "
                f"got {self.filler_min}/{self.filler_max}"
            )
        if not 0 < self.min_steps <= self.max_steps:
            raise ValueError(f"min_steps/max_steps must satisfy 0 < min <= max, got "
                             f"{self.min_steps}/{self.max_steps}")


DEFAULT_CURRICULUM: tuple[Stage, ...] = (
    Stage(128, 0.0, 0.2, 0.0, max_steps=800, target_accuracy=0.9),
    Stage(256, 0.2, 0.6, 0.15, max_steps=500, target_accuracy=0.9, gap_max=64),
    Stage(512, 0.3, 0.9, 0.25, max_steps=500, target_accuracy=0.93),
    Stage(1024, 0.3, 0.95, 0.25, max_steps=400, target_accuracy=0.95),
    Stage(2048, 0.3, 0.95, 0.25, max_steps=500, min_steps=500),
)


@dataclass(frozen=True)
class TrainConfig:
    """Model shape, optimizer and schedule of one ``train-demo`` run."""

    out_dir: Path
    seed: int = 0
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64  # wider than d_model / heads: see model_config
    intermediate: int = 384
    tokens_per_step: int = 4096
    lr: float = 1e-3
    lm_weight: float = 0.3  # weight of the next-token loss on non-answer tokens
    probe_weight: float = 0.0  # weight of the training-only name probe (0 disables it)
    probe_layer: int = 2  # the probe reads the residual stream after this many layers
    warmup_steps: int = 100
    final_decay_steps: int = 300  # cosine decay over the last steps of the last stage
    threads: int = 1
    eval_every: int = 100
    eval_prompts: int = 16
    work_dir: Path | None = None  # periodic snapshots; none when unset
    curriculum: tuple[Stage, ...] = field(default=DEFAULT_CURRICULUM)

    def __post_init__(self) -> None:
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads must be divisible by kv_heads, got {self.heads}/{self.kv_heads}")
        if not self.curriculum:
            raise ValueError("curriculum must have at least one stage")
        if any(self.tokens_per_step < stage.tokens for stage in self.curriculum):
            raise ValueError("tokens_per_step must be >= every stage's document length")


def model_config(config: TrainConfig) -> LlamaConfig:
    """The Llama config of the demo model (GQA, RoPE theta 10000, 32K positions, tied).

    Heads are 64 wide even though d_model / heads is 32: name matching across long distances
    lives in the slowly rotating RoPE dimensions, and with 32-wide heads a small model stayed on
    the "copy the most recent code" plateau for thousands of steps; 64-wide heads learned
    associative recall in a few hundred.
    """
    return LlamaConfig(
        vocab_size=len(needle.vocabulary()),
        hidden_size=config.d_model,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=32768,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )


@dataclass(frozen=True)
class Batch:
    """Token ids and the (row, position) of every answer token."""

    input_ids: torch.Tensor  # [B, T]
    rows: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    probe_rows: torch.Tensor  # [M]
    probe_positions: torch.Tensor  # [M]
    probe_names: torch.Tensor  # [M] index into needle.NAMES


def make_batch(stage: Stage, batch_size: int, rng: random.Random) -> Batch:
    """``batch_size`` documents of one stage with their answer and name-probe positions."""
    vocab = {word: index for index, word in enumerate(needle.vocabulary())}
    ids, rows, positions, probes = [], [], [], []
    for row in range(batch_size):
        mix = needle.DocumentMix(
            tokens=stage.tokens,
            filler_share=rng.uniform(stage.filler_min, stage.filler_max),
            before_filler_share=stage.before_filler_share,
            gap_min=min(16, stage.gap_max),
            gap_max=stage.gap_max,
        )
        document = needle.build_training_sequence(mix, rng)
        ids.append([vocab[word] for word in document.words])
        rows += [row] * len(document.answer_positions)
        positions += document.answer_positions
        probes += [(row, at, name) for at, name in name_probe_targets(document)]
    probe_rows, probe_positions, probe_names = zip(*probes, strict=True) if probes else ((), (), ())
    return Batch(
        torch.tensor(ids), torch.tensor(rows), torch.tensor(positions),
        torch.tensor(probe_rows, dtype=torch.long), torch.tensor(probe_positions, dtype=torch.long),
        torch.tensor(probe_names, dtype=torch.long),
    )


_NAME_INDEX = {name: index for index, name in enumerate(needle.NAMES)}
_CODES = frozenset(needle.CODES)


def name_probe_targets(document: needle.TrainingSequence) -> list[tuple[int, int]]:
    """(position, name index) pairs the name probe reads: every fact's code token (its name)
    and every answer cue ``:`` (the name its question asked about)."""
    words, cues = document.words, {position - 1 for position in document.answer_positions}
    targets, asked = [], None
    for at, word in enumerate(words):
        if word == "?":
            asked = words[at - 1]
        if word in _CODES and words[at - 1] == "is":
            targets.append((at, _NAME_INDEX[words[at - 2]]))
        elif at in cues and asked is not None:
            targets.append((at, _NAME_INDEX[asked]))
    return targets


class NameProbe(nn.Module):
    """Training-only linear read-out of a name from the residual stream after ``layer`` decoder
    layers (never saved). Supervising it at fact codes and answer cues gives the first layers
    a direct signal to gather "which name is this about", the feature that retrieval matches on;
    without it a small RoPE model sat for thousands of steps copying the most recent code."""

    def __init__(self, d_model: int, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.proj = nn.Linear(d_model, len(needle.NAMES))

    def forward(self, hidden_states: tuple[torch.Tensor, ...], batch: Batch) -> torch.Tensor:
        """Mean cross-entropy of the probe's name prediction."""
        hidden = hidden_states[self.layer][batch.probe_rows, batch.probe_positions]  # [M, D]
        return F.cross_entropy(self.proj(F.rms_norm(hidden, hidden.shape[-1:])), batch.probe_names)


def answer_loss(
    model: LlamaForCausalLM,
    batch: Batch,
    lm_weight: float = 0.0,
    probe: NameProbe | None = None,
    probe_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy on answer tokens, plus ``lm_weight`` times the mean next-token
    cross-entropy on every other token, plus ``probe_weight`` times the name-probe loss; and
    the per-answer correctness of the argmax."""
    output = model.model(input_ids=batch.input_ids, output_hidden_states=probe is not None)
    logits = model.lm_head(output.last_hidden_state[:, :-1])  # [B, T-1, V]; t predicts t+1
    targets = batch.input_ids[:, 1:]  # [B, T-1]
    token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    token_loss = token_loss.view_as(targets)  # [B, T-1]
    is_answer = torch.zeros_like(targets, dtype=torch.bool)
    is_answer[batch.rows, batch.positions - 1] = True
    loss = token_loss[is_answer].mean()
    if lm_weight > 0:
        loss = loss + lm_weight * token_loss[~is_answer].mean()
    if probe is not None and probe_weight > 0 and batch.probe_rows.numel():
        loss = loss + probe_weight * probe(output.hidden_states, batch)
    predicted = logits[batch.rows, batch.positions - 1].argmax(-1)
    return loss, predicted == targets[batch.rows, batch.positions - 1]


@torch.no_grad()
def quick_accuracy(
    model: LlamaForCausalLM, context_tokens: int, placement: needle.Placement, prompts: int
) -> float:
    """Full-cache next-token accuracy on held-out prompts (seeds outside the training stream)."""
    tokenizer = needle.build_tokenizer()
    cases = [
        needle.build_prompt(context_tokens, (i + 0.5) / prompts, placement, seed=1_000_000 + i)
        for i in range(prompts)
    ]
    ids = torch.tensor([tokenizer.encode(case.text).ids for case in cases])  # [P, T]
    hits = 0
    for start in range(0, len(cases), 8):
        logits = model(input_ids=ids[start : start + 8], logits_to_keep=1).logits[:, -1]  # [b, V]
        for token, case in zip(logits.argmax(-1).tolist(), cases[start : start + 8], strict=True):
            hits += tokenizer.id_to_token(token) == case.answer
    return hits / len(cases)


def learning_rate(config: TrainConfig, step: int, steps_left: int | None) -> float:
    """Linear warmup, constant, then cosine decay over the last stage's final steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if steps_left is None or steps_left >= config.final_decay_steps:
        return config.lr
    progress = 1.0 - steps_left / config.final_decay_steps
    return config.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def save_checkpoint(model: LlamaForCausalLM, out_dir: Path) -> None:
    """Write the model, its generation config and the needle tokenizer in HF layout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _add_legacy_rope_theta(out_dir / "config.json")
    GenerationConfig(
        bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False, max_new_tokens=4
    ).save_pretrained(out_dir)
    needle.build_tokenizer().save(str(out_dir / "tokenizer.json"))


def _add_legacy_rope_theta(path: Path) -> None:
    """Also write ``rope_theta`` at the top level, where loaders predating
    ``rope_parameters`` (transformers < 5) look for it."""
    config = json.loads(path.read_text())
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


Log = Callable[[str], None]


def tee_log(path: Path | None) -> Log:
    """A logger that prints each line and, when ``path`` is set, appends it there (flushed)."""

    def log(line: str) -> None:
        print(line, flush=True)
        if path is not None:
            with path.open("a") as handle:
                handle.write(line + "\n")

    return log


class _RunningAccuracy:
    """Exponential moving average of the in-batch answer accuracy."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay, self.value = decay, 0.0

    def update(self, correct: torch.Tensor) -> float:
        self.value = self.decay * self.value + (1 - self.decay) * correct.float().mean().item()
        return self.value


def train(config: TrainConfig, log: Log = print) -> LlamaForCausalLM:
    """Run the whole curriculum and write the checkpoint to ``config.out_dir``."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    model = LlamaForCausalLM(model_config(config))
    probe = NameProbe(config.d_model, config.probe_layer)
    optimizer = torch.optim.AdamW(
        [*model.parameters(), *probe.parameters()], lr=config.lr, betas=(0.9, 0.98),
        weight_decay=0.01,
    )
    log(f"config {json.dumps(_describe(config))}")
    log(f"parameters {sum(p.numel() for p in model.parameters())}")
    started, step = time.monotonic(), 0
    for index, stage in enumerate(config.curriculum):
        last = index == len(config.curriculum) - 1
        step = _run_stage(config, model, probe, optimizer, stage, last, step, rng, started, log)
    save_checkpoint(model, config.out_dir)
    log(f"done steps {step} wall_s {time.monotonic() - started:.0f} out {config.out_dir}")
    return model


def _run_stage(
    config: TrainConfig,
    model: LlamaForCausalLM,
    probe: NameProbe,
    optimizer: torch.optim.Optimizer,
    stage: Stage,
    last: bool,
    step: int,
    rng: random.Random,
    started: float,
    log: Log,
) -> int:
    """Train one stage; return the global step count after it."""
    running = _RunningAccuracy()
    batch_size = config.tokens_per_step // stage.tokens
    log(f"stage tokens {stage.tokens} filler {stage.filler_min}-{stage.filler_max} "
        f"before_filler {stage.before_filler_share} batch {batch_size}")
    model.train()
    for stage_step in range(stage.max_steps):
        steps_left = stage.max_steps - stage_step if last else None
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, steps_left)
        batch = make_batch(stage, batch_size, rng)
        loss, correct = answer_loss(model, batch, config.lm_weight, probe, config.probe_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        accuracy, step = running.update(correct), step + 1
        if step % 10 == 0:
            log(f"step {step} len {stage.tokens} loss {loss.item():.4f} acc {accuracy:.3f} "
                f"wall_s {time.monotonic() - started:.0f}")
        if step % config.eval_every == 0:
            _evaluate_and_snapshot(config, model, step, log)
        if not last and stage_step + 1 >= stage.min_steps and accuracy >= stage.target_accuracy:
            break
    return step


def _evaluate_and_snapshot(
    config: TrainConfig, model: LlamaForCausalLM, step: int, log: Log
) -> None:
    model.eval()
    results = [
        f"{placement.value}@{tokens} {quick_accuracy(model, tokens, placement, config.eval_prompts):.3f}"
        for placement in needle.Placement
        for tokens in (512, 1024, 2048)
    ]
    log(f"eval step {step} " + " ".join(results))
    if config.work_dir is not None:
        save_checkpoint(model, config.work_dir / "latest")
    model.train()


def _describe(config: TrainConfig) -> dict[str, object]:
    return {
        key: (str(value) if isinstance(value, Path) else value)
        for key, value in vars(config).items()
        if key != "curriculum"
    } | {"curriculum": [vars(stage) for stage in config.curriculum]}
