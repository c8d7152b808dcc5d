"""The committed demo checkpoint: complete, small, a GQA Llama, and it answers needle questions
with a full cache through kvrelay's runtime (and agrees with the transformers reference)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from services.demo import needle
from services.demo.evaluate import ANSWER_TOKENS, EvalConfig, held_out_prompts
from services.demo.needle import Placement
from services.model import generate, load
from services.model.default import DEMO_CHECKPOINT

FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
# (context tokens, depth, placement, seed): held-out prompts, one per length and placement.
CASES = [
    (512, 0.1, Placement.END, 101),
    (1024, 0.5, Placement.END, 102),
    (2048, 0.9, Placement.END, 103),
    (1024, 0.3, Placement.BEFORE_FILLER, 104),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def loaded():
    return load(DEMO_CHECKPOINT, "cpu", "float32")


def test_checkpoint_files_are_committed_and_small() -> None:
    sizes = {name: (DEMO_CHECKPOINT / name).stat().st_size for name in FILES}
    assert sum(sizes.values()) <= 8 * 1024 * 1024, sizes


def test_config_is_a_small_gqa_llama() -> None:
    config = json.loads((DEMO_CHECKPOINT / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert 2 <= config["num_hidden_layers"] <= 4
    assert 4 <= config["num_attention_heads"] <= 8 and config["num_key_value_heads"] == 2
    assert 128 <= config["hidden_size"] <= 256
    assert config["rope_theta"] == 10000.0 and config["max_position_embeddings"] == 32768
    assert config["vocab_size"] == len(needle.vocabulary())


def test_runtime_loads_with_the_needle_tokenizer_and_gqa_contract(loaded) -> None:
    contract = loaded.tensor_contract
    assert contract.num_kv_heads == 2 and contract.num_q_heads > contract.num_kv_heads
    tokenizer = loaded.require_tokenizer()
    text = needle.build_prompt(256, 0.5, Placement.END, seed=1).text
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize(("tokens", "depth", "placement", "seed"), CASES)
def test_runtime_answers_a_needle_question_with_full_cache(
    loaded, tokens: int, depth: float, placement: Placement, seed: int
) -> None:
    prompt = needle.build_prompt(tokens, depth, placement, seed)
    tokenizer = loaded.require_tokenizer()
    generated = generate(loaded, tokenizer.encode(prompt.text), ANSWER_TOKENS)
    assert tokenizer.decode(generated).split()[0] == prompt.answer


def test_runtime_agrees_with_the_transformers_reference(loaded) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.LlamaForCausalLM.from_pretrained(DEMO_CHECKPOINT).eval()
    tokenizer = Tokenizer.from_file(str(DEMO_CHECKPOINT / "tokenizer.json"))
    config = EvalConfig(prompts=4)
    for prompt in held_out_prompts(config, 1024, Placement.END):
        ids = tokenizer.encode(prompt.text).ids
        with torch.no_grad():
            expected = reference(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()
        ours = generate(loaded, ids, 1)
        assert ours == [int(expected)]
