"""Our runtime against HF `transformers` on tiny random checkpoints of every family:
prefill logits, post-RoPE source keys/values, observation attention and greedy decoding."""

from __future__ import annotations

import pytest
import torch
from model_checkpoints import FAMILIES, prompt, save_reference

from services.model import (
    DecodeCache,
    PrefillOptions,
    SamplingParams,
    decode_step,
    generate,
    load,
    prefill,
)

torch.set_num_threads(1)
PROMPT_LENGTH = 40
NEW_TOKENS = 6


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_reference(directory, request.param, seed=len(request.param))
    return request.param, reference, load(directory)


def _reference_generation(reference, ids: torch.Tensor, steps: int):
    # HF greedy generation; `logits` are the raw per-step scores before any processor.
    out = reference.generate(
        ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=steps,
        do_sample=False, output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, ids.shape[0]:].tolist(), torch.cat(out.logits)


def test_prefill_logits_and_source_kv_match_transformers(checkpoint):
    family, reference, loaded = checkpoint
    ids = prompt(PROMPT_LENGTH, seed=1)
    with torch.no_grad():
        expected = reference(ids[None], use_cache=True)
    result = prefill(loaded.model, ids, PrefillOptions(chunk_size=16, obs_window=8))
    torch.testing.assert_close(result.logits, expected.logits[0, -1], atol=1e-4, rtol=1e-4)
    cache = expected.past_key_values
    for layer in range(loaded.config.num_layers):
        hf_keys, hf_values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        if family == "mistral":  # HF keeps only the window's rows; compare those
            hf_keys, hf_values = hf_keys[:, -7:], hf_values[:, -7:]
        span = hf_keys.shape[1]
        torch.testing.assert_close(result.source_k[layer, :, -span:], hf_keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(result.source_v[layer, :, -span:], hf_values, atol=1e-5, rtol=1e-5)


def test_greedy_decode_matches_transformers(checkpoint):
    _, reference, loaded = checkpoint
    ids = prompt(PROMPT_LENGTH, seed=2)
    expected_tokens, expected_logits = _reference_generation(reference, ids, NEW_TOKENS)
    assert generate(loaded, ids, NEW_TOKENS) == expected_tokens

    result = prefill(loaded.model, ids, PrefillOptions(chunk_size=9))
    cache = DecodeCache(loaded.config, loaded.dtype, row_capacity=8)  # forces growth
    cache.admit_dense("r", result.source_k, result.source_v)
    logits = [result.logits]
    for token in expected_tokens[:-1]:
        logits.append(decode_step(loaded.model, cache, [token])[0])
    torch.testing.assert_close(torch.stack(logits), expected_logits, atol=1e-4, rtol=1e-4)


def test_observation_attention_equals_rows_of_full_attention(checkpoint):
    family, reference, loaded = checkpoint
    ids = prompt(PROMPT_LENGTH, seed=3)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = reference(ids[None], output_attentions=True).attentions
    reference.set_attn_implementation("sdpa")
    window = 6
    result = prefill(loaded.model, ids, PrefillOptions(chunk_size=7, obs_window=window))
    assert result.observation.shape == (2, 4, window, PROMPT_LENGTH)
    assert result.observation.dtype == torch.float32
    for layer, full in enumerate(attentions):  # full [1, H_q, T, T]
        torch.testing.assert_close(
            result.observation[layer], full[0, :, -window:, :], atol=1e-5, rtol=1e-4
        )
    torch.testing.assert_close(result.observation.sum(-1), torch.ones(2, 4, window))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_prefill_and_decode_track_transformers(tmp_path, dtype):
    reference = save_reference(tmp_path, "qwen2", seed=5).to(dtype)
    loaded = load(tmp_path, dtype=dtype)
    assert loaded.dtype == dtype
    assert loaded.tensor_contract.k_dtype.value == str(dtype).removeprefix("torch.")
    ids = prompt(24, seed=4)
    _, expected = _reference_generation(reference, ids, 3)
    result = prefill(loaded.model, ids, PrefillOptions(chunk_size=8))
    assert result.source_k.dtype == dtype
    cache = DecodeCache(loaded.config, loaded.dtype)
    cache.admit_dense("r", result.source_k, result.source_v)
    tokens = expected.argmax(-1).tolist()
    logits = [result.logits] + [decode_step(loaded.model, cache, [t])[0] for t in tokens[:2]]
    torch.testing.assert_close(torch.stack(logits), expected.float(), atol=3e-2, rtol=3e-2)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_reference(single, "llama", seed=7)
    save_reference(sharded, "llama", seed=7, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    expected, actual = load(single).model.state_dict(), load(sharded).model.state_dict()
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_tied_embeddings_checkpoint(tmp_path):
    reference = save_reference(tmp_path, "qwen3", seed=8, tie_word_embeddings=True)
    loaded = load(tmp_path)
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    ids = prompt(10, seed=9)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0, -1]
    torch.testing.assert_close(prefill(loaded.model, ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_seeded_sampling_matches_itself_not_greedy(checkpoint):
    _, _, loaded = checkpoint
    ids = prompt(16, seed=10)
    params = SamplingParams(temperature=1.5, top_k=50, seed=123)
    first = generate(loaded, ids, 8, params)
    assert generate(loaded, ids, 8, params) == first
    other_seeds = {tuple(generate(loaded, ids, 8, SamplingParams(temperature=1.5, seed=s)))
                   for s in range(4)}
    assert len(other_seeds) > 1
