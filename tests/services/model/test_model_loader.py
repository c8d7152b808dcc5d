"""Loading checkpoints: typed errors that name the culprit, config parsing across
transformers versions, tokenizer round trip, generation config and the tensor contract."""

from __future__ import annotations

import json

import pytest
import torch
from model_checkpoints import LLAMA3_ROPE, save_reference
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from services.kvpolicy.manifest import GQAGrouping, KeyPositionalStage
from services.model import (
    CheckpointMismatch,
    InvalidModelConfig,
    MissingCheckpointFile,
    SamplingParams,
    UnsupportedArchitecture,
    generate,
    load,
)
from services.model.config import parse_model_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save_reference(directory, "llama", seed=3)
    return directory


def _copy(saved, tmp_path, edit_config=None):
    for item in saved.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    if edit_config is not None:
        config = json.loads((tmp_path / "config.json").read_text())
        edit_config(config)
        (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(MissingCheckpointFile) as error:
        load(tmp_path)
    assert error.value.path.name == "config.json"


def test_missing_weights_name_the_file(saved, tmp_path):
    _copy(saved, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(MissingCheckpointFile, match="model.safetensors"):
        load(tmp_path)


def test_missing_shard_names_the_shard(tmp_path):
    save_reference(tmp_path, "llama", seed=3, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(MissingCheckpointFile) as error:
        load(tmp_path)
    assert error.value.path.name == shard.name


def test_unsupported_architecture_is_named(saved, tmp_path):
    def gpt2(config):
        config["architectures"] = ["GPT2LMHeadModel"]

    with pytest.raises(UnsupportedArchitecture) as error:
        load(_copy(saved, tmp_path, gpt2))
    assert error.value.name == "GPT2LMHeadModel"
    assert "LlamaForCausalLM" in str(error.value)


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_scaling.rope_type"),
        ("hidden_act", "gelu", "hidden_act"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("hidden_size", "64", "hidden_size"),
    ],
)
def test_unsupported_config_fields_are_named(saved, tmp_path, key, value, field):
    def edit(config):
        config[key] = value

    with pytest.raises(InvalidModelConfig) as error:
        load(_copy(saved, tmp_path, edit))
    assert error.value.field == field


def test_weights_that_do_not_fit_the_config_are_named(saved, tmp_path):
    def wider(config):
        config["intermediate_size"] = 100

    with pytest.raises(CheckpointMismatch) as error:
        load(_copy(saved, tmp_path, wider))
    assert error.value.tensor.startswith("model.layers.0.mlp.")
    assert "expected (64, 100)" in str(error.value) or "(100, 64)" in str(error.value)

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(CheckpointMismatch) as error:
        load(tmp_path)
    assert error.value.tensor == "model.layers.1.self_attn.k_proj.weight"


def test_tensor_contract_and_generation_config(saved, tmp_path):
    _copy(saved, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    loaded = load(tmp_path, dtype="float32")
    contract = loaded.tensor_contract
    assert (contract.num_layers, contract.num_q_heads, contract.num_kv_heads) == (2, 4, 2)
    assert contract.head_dim == 16
    assert contract.q_to_kv_head_map == (0, 0, 1, 1)
    assert contract.gqa_grouping is GQAGrouping.CONTIGUOUS
    assert contract.key_positional_stage is KeyPositionalStage.POST_ROPE
    assert contract.k_dtype.value == contract.v_dtype.value == "float32"
    assert loaded.generation_config.eos_token_ids == (2, 5)
    assert loaded.generation_config.bos_token_id == 1
    with pytest.raises(InvalidModelConfig, match="dtype"):
        load(tmp_path, dtype="int8")


def test_legacy_rope_scaling_format_loads_identically(tmp_path):
    modern, legacy = tmp_path / "modern", tmp_path / "legacy"
    save_reference(modern, "llama3-rope", seed=4)
    save_reference(legacy, "llama3-rope", seed=4)
    config = json.loads((legacy / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}  # transformers 4.x style
    (legacy / "config.json").write_text(json.dumps(config))
    assert load(legacy).config == load(modern).config
    assert load(modern).config.rope.rope_type == LLAMA3_ROPE["rope_type"]


def test_qwen_sliding_layers_follow_max_window_layers():
    raw = {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
        "num_key_value_heads": 1, "use_sliding_window": True, "sliding_window": 5,
        "max_window_layers": 1,
    }
    assert parse_model_config(raw).sliding_windows == (None, 5, 5)
    assert parse_model_config({**raw, "use_sliding_window": False}).sliding_windows == (None,) * 3
    config = parse_model_config(raw)
    assert config.qkv_bias and not config.o_bias and not config.qk_norm


def test_tokenizer_round_trip_and_stop_ids(saved, tmp_path):
    _copy(saved, tmp_path)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(94)]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load(tmp_path)
    text = "w5 w17 w93 w40"
    ids = loaded.require_tokenizer().encode(text)
    assert ids == [8, 20, 96, 43]
    assert loaded.require_tokenizer().decode(ids) == text
    first = generate(loaded, ids, 1)[0]
    assert generate(loaded, ids, 5, SamplingParams(stop_token_ids=(first,))) == [first]


def test_absent_or_broken_tokenizer(saved, tmp_path):
    loaded = load(saved)
    assert loaded.tokenizer is None
    with pytest.raises(MissingCheckpointFile, match="tokenizer.json"):
        loaded.require_tokenizer()
    _copy(saved, tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidModelConfig, match="tokenizer.json"):
        load(tmp_path)
