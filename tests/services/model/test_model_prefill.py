"""Prefill mechanics: chunking is invisible in the results, the per-layer hook streams
finished layers in order, the observation window is clamped, bad input is named."""

from __future__ import annotations

import pytest
import torch
from model_checkpoints import prompt, save_reference

from services.model import InvalidModelInput, LayerPrefill, PrefillOptions, load, prefill

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mistral")
    save_reference(directory, "mistral", seed=9)  # sliding window 7 crosses chunk borders
    return load(directory).model


def test_chunk_size_does_not_change_prefill(model):
    ids = prompt(37, seed=5)
    runs = [prefill(model, ids, PrefillOptions(chunk_size=c, obs_window=5)) for c in (1, 8, 37, 99)]
    for other in runs[1:]:
        torch.testing.assert_close(other.logits, runs[0].logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other.source_k, runs[0].source_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other.source_v, runs[0].source_v, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other.observation, runs[0].observation, atol=1e-5, rtol=1e-5)


def test_layer_hook_sees_each_finished_layer_in_order(model):
    seen: list[LayerPrefill] = []

    def hook(layer: LayerPrefill) -> None:
        seen.append(LayerPrefill(layer.layer, layer.source_k.clone(), layer.source_v.clone(),
                                 layer.observation.clone()))

    result = prefill(model, prompt(20, seed=6), PrefillOptions(chunk_size=6, obs_window=4), hook)
    assert [layer.layer for layer in seen] == [0, 1]
    for layer in seen:
        assert torch.equal(layer.source_k, result.source_k[layer.layer])
        assert torch.equal(layer.source_v, result.source_v[layer.layer])
        assert torch.equal(layer.observation, result.observation[layer.layer])


def test_observation_window_is_clamped_or_skipped(model):
    ids = prompt(5, seed=7)
    whole = prefill(model, ids, PrefillOptions(obs_window=32))
    assert whole.observation.shape == (2, 4, 5, 5)
    assert torch.equal(whole.observation.triu(1), torch.zeros_like(whole.observation))
    assert prefill(model, ids, PrefillOptions(obs_window=0)).observation.shape == (2, 4, 0, 5)
    assert whole.prompt_length == 5
    assert whole.source_k.shape == (2, 2, 5, 16)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda m: prefill(m, []), "token_ids"),
        (lambda m: prefill(m, [3, 97]), "token_ids"),
        (lambda m: PrefillOptions(chunk_size=0), "prefill.chunk_size"),
        (lambda m: PrefillOptions(obs_window=-1), "prefill.obs_window"),
    ],
)
def test_bad_input_is_named(model, call, field):
    with pytest.raises(InvalidModelInput) as error:
        call(model)
    assert error.value.field == field
