"""The model runtime: load an HF-format Llama/Mistral/Qwen2/Qwen3 checkpoint directory or a
llama/qwen2 GGUF file (`load("model.gguf")`, dequantized to fp32 by default), prefill with
observation-window capture, decode over ragged packed KV views, sample.

    loaded = load("path/to/checkpoint", device="cpu", dtype="bfloat16")
    tokens = generate(loaded, prompt_ids, max_new_tokens=32)          # full cache, greedy

    result = prefill(loaded.model, prompt_ids, PrefillOptions(obs_window=32))
    cache = DecodeCache(loaded.config, loaded.dtype, loaded.device)
    cache.admit_view("req-1", view, frontier=result.prompt_length)    # or admit_dense(...)
    logits = decode_step(loaded.model, cache, [first_token])          # [B, V]
"""

from services.model.config import GenerationConfig, ModelConfig
from services.model.errors import (
    CheckpointMismatch,
    InvalidModelConfig,
    InvalidModelInput,
    MissingCheckpointFile,
    ModelError,
    UnsupportedArchitecture,
)
from services.model.gguf import UnsupportedGGUFArchitecture
from services.model.gguf_metadata import InvalidGGUFFile, MissingGGUFKey, TruncatedGGUFFile
from services.model.gguf_tensors import MissingGGUFTensor, UnsupportedTensorType
from services.model.gguf_tokenizer import GGUFTokenizerError
from services.model.kvcache import DecodeCache, StepCapture
from services.model.loader import CheckpointInfo, LoadedModel, load, read_checkpoint
from services.model.runtime import (
    LayerPrefill,
    ObservationVote,
    PrefillOptions,
    PrefillResult,
    PromptForward,
    decode_step,
    decode_tokens,
    forward_prompt,
    generate,
    observation_vote,
    prefill,
)
from services.model.sampler import SamplingParams, finish_reason, sample

__all__ = [
    "CheckpointInfo",
    "CheckpointMismatch",
    "DecodeCache",
    "GGUFTokenizerError",
    "GenerationConfig",
    "InvalidGGUFFile",
    "InvalidModelConfig",
    "InvalidModelInput",
    "LayerPrefill",
    "LoadedModel",
    "MissingCheckpointFile",
    "MissingGGUFKey",
    "MissingGGUFTensor",
    "ModelConfig",
    "ModelError",
    "PrefillOptions",
    "ObservationVote",
    "observation_vote",
    "PrefillResult",
    "PromptForward",
    "SamplingParams",
    "StepCapture",
    "TruncatedGGUFFile",
    "UnsupportedArchitecture",
    "UnsupportedGGUFArchitecture",
    "UnsupportedTensorType",
    "decode_step",
    "decode_tokens",
    "finish_reason",
    "forward_prompt",
    "generate",
    "load",
    "prefill",
    "read_checkpoint",
    "sample",
]
