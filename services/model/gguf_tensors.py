"""GGUF tensors -> the runtime's HF-named fp32 state dict.

Three things differ from an HF checkpoint: names (llama.cpp's `blk.N.attn_q.weight`), layout
(quantized blocks, dequantized here with `gguf.quants`; GGUF lists dims in ggml `ne` order,
fastest first, which the reader already reverses into numpy order `[out, in]`), and the Q/K rows
of llama, which convert_hf_to_gguf permutes per head so llama.cpp's interleaved (GPT-J) RoPE sees
the pairs HF's half-split (NeoX) RoPE rotates; `unpermute_rope_rows` inverts that exactly.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, ReaderTensor
from gguf.quants import dequantize

from services.model.config import ModelConfig
from services.model.errors import CheckpointMismatch
from services.model.gguf import GGUFContents

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class UnsupportedTensorType(CheckpointMismatch):
    """A GGUF tensor is stored in a ggml type this runtime cannot dequantize."""

    def __init__(self, tensor: str, tensor_type: str) -> None:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        super().__init__(tensor, f"ggml type {tensor_type} is not supported ({supported})")
        self.tensor_type = tensor_type


class MissingGGUFTensor(CheckpointMismatch):
    """A tensor the architecture needs is absent from the GGUF file."""

    def __init__(self, tensor: str, missing: int) -> None:
        super().__init__(tensor, f"missing from the GGUF file ({missing} missing)")


def hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: not mapped)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    module = _LAYER_NAMES.get(parts[2])
    if module is None or parts[3] not in ("weight", "bias"):
        return None
    return f"model.layers.{parts[1]}.{module}.{parts[3]}"


def required_tensors(config: ModelConfig) -> list[str]:
    """llama.cpp names of every tensor the model needs (`output.weight` only when untied)."""
    names = ["token_embd.weight", "output_norm.weight"]
    if not config.tie_word_embeddings:
        names.append("output.weight")
    biases = ("attn_q", "attn_k", "attn_v") if config.qkv_bias else ()
    for layer in range(config.num_layers):
        names += [f"blk.{layer}.{module}.weight" for module in _LAYER_NAMES]
        names += [f"blk.{layer}.{module}.bias" for module in biases]
    return names


def check_tensors(contents: GGUFContents) -> None:
    """Fail before dequantizing anything: every needed tensor present, every type supported."""
    missing = [n for n in required_tensors(contents.config) if n not in contents.tensors]
    if missing:
        raise MissingGGUFTensor(missing[0], len(missing))
    for name, tensor in contents.tensors.items():
        if hf_name(name) is None:
            raise CheckpointMismatch(name, "is not a tensor of a llama-family GGUF")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedTensorType(name, tensor.tensor_type.name)


def gguf_state_dict(contents: GGUFContents) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor of the file, Q/K rows restored to HF order."""
    check_tensors(contents)
    config = contents.config
    permuted = {"attn_q": config.num_q_heads, "attn_k": config.num_kv_heads}
    for name, tensor in contents.tensors.items():
        values = dequantize_tensor(tensor)
        module = name.split(".")[2] if name.startswith("blk.") else ""
        if contents.architecture == "llama" and module in permuted:
            values = unpermute_rope_rows(values, permuted[module])
        yield str(hf_name(name)), torch.from_numpy(values)


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """fp32 values of one tensor in numpy order (`[out, in]` for a matrix), writable."""
    if tensor.tensor_type not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(tensor.name, tensor.tensor_type.name)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    except ValueError as error:  # a data section shorter than the header promises
        reason = f"data does not hold shape {shape}: {error}"
        raise CheckpointMismatch(tensor.name, reason) from error
    if values.dtype != np.float32 or not values.flags.writeable:
        values = values.astype(np.float32)  # F32 comes back as a read-only view of the map
    return values


def unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's per-head row permutation of q_proj / k_proj.

    HF row (h, i, j) with i in {0, 1} (rotary half) and j < d_h/2 was written to GGUF row
    (h, j, i); reading `[H, d_h/2, 2, ...]` and swapping the middle axes restores (h, i, j).
    """
    rows = weights.shape[0]
    if rows % (2 * num_heads):
        reason = f"{rows} rows do not split into {num_heads} heads"
        raise CheckpointMismatch("attn_q/attn_k", reason)
    half = rows // num_heads // 2
    split = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2)).reshape(weights.shape)
