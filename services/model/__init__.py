"""The model runtime: load an HF-format Llama/Mistral/Qwen2/Qwen3 checkpoint, prefill with
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
from services.model.kvcache import DecodeCache, StepCapture
from services.model.loader import LoadedModel, load
from services.model.runtime import (
    LayerPrefill,
    PrefillOptions,
    PrefillResult,
    decode_step,
    decode_tokens,
    generate,
    prefill,
)
from services.model.sampler import SamplingParams, finish_reason, sample

__all__ = [
    "CheckpointMismatch",
    "DecodeCache",
    "GenerationConfig",
    "InvalidModelConfig",
    "InvalidModelInput",
    "LayerPrefill",
    "LoadedModel",
    "MissingCheckpointFile",
    "ModelConfig",
    "ModelError",
    "PrefillOptions",
    "PrefillResult",
    "SamplingParams",
    "StepCapture",
    "UnsupportedArchitecture",
    "decode_step",
    "decode_tokens",
    "finish_reason",
    "generate",
    "load",
    "prefill",
    "sample",
]
