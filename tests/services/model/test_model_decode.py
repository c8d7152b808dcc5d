"""Decode over packed views: ragged per-(layer, owner) rows, batched, against a dense reference
that keeps every row and hides the omitted ones with an additive -inf mask."""

from __future__ import annotations

import random

import pytest
import torch
from model_checkpoints import prompt, save_reference

from services.kvpolicy.packing import pack
from services.model import (
    DecodeCache,
    InvalidModelInput,
    PrefillOptions,
    decode_step,
    load,
    prefill,
)
from services.model.attention import varlen_decode_available

torch.set_num_threads(1)
STEPS = 4


@pytest.fixture(scope="module", params=["llama-mha", "llama", "mistral"])
def loaded(request, tmp_path_factory):
    """MHA (H_q = H_kv = 4), GQA (4 query heads on 2 K/V heads), GQA + sliding window 7."""
    directory = tmp_path_factory.mktemp(request.param)
    save_reference(directory, request.param, seed=11)
    return load(directory)


class MaskedDenseReference:
    """Decode one request keeping every K/V row; an additive mask hides omitted rows per
    (layer, owner head). Query heads are mapped to owners with an explicit index (no grouping
    reshape), so it shares no attention code with the runtime."""

    def __init__(self, loaded, result, selected, owner_of_query_head):
        self.model, self.config = loaded.model, loaded.config
        self.owner_of = torch.tensor(owner_of_query_head)
        kv_of_owner = (
            loaded.config.q_to_kv_head_map
            if len(selected[0]) == loaded.config.num_q_heads
            else tuple(range(loaded.config.num_kv_heads))
        )
        self.kv_of_owner = torch.tensor(kv_of_owner)
        length = result.prompt_length
        self.keys = [result.source_k[layer].clone() for layer in range(self.config.num_layers)]
        self.values = [result.source_v[layer].clone() for layer in range(self.config.num_layers)]
        self.visible = []
        for per_layer in selected:  # [H_owner][...] -> bool [H_owner, T]
            mask = torch.zeros(len(per_layer), length, dtype=torch.bool)
            for owner, positions in enumerate(per_layer):
                mask[owner, list(positions)] = True
            self.visible.append(mask)
        self.position = length

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        position = torch.tensor([self.position])
        logits = self.model(torch.tensor([token]), position, self._attend)
        self.position += 1
        return logits[0]

    def _attend(self, layer):
        def attend(q, k, v):  # q [1, H_q, d_h]; k, v [1, H_kv, d_h]
            self.keys[layer] = torch.cat([self.keys[layer], k[0][:, None]], dim=1)
            self.values[layer] = torch.cat([self.values[layer], v[0][:, None]], dim=1)
            owners = self.visible[layer].shape[0]
            self.visible[layer] = torch.cat(
                [self.visible[layer], torch.ones(owners, 1, dtype=torch.bool)], dim=1
            )
            kv_head = self.kv_of_owner[self.owner_of]  # [H_q]
            keys, values = self.keys[layer][kv_head], self.values[layer][kv_head]  # [H_q, S, d_h]
            visible = self.visible[layer][self.owner_of].clone()  # [H_q, S]
            window = self.config.sliding_windows[layer]
            if window is not None:
                visible[:, : max(0, self.position - window + 1)] = False
            bias = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))
            scores = torch.einsum("hd,hsd->hs", q[0].float(), keys.float()) * self.model.scale
            probs = torch.softmax(scores + bias, dim=-1)
            return torch.einsum("hs,hsd->hd", probs, values.float())[None].to(q.dtype)

        return attend


def random_selection(rng, length, num_layers, owners, keep):
    """Sorted retained positions per (layer, owner), a different subset and size each."""
    selected = []
    for _ in range(num_layers):
        per_layer = []
        for owner in range(owners):
            size = 0 if owner == owners - 1 and keep < 0.3 else max(1, int(keep * length) + owner)
            per_layer.append(sorted(rng.sample(range(length), min(size, length))))
        selected.append(per_layer)
    return selected


def _request(loaded, seed, length, keep, owners=None):
    rng = random.Random(seed)
    ids = prompt(length, seed=seed)
    result = prefill(loaded.model, ids, PrefillOptions(chunk_size=16))
    owners = owners or loaded.config.num_kv_heads
    selected = random_selection(rng, length, loaded.config.num_layers, owners, keep)
    tokens = [rng.randrange(3, loaded.config.vocab_size) for _ in range(STEPS)]
    return result, selected, tokens


def _reference_logits(loaded, result, selected, tokens):
    owners = len(selected[0])
    owner_of = loaded.config.q_to_kv_head_map if owners < loaded.config.num_q_heads else range(owners)
    reference = MaskedDenseReference(loaded, result, selected, tuple(owner_of))
    return torch.stack([reference.step(token) for token in tokens])


def test_view_retaining_every_position_equals_dense_decode(loaded):
    result, _, tokens = _request(loaded, seed=1, length=30, keep=1.0)
    everything = [[list(range(30))] * loaded.config.num_kv_heads] * loaded.config.num_layers
    view = pack(result.source_k, result.source_v, everything)
    packed, dense = DecodeCache(loaded.config, loaded.dtype), DecodeCache(loaded.config, loaded.dtype)
    packed.admit_view("r", view, frontier=30)
    dense.admit_dense("r", result.source_k, result.source_v)
    for token in tokens:
        torch.testing.assert_close(
            decode_step(loaded.model, packed, [token]), decode_step(loaded.model, dense, [token]),
            atol=0, rtol=0,
        )


