"""Model configuration: HF `config.json` / `generation_config.json` parsed once into frozen,
validated dataclasses, and the manifest tensor contract the model satisfies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from services.kvpolicy.manifest import DType, GQAGrouping, KeyPositionalStage, TensorContract
from services.model.errors import InvalidModelConfig, UnsupportedArchitecture

# HF architecture name -> family; model_type is accepted as a fallback.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILIES = tuple(sorted(set(ARCHITECTURES.values())))
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' | 'bfloat16' | 'float16' for a supported torch dtype."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise InvalidModelConfig("dtype", f"{dtype} is not one of {', '.join(DTYPES)}")


def resolve_dtype(dtype: torch.dtype | str | None, default: str) -> torch.dtype:
    """Accept a torch dtype, its name ('bf16'/'fp16'/'fp32' too) or None (use `default`)."""
    if isinstance(dtype, torch.dtype):
        dtype_name(dtype)
        return dtype
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    name = aliases.get(dtype or default, dtype or default)
    if name not in DTYPES:
        raise InvalidModelConfig("dtype", f"{name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_parameters` / legacy `rope_theta` + `rope_scaling`)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise InvalidModelConfig(
                "rope_scaling.rope_type", f"{self.rope_type!r} is not one of {ROPE_TYPES}"
            )
        if self.theta <= 0:
            raise InvalidModelConfig("rope_theta", "must be > 0")
        if self.factor <= 0:
            raise InvalidModelConfig("rope_scaling.factor", "must be > 0")
        if self.rope_type == "llama3":
            if self.original_max_position_embeddings is None:
                raise InvalidModelConfig(
                    "rope_scaling.original_max_position_embeddings", "required for llama3 RoPE"
                )
            if self.high_freq_factor <= self.low_freq_factor:
                raise InvalidModelConfig(
                    "rope_scaling.high_freq_factor", "must exceed low_freq_factor"
                )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one Llama-family decoder (Llama, Mistral, Qwen2, Qwen3)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Per layer: None = full causal attention, w = key j visible to query i iff i - w < j <= i.
    sliding_windows: tuple[int | None, ...] = ()
    checkpoint_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise UnsupportedArchitecture(self.family, FAMILIES)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_q_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise InvalidModelConfig(name, "must be a positive integer")
        if self.num_q_heads % self.num_kv_heads:
            raise InvalidModelConfig(
                "num_key_value_heads",
                f"{self.num_kv_heads} does not divide num_attention_heads={self.num_q_heads}",
            )
        if self.head_dim % 2:
            raise InvalidModelConfig("head_dim", "RoPE needs an even head_dim")
        if len(self.sliding_windows) != self.num_layers:
            raise InvalidModelConfig("layer_types", "need one attention type per layer")
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            raise InvalidModelConfig("sliding_window", "must be a positive integer")
        if self.checkpoint_dtype not in DTYPES:
            raise InvalidModelConfig("dtype", f"{self.checkpoint_dtype!r} is not supported")

    @property
    def group_size(self) -> int:
        """Query heads per K/V head (1 = MHA)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_to_kv_head_map(self) -> tuple[int, ...]:
        """Query head i reads K/V head i // group_size (HF `repeat_kv` order)."""
        return tuple(i // self.group_size for i in range(self.num_q_heads))


@dataclass(frozen=True)
class GenerationConfig:
    """Token ids from `generation_config.json` (falling back to config.json)."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None


def make_tensor_contract(config: ModelConfig, kv_dtype: torch.dtype) -> TensorContract:
    """The manifest tensor contract of this model when its K/V are stored in `kv_dtype`."""
    dtype = DType(dtype_name(kv_dtype))
    return TensorContract(
        num_layers=config.num_layers,
        num_q_heads=config.num_q_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        k_dtype=dtype,
        v_dtype=dtype,
        q_to_kv_head_map=config.q_to_kv_head_map,
        gqa_grouping=GQAGrouping.CONTIGUOUS,
        key_positional_stage=KeyPositionalStage.POST_ROPE,
    )


def parse_model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the parsed `config.json` of a supported HF checkpoint."""
    family = _family(raw)
    hidden = _int(raw, "hidden_size")
    num_q = _int(raw, "num_attention_heads")
    num_layers = _int(raw, "num_hidden_layers")
    head_dim = raw.get("head_dim") or (128 if family == "qwen3" else hidden // num_q)
    if raw.get("hidden_act", "silu") != "silu":
        raise InvalidModelConfig("hidden_act", f"{raw['hidden_act']!r} is not supported (silu)")
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        family=family,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size"),
        num_layers=num_layers,
        num_q_heads=num_q,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_q),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(raw, family, num_layers),
        checkpoint_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
    )


def parse_generation_config(
    raw: Mapping[str, Any], fallback: Mapping[str, Any]
) -> GenerationConfig:
    """Token ids from generation_config.json, with config.json's values as the fallback."""

    def pick(name: str) -> Any:
        return raw[name] if raw.get(name) is not None else fallback.get(name)

    eos = pick("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    if not all(isinstance(i, int) and i >= 0 for i in eos_ids):
        raise InvalidModelConfig("eos_token_id", f"{eos!r} is not a token id or list of ids")
    return GenerationConfig(
        eos_token_ids=eos_ids, bos_token_id=pick("bos_token_id"), pad_token_id=pick("pad_token_id")
    )


def parse_rope(raw: Mapping[str, Any]) -> RopeConfig:
    """RoPE from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (< 5)."""
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params:
        params = dict(params["full_attention"])
    params.update(raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    original = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
    )


def _family(raw: Mapping[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if architectures:
        raise UnsupportedArchitecture(str(architectures[0]), tuple(ARCHITECTURES))
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return str(model_type)
    raise UnsupportedArchitecture(str(model_type), tuple(ARCHITECTURES))


def _sliding_windows(
    raw: Mapping[str, Any], family: str, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if family == "llama" or window is None:
        return (None,) * num_layers
    if family == "mistral":
        return (int(window),) * num_layers
    if not raw.get("use_sliding_window", False):  # Qwen: HF drops the window when unused
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if layer_types is None:
        first = int(raw.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise InvalidModelConfig("layer_types", f"has {len(layer_types)} entries, need {num_layers}")
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise InvalidModelConfig("layer_types", f"unsupported attention types {sorted(unknown)}")
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _int(raw: Mapping[str, Any], name: str) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidModelConfig(name, f"expected an integer, got {value!r}")
    return value
