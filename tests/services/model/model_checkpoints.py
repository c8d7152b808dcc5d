"""Tiny randomly initialized HF reference models of each supported family, saved with
`save_pretrained` so the runtime under test loads them exactly like a real checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> (config class, overrides). Windows and the RoPE context are smaller than the test
# prompts so sliding-window masking and Llama-3 frequency scaling are actually exercised.
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "llama3-rope": (LlamaConfig, {"rope_parameters": LLAMA3_ROPE}),
    "llama-mha": (LlamaConfig, {"num_key_value_heads": 4}),
    "mistral": (MistralConfig, {"sliding_window": 7}),
    "qwen2": (Qwen2Config, {}),
    "qwen3": (Qwen3Config, {"head_dim": 16}),
}


def tiny_config(family: str, **overrides: Any) -> Any:
    """A 2-layer, d_model 64, H_q 4, H_kv 2 config of `family` with fixed token ids."""
    config_class, family_overrides = FAMILIES[family]
    kwargs: dict[str, Any] = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **family_overrides,
        **overrides,
    }
    return config_class(**kwargs)


def save_reference(
    directory: Path, family: str, seed: int = 0, max_shard_size: str | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """Random-init the HF model, bump its norm weights off 1.0 (so a skipped norm shows up),
    save it into `directory` as safetensors and return it in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


def prompt(length: int, seed: int, vocab: int = 97) -> torch.Tensor:
    """Token ids `[length]` avoiding the EOS id 2 (so greedy runs are not cut short by it)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (length,), generator=generator)
    return ids
