"""Training of the bundled demo checkpoint (``kvrelay train-demo``).

A small GQA Llama-family model learns the needle language (:mod:`services.demo.needle`) on CPU.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from services.demo import needle


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
    min_facts: int = 8  # facts stated before a document's first question

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
    Stage(128, 0.0, 0.2, 0.0, max_steps=500, target_accuracy=0.9),
    Stage(256, 0.2, 0.6, 0.2, max_steps=300, target_accuracy=0.9, gap_max=64),
    Stage(512, 0.3, 0.9, 0.25, max_steps=300, target_accuracy=0.93),
    Stage(1024, 0.3, 0.95, 0.25, max_steps=200, target_accuracy=0.95),
    Stage(2048, 0.3, 0.95, 0.25, max_steps=150, min_steps=150),
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
    lr: float = 2e-3
    # Init std of the tied embedding: 0.15, not HF's 0.02, so that a token's identity is still
    # readable in the residual after the first layers (a copied code stayed unreadable at 0.02).
    embedding_std: float = 0.15
    lm_weight: float = 0.3  # weight of the next-token loss on non-answer tokens
    probe_weight: float = 1.0  # weight of the training-only name probe (0 disables it)
    probe_layer: int = 2  # the probe reads the residual stream after this many layers
    attention_weight: float = 1.0  # weight of the head-0 attention losses (0 disables them)
    attention_layer: int = 2  # 0-based layer whose head 0 is supervised to attend to the fact
    warmup_steps: int = 30
    final_decay_steps: int = 150  # cosine decay over the last steps of the last stage
    threads: int = 1
    eval_every: int = 100
    eval_prompts: int = 16
    work_dir: Path | None = None  # periodic snapshots; none when unset
    curriculum: tuple[Stage, ...] = field(default=DEFAULT_CURRICULUM)

    def __post_init__(self) -> None:
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 1 <= self.probe_layer <= self.layers:
            raise ValueError(f"probe_layer must be in [1, layers={self.layers}], got {self.probe_layer}")
        if self.attention_weight > 0 and not 2 <= self.attention_layer < self.layers:
            raise ValueError(
                f"attention_layer must be in [2, layers={self.layers}), got {self.attention_layer}"
            )
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
    sources: torch.Tensor  # [N] position of each answer's code inside its fact
    marks: torch.Tensor  # [N] position of the ``?`` of each answer's question
    gather_rows: torch.Tensor  # [G]
    gather_queries: torch.Tensor  # [G] fact codes and question marks
    gather_targets: torch.Tensor  # [G] the name each of them is about
    probe_rows: torch.Tensor  # [M]
    probe_positions: torch.Tensor  # [M]
    probe_names: torch.Tensor  # [M] index into needle.NAMES


def make_batch(stage: Stage, batch_size: int, rng: random.Random) -> Batch:
    """``batch_size`` documents of one stage with their answer and name-probe positions."""
    vocab = {word: index for index, word in enumerate(needle.vocabulary())}
    ids, rows, positions, sources, marks, probes, gathers = [], [], [], [], [], [], []
    for row in range(batch_size):
        mix = needle.DocumentMix(
            tokens=stage.tokens,
            filler_share=rng.uniform(stage.filler_min, stage.filler_max),
            before_filler_share=stage.before_filler_share,
            gap_min=min(16, stage.gap_max),
            gap_max=stage.gap_max,
            min_facts=stage.min_facts,
        )
        document = needle.build_training_sequence(mix, rng)
        ids.append([vocab[word] for word in document.words])
        rows += [row] * len(document.answer_positions)
        positions += document.answer_positions
        links = attention_targets(document)
        sources += [link.source for link in links.answers]
        marks += [link.mark for link in links.answers]
        gathers += [(row, query, target) for query, target in links.gathers]
        probes += [(row, at, name) for at, name in name_probe_targets(document)]
    probe_rows, probe_positions, probe_names = zip(*probes, strict=True) if probes else ((), (), ())
    gather_rows, gather_queries, gather_targets = zip(*gathers, strict=True) if gathers else ((), (), ())
    return Batch(
        torch.tensor(ids), _longs(rows), _longs(positions), _longs(sources), _longs(marks),
        _longs(gather_rows), _longs(gather_queries), _longs(gather_targets),
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


def _longs(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


@dataclass(frozen=True)
class AnswerLink:
    """Where the circuit that answers one question reads: the ``?`` closing the question (which
    holds the asked name) and the code inside the asked fact."""

    mark: int
    source: int


@dataclass(frozen=True)
class AttentionTargets:
    """Supervised attention of one document: ``gathers`` are (query, key) pairs from each fact
    code and each ``?`` to the name token it is about; ``answers`` align with the answers."""

    gathers: tuple[tuple[int, int], ...]
    answers: tuple[AnswerLink, ...]


def attention_targets(document: needle.TrainingSequence) -> AttentionTargets:
    """The three hops of needle retrieval, as positions: a fact's code and a question's ``?``
    look at their name (layer 0), the answer cue ``:`` looks at its question's ``?`` (layer
    1), and the cue looks at the asked fact's code (``attention_layer``)."""
    words, fact_code, gathers = document.words, {}, []
    for at, word in enumerate(words):
        if word in _CODES and words[at - 1] == "is":
            fact_code[words[at - 2]] = at
            gathers.append((at, at - 2))
        elif word == "?":
            gathers.append((at, at - 1))
    answers, mark = [], None
    positions = set(document.answer_positions)
    for at, word in enumerate(words):
        if word == "?":
            mark = at
        elif at in positions:
            assert mark is not None
            answers.append(AnswerLink(mark, fact_code[words[mark - 1]]))
    return AttentionTargets(tuple(gathers), tuple(answers))