def test_compressed_view_equals_masked_dense_attention(loaded):
    result, selected, tokens = _request(loaded, seed=2, length=33, keep=0.25)
    view = pack(result.source_k, result.source_v, selected)
    cache = DecodeCache(loaded.config, loaded.dtype)
    cache.admit_view("r", view, frontier=33)
    logits = torch.stack([decode_step(loaded.model, cache, [t])[0] for t in tokens])
    expected = _reference_logits(loaded, result, selected, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    lengths = cache.lengths("r")  # every owner kept its rows plus one appended per step
    for layer, per_layer in enumerate(selected):
        assert lengths[layer].tolist() == [len(p) + STEPS for p in per_layer]


def test_batch_of_ragged_layouts_matches_each_request_alone(loaded):
    specs = [("a", 3, 29, 0.1), ("b", 4, 41, 0.5), ("c", 5, 17, 0.25)]
    requests = {name: _request(loaded, seed, length, keep) for name, seed, length, keep in specs}
    # Tiny capacities: admission and decoding must grow the slabs along both axes.
    cache = DecodeCache(loaded.config, loaded.dtype, batch_capacity=1, row_capacity=2)
    for name, (result, selected, _) in requests.items():
        view = pack(result.source_k, result.source_v, selected)
        cache.admit_view(name, view, frontier=result.prompt_length)
    expected = {name: _reference_logits(loaded, *requests[name]) for name in requests}
    for step in range(STEPS):
        if step == 2:
            cache.release("a")  # "c" moves into slot 0; "b" and "c" must not notice
        names = list(cache.request_ids)
        logits = decode_step(loaded.model, cache, [requests[n][2][step] for n in names])
        for row, name in enumerate(names):
            torch.testing.assert_close(logits[row], expected[name][step], atol=1e-5, rtol=1e-5)
    assert cache.request_ids == ["c", "b"]


def test_query_head_owners_match_per_query_head_mask(loaded):
    config = loaded.config
    result, selected, tokens = _request(loaded, 6, 27, 0.3, owners=config.num_q_heads)
    view = pack(result.source_k, result.source_v, selected, owner_to_kv_head=config.q_to_kv_head_map)
    cache = DecodeCache(config, loaded.dtype, owner_to_kv_head=config.q_to_kv_head_map)
    cache.admit_view("r", view, frontier=27)
    logits = torch.stack([decode_step(loaded.model, cache, [t])[0] for t in tokens])
    expected = _reference_logits(loaded, result, selected, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_appending_omitted_rows_restores_full_cache_decode(loaded):
    result, selected, tokens = _request(loaded, seed=7, length=25, keep=0.2)
    cache = DecodeCache(loaded.config, loaded.dtype)
    cache.admit_view("r", pack(result.source_k, result.source_v, selected), frontier=25)
    for layer, per_layer in enumerate(selected):  # a recall of every omitted row
        for head, kept in enumerate(per_layer):
            omitted = torch.tensor(sorted(set(range(25)) - set(kept)), dtype=torch.long)
            cache.append_rows("r", layer, head, result.source_k[layer, head, omitted],
                              result.source_v[layer, head, omitted], omitted)
    everything = [[list(range(25))] * loaded.config.num_kv_heads] * loaded.config.num_layers
    logits = torch.stack([decode_step(loaded.model, cache, [t])[0] for t in tokens])
    expected = _reference_logits(loaded, result, everything, tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    keys, _, positions = cache.rows("r", 1, 0)
    assert sorted(positions.tolist()) == list(range(25 + STEPS))
    assert keys.shape == (25 + STEPS, loaded.config.head_dim)


def test_view_for_another_model_is_rejected(loaded):
    result, selected, _ = _request(loaded, seed=8, length=12, keep=0.5)
    view = pack(result.source_k[:1], result.source_v[:1], selected[:1])  # one layer only
    cache = DecodeCache(loaded.config, loaded.dtype)
    with pytest.raises(InvalidModelInput, match="row_offsets"):
        cache.admit_view("r", view, frontier=12)
    view = pack(result.source_k, result.source_v, selected)
    with pytest.raises(InvalidModelInput, match="frontier"):
        cache.admit_view("r", view, frontier=max(max(p) for p in selected[0]))
    cache.admit_dense("r", result.source_k, result.source_v)
    with pytest.raises(InvalidModelInput, match="tokens"):
        decode_step(loaded.model, cache, [5, 6])
    with pytest.raises(InvalidModelInput, match="request_id"):
        cache.admit_dense("r", result.source_k, result.source_v)


@pytest.mark.skipif(
    not varlen_decode_available(torch.device("cuda"), torch.bfloat16),
    reason="torch varlen flash attention needs CUDA",
)
def test_varlen_kernel_matches_padded_decode_on_cuda(tmp_path):
    save_reference(tmp_path, "llama", seed=12)
    loaded = load(tmp_path, device="cuda", dtype="bf16")
    caches = {name: DecodeCache(loaded.config, loaded.dtype, "cuda", backend=name)
              for name in ("torch", "varlen")}
    for seed, length in ((1, 40), (2, 23)):
        result, selected, _ = _request(loaded, seed, length, keep=0.3)
        view = pack(result.source_k, result.source_v, selected)
        for cache in caches.values():
            cache.admit_view(str(seed), view, frontier=length)
    for token in (5, 6, 7):
        padded = decode_step(loaded.model, caches["torch"], [token, token])
        varlen = decode_step(loaded.model, caches["varlen"], [token, token])
        torch.testing.assert_close(varlen, padded, atol=5e-2, rtol=5e-2)
