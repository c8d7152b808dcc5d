"""The checkpoints every engine loads: a checkpoint directory as it is, a GGUF file converted
once into an HF directory in the bench's scratch directory, or a random-init Llama written
once with transformers' `save_pretrained` (safetensors), so kvrelay's loader and transformers
(and through it kvpress) read the very same weights; and what the plan needs to know about
each before any engine loads it.

A GGUF is converted by `services.model.gguf_convert` (what `kvrelay convert` runs) in float32:
the stored values are exactly the dequantized tensors kvrelay's own GGUF loader builds, so
every engine, kvrelay included, loads that one directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.benchmark.config import LlamaShape, ModelSpec
from services.benchmark.memory import ModelDims
from services.model.config import parse_model_config
from services.model.gguf import is_gguf_file


def checkpoint_path(spec: ModelSpec, scratch: Path) -> Path:
    """Where `spec`'s HF files are: the checkpoint directory itself, or a directory in
    `scratch` (a random model's is written there by the transformers process before anything
    is measured, a GGUF's by `prepare`)."""
    if spec.checkpoint is not None and not is_gguf_file(spec.checkpoint):
        return spec.checkpoint
    return scratch / f"model-{spec.name}"


def prepare(spec: ModelSpec, scratch: Path) -> Path:
    """`checkpoint_path(spec, scratch)`, after converting a GGUF checkpoint there (float32)."""
    path = checkpoint_path(spec, scratch)
    if spec.checkpoint is not None and is_gguf_file(spec.checkpoint) and not path.exists():
        from services.model.gguf_convert import convert_gguf

        convert_gguf(spec.checkpoint, path, "float32")
    return path


def save_random_llama(shape: LlamaShape, target: Path, max_positions: int, seed: int) -> None:
    """A randomly initialized LlamaForCausalLM, float32, no special tokens (nothing stops)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.num_q_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).eval().save_pretrained(target)


@dataclass(frozen=True)
class CheckpointInfo:
    """What planning needs from a checkpoint before any engine loads it."""

    dims: ModelDims
    max_positions: int
    vocab_size: int


def describe(spec: ModelSpec, path: Path, max_positions: int) -> CheckpointInfo:
    """Sizes for the memory estimate (float32 weights, the bench's dtype), the position
    limit and the vocabulary: from config.json and the weight files at `path` (a prepared
    checkpoint), from the shape of a random model (whose max_position_embeddings is
    `max_positions`)."""
    if spec.shape is not None:
        shape = spec.shape
        dims = ModelDims(
            num_layers=shape.layers,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_q_heads=shape.num_q_heads,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            weight_bytes=4 * llama_parameter_count(shape),
        )
        return CheckpointInfo(dims, max_positions, shape.vocab_size)
    config = parse_model_config(json.loads((path / "config.json").read_text()))
    dims = ModelDims(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        weight_bytes=4 * _parameter_count(path),
    )
    return CheckpointInfo(dims, config.max_position_embeddings, config.vocab_size)


def llama_parameter_count(shape: LlamaShape) -> int:
    """Parameters of an untied Llama: embedding, per layer q/k/v/o, gated MLP and two
    norms, the final norm and the LM head."""
    d, q, kv = (
        shape.hidden_size,
        shape.num_q_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    layer = d * q + 2 * d * kv + q * d + 3 * d * shape.intermediate_size + 2 * d
    return 2 * shape.vocab_size * d + shape.layers * layer + d


def _parameter_count(checkpoint: Path) -> int:
    from safetensors import safe_open

    count = 0
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                count += _numel(handle.get_slice(name).get_shape())
    return count


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