def head_attention_loss(
    model: LlamaForCausalLM,
    hidden_states: tuple[torch.Tensor, ...],
    layer: int,
    rows: torch.Tensor,
    queries: torch.Tensor,
    targets: torch.Tensor,
) -> torch.Tensor:
    """Cross-entropy of query head 0 of ``layer`` attending from ``queries`` to ``targets``
    (all ``[Q]``, with the batch ``rows`` they are in). A training-only signal: the heads of
    a retrieval circuit get no useful gradient until the other heads already work, which is
    the long plateau small models sit on; supervising where each hop looks breaks that
    symmetry. Only the Q query rows are scored: O(Q T), never O(T^2)."""
    block = model.model.layers[layer]
    attention = block.self_attn
    hidden = block.input_layernorm(hidden_states[layer])  # [B, T, D]
    head_dim = attention.head_dim
    query = attention.q_proj(hidden[rows, queries])[:, :head_dim]  # [Q, d_h] head 0
    keys = attention.k_proj(hidden)[..., :head_dim]  # [B, T, d_h] K/V head 0
    positions = torch.arange(hidden.shape[1]).unsqueeze(0)  # [1, T]
    cos, sin = model.model.rotary_emb(hidden, positions)  # [1, T, d_h]
    keys = keys * cos + _rotate_half(keys) * sin
    query = query * cos[0, queries] + _rotate_half(query) * sin[0, queries]
    logits = torch.einsum("qd,qtd->qt", query, keys[rows]) * attention.scaling  # [Q, T]
    logits = logits.masked_fill(positions > queries.unsqueeze(1), float("-inf"))
    return F.cross_entropy(logits, targets)


def copy_loss(
    model: LlamaForCausalLM, hidden_states: tuple[torch.Tensor, ...], batch: Batch, layer: int
) -> torch.Tensor:
    """Cross-entropy of the answer read from what head 0 of ``layer`` writes when it attends to
    the asked fact's code (value at the source, through the head's slice of the output
    projection, the final norm and the tied unembedding). It trains the head's value/output
    path to copy the code; without it the code's identity, a small part of a residual
    dominated by name features, stayed unreadable long after the attention was right."""
    block = model.model.layers[layer]
    attention = block.self_attn
    head_dim = attention.head_dim
    source = block.input_layernorm(hidden_states[layer][batch.rows, batch.sources])  # [N, D]
    value = attention.v_proj(source)[:, :head_dim]  # [N, d_h] K/V head 0
    written = value @ attention.o_proj.weight[:, :head_dim].T  # [N, D] query head 0's slice
    logits = model.lm_head(model.model.norm(written))  # [N, V]
    return F.cross_entropy(logits, batch.input_ids[batch.rows, batch.positions])


