"""`kvrelay convert`: a GGUF file -> an HF safetensors directory that both this runtime's
`load()` and transformers' `from_pretrained()` read (config.json in transformers' layout,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import processors

from services.model.config import ModelConfig, resolve_dtype
from services.model.gguf import GGUFContents, read_gguf
from services.model.gguf_metadata import MissingGGUFKey
from services.model.gguf_tensors import check_tensors, gguf_state_dict
from services.model.tokenizer import TextTokenizer

_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the HF directory of the GGUF at `path` into `out_dir` (created); returns it.
    Weights are the dequantized values, stored in `dtype` (float32 keeps them exact)."""
    contents = read_gguf(path)
    if contents.tokenizer is None:
        raise MissingGGUFKey("tokenizer.ggml.model", "needed to write tokenizer.json")
    check_tensors(contents)  # before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = resolve_dtype(dtype, "float32")
    _write_json(out / "config.json", hf_config(contents, dtype))
    _write_json(out / "generation_config.json", _generation_config(contents))
    save_file(_weights(contents, torch_dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _write_tokenizer(contents.tokenizer, out)
    return out


def hf_config(contents: GGUFContents, dtype: str) -> dict[str, Any]:
    """config.json as transformers writes it for this family (legacy `rope_theta` too)."""
    config, generation = contents.config, contents.generation_config
    rope: dict[str, Any] = {"rope_type": config.rope.rope_type, "rope_theta": config.rope.theta}
    if config.rope.rope_type == "linear":
        rope["factor"] = config.rope.factor
    return {
        "architectures": [_HF_ARCHITECTURES[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_q_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope.theta,
        "rope_parameters": rope,
        "attention_bias": False,  # qwen2 has q/k/v biases by architecture, not by flag
        "mlp_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": generation.bos_token_id,
        "eos_token_id": _eos(contents),
        "pad_token_id": generation.pad_token_id,
        "dtype": dtype,
    }


def _generation_config(contents: GGUFContents) -> dict[str, Any]:
    generation = contents.generation_config
    return {"bos_token_id": generation.bos_token_id, "eos_token_id": _eos(contents),
            "pad_token_id": generation.pad_token_id}


def _eos(contents: GGUFContents) -> int | list[int] | None:
    ids = list(contents.generation_config.eos_token_ids)
    return ids[0] if len(ids) == 1 else (ids or None)


def _weights(contents: GGUFContents, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors; a tied LM head is left out (transformers re-ties it on load)."""
    config: ModelConfig = contents.config
    return {
        name: tensor.to(dtype).contiguous()
        for name, tensor in gguf_state_dict(contents)
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }


def _write_tokenizer(tokenizer: TextTokenizer, out: Path) -> None:
    backend = tokenizer.backend
    bos = tokenizer.bos_token
    if tokenizer.add_bos and bos is not None:
        # A directory has no add_bos flag this runtime reads: BOS goes into the post-processor,
        # where transformers and `TextTokenizer.from_file` both apply it.
        backend = backend.from_str(backend.to_str())
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 $B:1",
            special_tokens=[(bos, backend.token_to_id(bos))],
        )
    backend.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": tokenizer.add_bos,
        "clean_up_tokenization_spaces": False,
        "chat_template": tokenizer.chat_template,
    })


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
