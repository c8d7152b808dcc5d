"""Read a llama.cpp GGUF file: its metadata becomes the same `ModelConfig`, `GenerationConfig`
and `TextTokenizer` an HF directory yields, its tensors the same HF-named state dict
(`services.model.gguf_tensors`), so the rest of the runtime never knows which kind it loaded.

    contents = read_gguf(path)                  # metadata only: config, tokenizer, tensor index
    tensors = gguf_state_dict(contents)         # HF names, dequantized to fp32 on the host

Every failure is a typed `ModelError` naming the metadata key or tensor at fault: a file that is
not (or no longer, e.g. truncated) a GGUF raises `InvalidGGUFFile`, a missing or malformed key
`MissingGGUFKey` / `InvalidModelConfig`, another architecture `UnsupportedGGUFArchitecture`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import ReaderTensor

from services.model.config import GenerationConfig, ModelConfig, RopeConfig
from services.model.errors import InvalidModelConfig, UnsupportedArchitecture
from services.model.gguf_metadata import GGUFMetadata, MissingGGUFKey, open_gguf
from services.model.gguf_tokenizer import gguf_tokenizer
from services.model.tokenizer import TextTokenizer

GGUF_SUFFIX = ".gguf"
ARCHITECTURE_KEY = "general.architecture"
# GGUF architecture -> runtime family. Mistral checkpoints are written by llama.cpp as `llama`.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# `{arch}.rope.scaling.type` values the runtime reproduces exactly.
_ROPE_SCALING = {"none": "default", "linear": "linear"}


class UnsupportedGGUFArchitecture(UnsupportedArchitecture):
    """`general.architecture` names an architecture this runtime does not implement."""

    def __init__(self, name: str) -> None:
        super().__init__(name, tuple(GGUF_ARCHITECTURES))
        self.key = ARCHITECTURE_KEY

    def __str__(self) -> str:
        supported = ", ".join(self.supported)
        return f"{self.key} = {self.name!r} is not supported; supported: {supported}"


@dataclass(frozen=True)
class GGUFContents:
    """What a GGUF file says, read without dequantizing any weight. `tensors` indexes the
    file's tensors by llama.cpp name; their data stays memory-mapped until dequantized."""

    path: Path
    architecture: str
    config: ModelConfig
    generation_config: GenerationConfig
    tokenizer: TextTokenizer | None
    tensors: dict[str, ReaderTensor]


def is_gguf_file(path: str | Path) -> bool:
    """True when `path` names a file (not a directory) with the `.gguf` suffix."""
    return Path(path).suffix.lower() == GGUF_SUFFIX and not Path(path).is_dir()


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse the header of `path` into config, generation config and tokenizer."""
    file = Path(path)
    reader = open_gguf(file)
    metadata = GGUFMetadata(reader)
    architecture = metadata.string(ARCHITECTURE_KEY)
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedGGUFArchitecture(architecture)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    return GGUFContents(
        path=file,
        architecture=architecture,
        config=gguf_model_config(metadata, architecture, tensors),
        generation_config=gguf_generation_config(metadata),
        tokenizer=gguf_tokenizer(metadata, file),
        tensors=tensors,
    )


def gguf_model_config(
    metadata: GGUFMetadata, architecture: str, tensors: dict[str, ReaderTensor]
) -> ModelConfig:
    """ModelConfig from the `{arch}.*` keys (llama.cpp's names for the HF config fields)."""
    key = f"{architecture}."
    hidden = metadata.integer(key + "embedding_length")
    num_q = metadata.integer(key + "attention.head_count")
    num_layers = metadata.integer(key + "block_count")
    head_dim = metadata.integer(key + "attention.key_length", hidden // max(num_q, 1))
    rope_dims = metadata.integer(key + "rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise InvalidModelConfig(
            key + "rope.dimension_count", f"{rope_dims} != head_dim {head_dim} (partial RoPE)"
        )
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style frequency factors: llama.cpp stores them as a tensor, not as keys.
        raise InvalidModelConfig(
            "rope_freqs.weight", "per-frequency RoPE factors are not supported"
        )
    family = GGUF_ARCHITECTURES[architecture]
    return ModelConfig(
        family=family,
        vocab_size=metadata.integer(key + "vocab_size", _vocab_size(metadata, tensors)),
        hidden_size=hidden,
        intermediate_size=metadata.integer(key + "feed_forward_length"),
        num_layers=num_layers,
        num_q_heads=num_q,
        num_kv_heads=metadata.integer(key + "attention.head_count_kv", num_q),
        head_dim=head_dim,
        rms_norm_eps=metadata.number(key + "attention.layer_norm_rms_epsilon"),
        rope=_rope(metadata, key),
        max_position_embeddings=metadata.integer(key + "context_length"),
        qkv_bias=family == "qwen2",
        tie_word_embeddings="output.weight" not in tensors,
        sliding_windows=(None,) * num_layers,
        checkpoint_dtype="float32",
    )


def gguf_generation_config(metadata: GGUFMetadata) -> GenerationConfig:
    """EOS = eos_token_id plus the end-of-turn (eot) and end-of-message (eom) ids, when set."""
    prefix = "tokenizer.ggml."
    eos = [metadata.optional_integer(prefix + name)
           for name in ("eos_token_id", "eot_token_id", "eom_token_id")]
    return GenerationConfig(
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        bos_token_id=metadata.optional_integer(prefix + "bos_token_id"),
        pad_token_id=metadata.optional_integer(prefix + "padding_token_id"),
    )


def _rope(metadata: GGUFMetadata, key: str) -> RopeConfig:
    theta = metadata.number(key + "rope.freq_base", 10000.0)
    scaling = metadata.string(key + "rope.scaling.type", "none")
    if scaling not in _ROPE_SCALING:
        raise InvalidModelConfig(
            key + "rope.scaling.type", f"{scaling!r} is not one of {', '.join(_ROPE_SCALING)}"
        )
    factor = metadata.number(key + "rope.scaling.factor", 1.0) if scaling == "linear" else 1.0
    return RopeConfig(theta=theta, rope_type=_ROPE_SCALING[scaling], factor=factor)


def _vocab_size(metadata: GGUFMetadata, tensors: dict[str, ReaderTensor]) -> int:
    """Older files lack `{arch}.vocab_size`: the embedding's row count (ne[1]) says it."""
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and len(embedding.shape) == 2:
        return int(embedding.shape[1])
    tokens = metadata.value("tokenizer.ggml.tokens", required=False)
    if tokens:
        return len(tokens)
    raise MissingGGUFKey("token_embd.weight", "needed for the vocabulary size")