def attention_loss(
    model: LlamaForCausalLM, hidden_states: tuple[torch.Tensor, ...], batch: Batch, layer: int
) -> torch.Tensor:
    """Mean of the three supervised hops (see :func:`attention_targets`)."""
    cues = batch.positions - 1
    hops = [
        head_attention_loss(model, hidden_states, 1, batch.rows, cues, batch.marks),
        head_attention_loss(model, hidden_states, layer, batch.rows, cues, batch.sources),
    ]
    if batch.gather_rows.numel():
        hops.append(head_attention_loss(
            model, hidden_states, 0, batch.gather_rows, batch.gather_queries, batch.gather_targets
        ))
    return torch.stack(hops).mean()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


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


@dataclass(frozen=True)
class StepLoss:
    """The training objective of one batch, its parts (for the log) and per-answer hits."""

    total: torch.Tensor
    parts: dict[str, float]
    correct: torch.Tensor  # [N] bool


def training_loss(
    model: LlamaForCausalLM,
    batch: Batch,
    lm_weight: float = 0.0,
    probe: NameProbe | None = None,
    probe_weight: float = 0.0,
    attention_weight: float = 0.0,
    attention_layer: int = 0,
) -> StepLoss:
    """Mean cross-entropy on answer tokens, plus ``lm_weight`` times the mean next-token
    cross-entropy on every other token, plus ``probe_weight`` times the name-probe loss, plus
    ``attention_weight`` times the retrieval-head attention loss."""
    supervise_attention = attention_weight > 0 and batch.rows.numel() > 0
    output = model.model(
        input_ids=batch.input_ids, output_hidden_states=probe is not None or supervise_attention
    )
    logits = model.lm_head(output.last_hidden_state[:, :-1])  # [B, T-1, V]; t predicts t+1
    targets = batch.input_ids[:, 1:]  # [B, T-1]
    token_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    token_loss = token_loss.view_as(targets)  # [B, T-1]
    is_answer = torch.zeros_like(targets, dtype=torch.bool)
    is_answer[batch.rows, batch.positions - 1] = True
    terms = {"answer": (1.0, token_loss[is_answer].mean())}
    if lm_weight > 0:
        terms["lm"] = (lm_weight, token_loss[~is_answer].mean())
    if probe is not None and probe_weight > 0 and batch.probe_rows.numel():
        terms["probe"] = (probe_weight, probe(output.hidden_states, batch))
    if supervise_attention:
        terms["attention"] = (
            attention_weight,
            attention_loss(model, output.hidden_states, batch, attention_layer),
        )
        terms["copy"] = (
            attention_weight, copy_loss(model, output.hidden_states, batch, attention_layer)
        )
    total = sum((weight * term for weight, term in terms.values()), torch.zeros(()))
    predicted = logits[batch.rows, batch.positions - 1].argmax(-1)
    return StepLoss(
        total,
        {name: term.item() for name, (_, term) in terms.items()},
        predicted == targets[batch.rows, batch.positions - 1],
    )


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
    nn.init.normal_(model.model.embed_tokens.weight, std=config.embedding_std)
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
        result = training_loss(
            model, batch, config.lm_weight, probe, config.probe_weight,
            config.attention_weight, config.attention_layer,
        )
        optimizer.zero_grad(set_to_none=True)
        result.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        accuracy, step = running.update(result.correct), step + 1
        if step % 10 == 0:
            parts = " ".join(f"{name} {value:.3f}" for name, value in result.parts.items())
            log(f"step {step} len {stage.tokens} loss {result.total.item():.4f} ({parts}) "
                f"acc {accuracy:.3f} wall_s {time.monotonic() - started:.0f}")
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
