"""Load a checkpoint: a local HF-format directory (config.json, model.safetensors or the shards
listed in model.safetensors.index.json, tokenizer.json, generation_config.json) or a llama.cpp
`.gguf` file (`services.model.gguf`). `read_checkpoint` reads what either kind says without
touching the weights (what the gateway and the launcher need)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.kvpolicy.manifest import TensorContract
from services.model.config import (
    GenerationConfig,
    ModelConfig,
    make_tensor_contract,
    parse_generation_config,
    parse_model_config,
    resolve_dtype,
)
from services.model.errors import (
    CheckpointMismatch,
    InvalidModelConfig,
    MissingCheckpointFile,
)
from services.model.gguf import is_gguf_file, read_gguf
from services.model.gguf_metadata import MissingGGUFKey
from services.model.gguf_tensors import check_tensors, gguf_state_dict
from services.model.model import CausalLM
from services.model.tokenizer import TOKENIZER_FILE, TextTokenizer

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that this runtime recomputes instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedModel:
    """Everything a worker needs from one checkpoint. `tokenizer` is None when the directory
    has no tokenizer.json (e.g. a weights-only test checkpoint); see `require_tokenizer`."""

    model: CausalLM
    tokenizer: TextTokenizer | None
    config: ModelConfig
    generation_config: GenerationConfig
    tensor_contract: TensorContract
    path: Path

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    def require_tokenizer(self) -> TextTokenizer:
        """The tokenizer, or a typed error naming tokenizer.json / `tokenizer.ggml.model`."""
        return require_tokenizer(self.tokenizer, self.path)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about itself, read without its weights."""

    config: ModelConfig
    generation_config: GenerationConfig
    tokenizer: TextTokenizer | None
    path: Path

    def require_tokenizer(self) -> TextTokenizer:
        """The tokenizer, or a typed error naming tokenizer.json / `tokenizer.ggml.model`."""
        return require_tokenizer(self.tokenizer, self.path)


def read_checkpoint(path: str | Path) -> CheckpointInfo:
    """Config, generation config and tokenizer of an HF directory or a `.gguf` file.

    Raises the same typed errors as `load` for everything but the weights (a GGUF's tensor
    index is checked too: missing tensors and unsupported types fail here, not in a worker)."""
    root = Path(path)
    if is_gguf_file(root):
        contents = read_gguf(root)
        check_tensors(contents)
        return CheckpointInfo(
            contents.config, contents.generation_config, contents.tokenizer, root
        )
    raw_config = _read_json(root / CONFIG_FILE, required=True)
    return CheckpointInfo(
        config=parse_model_config(raw_config),
        generation_config=parse_generation_config(
            _read_json(root / GENERATION_CONFIG_FILE, required=False), raw_config
        ),
        tokenizer=_directory_tokenizer(root),
        path=root,
    )


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
) -> LoadedModel:
    """Load a Llama/Mistral/Qwen2/Qwen3 checkpoint directory, or a llama/qwen2 `.gguf` file,
    onto `device`.

    dtype: torch dtype or 'float32'/'bfloat16'/'float16' (aliases fp32/bf16/fp16); None keeps
    the checkpoint's dtype (float32 for a GGUF: quantized weights dequantize to fp32). Raises
    MissingCheckpointFile, UnsupportedArchitecture, InvalidModelConfig or CheckpointMismatch
    (GGUF: their subclasses in services.model.gguf*), each naming the culprit.
    """
    root = Path(path)
    if is_gguf_file(root):
        contents = read_gguf(root)
        info = CheckpointInfo(contents.config, contents.generation_config, contents.tokenizer, root)
        tensors = gguf_state_dict(contents)
    else:
        info = read_checkpoint(root)
        tensors = _read_weights(root)
    torch_dtype = resolve_dtype(dtype, info.config.checkpoint_dtype)
    return LoadedModel(
        model=build_model(info.config, tensors, torch.device(device), torch_dtype),
        tokenizer=info.tokenizer,
        config=info.config,
        generation_config=info.generation_config,
        tensor_contract=make_tensor_contract(info.config, torch_dtype),
        path=root,
    )


def require_tokenizer(tokenizer: TextTokenizer | None, path: Path) -> TextTokenizer:
    """`tokenizer`, or the typed error saying where the checkpoint at `path` lacks one."""
    if tokenizer is not None:
        return tokenizer
    if is_gguf_file(path):
        raise MissingGGUFKey("tokenizer.ggml.model", "needed to encode text")
    raise MissingCheckpointFile(path / TOKENIZER_FILE, "needed to encode text")


def build_model(
    config: ModelConfig,
    tensors: Iterator[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype,
) -> CausalLM:
    """Instantiate without initializing (meta device) and assign the checkpoint's tensors."""
    with torch.device("meta"):
        model = CausalLM(config)
    expected = {name: param.shape for name, param in model.state_dict().items()}
    state = {}
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name not in expected:
            raise CheckpointMismatch(name, f"not part of a {config.family} model with this config")
        if tensor.shape != expected[name]:
            raise CheckpointMismatch(name, f"shape {tuple(tensor.shape)}, expected {tuple(expected[name])}")
        state[name] = tensor.to(device=device, dtype=dtype)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight", torch.empty(0))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointMismatch(missing[0], f"missing from the checkpoint ({len(missing)} missing)")
    model.load_state_dict(state, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)


def _directory_tokenizer(root: Path) -> TextTokenizer | None:
    tokenizer_path = root / TOKENIZER_FILE
    return TextTokenizer.from_file(tokenizer_path) if tokenizer_path.is_file() else None


def _read_weights(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in _weight_files(root):
        with safe_open(str(shard), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def _weight_files(root: Path) -> list[Path]:
    index_path = root / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidModelConfig(f"{WEIGHTS_INDEX_FILE}:weight_map", "missing or empty")
        shards = [root / name for name in sorted(set(weight_map.values()))]
    else:
        shards = [root / WEIGHTS_FILE]
    for shard in shards:
        if not shard.is_file():
            raise MissingCheckpointFile(shard, "safetensors weights are required")
    return shards


def _read_json(path: Path, required: bool) -> Mapping[str, Any]:
    if not path.is_file():
        if required:
            raise MissingCheckpointFile(path)
        return {}
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise InvalidModelConfig(path.name, f"is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise InvalidModelConfig(path.name, "must hold a JSON object")
    return value
