"""What decode-time retention needs from the paged store (issue 18): each step's attention
probabilities over every candidate row of every owner, reduced over the owner's query heads,
exact against a dense masked softmax over the rows the owner holds; no change to any output;
and cache-local positions (keys pre-RoPE, rotated to their slot at attention time) against a
dense reference that stores pre-RoPE keys and evicts the same rows."""

from __future__ import annotations

import pytest
import torch

from services.kvpolicy.packing import pack
from services.model import DecodeCache, StepCapture, decode_step, prefill
from services.model.config import parse_model_config
from services.model.errors import InvalidModelInput
from services.model.layers import apply_rotary, rotate
from services.model.model import CausalLM
from services.model.row_attention import RowContract

torch.set_num_threads(1)
LAYERS, Q_HEADS, KV_HEADS, D_H, ROWS = 2, 4, 2, 8, 4


def tiny_config(**overrides: object):
    return parse_model_config({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40,
        "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": LAYERS,
        "num_attention_heads": Q_HEADS, "num_key_value_heads": KV_HEADS, "head_dim": D_H,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "float32", **overrides,
    })


def random_kv(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYERS, KV_HEADS, length, D_H)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def dense_probs(q, keys, positions, hidden_before, scale, reduce):
    """Softmax of each query head over its owner's explicit rows, masked by the window, reduced
    over the owner's heads. q [H_q, d]; keys[h] [n, d] -> list of [n]."""
    group = q.shape[0] // len(keys)
    out = []
    for h, k in enumerate(keys):
        per_head = []
        for g in range(group):
            logits = (k @ q[h * group + g]) * scale
            if hidden_before is not None:
                logits[positions[h] <= hidden_before] = float("-inf")
            per_head.append(torch.softmax(logits, 0))
        stacked = torch.stack(per_head)
        out.append({"mean": stacked.mean(0), "max": stacked.amax(0), "sum": stacked.sum(0)}[reduce])
    return out


@pytest.mark.parametrize("reduce", ["mean", "max"])
@pytest.mark.parametrize("window", [None, 6])
def test_captured_attention_is_the_dense_softmax_over_every_candidate_row(reduce, window):
    extra = {} if window is None else dict(
        sliding_window=window, use_sliding_window=True, max_window_layers=0,
        model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    config = tiny_config(**extra)
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = random_kv(12)
    selected = [[[3], [0, 2, 5, 7, 9]], [[0, 1, 2, 4, 6, 8, 10], list(range(12))]]  # uneven
    view = pack(keys, values, selected)
    watched, plain = DecodeCache(config, torch.float32, page_rows=ROWS), DecodeCache(
        config, torch.float32, page_rows=ROWS)
    for cache in (watched, plain):
        cache.admit_dense("full", keys, values)
    watched.admit_view("w", view, frontier=12, contract=RowContract(capture=reduce))
    plain.admit_view("w", view, frontier=12)
    for token in (3, 4, 5, 6, 7):
        capture = StepCapture()
        logits = decode_step(model, watched, [token, token + 1], capture)
        # The request that captures gets the paged kernel's output, and so does the other one.
        torch.testing.assert_close(logits, decode_step(model, plain, [token, token + 1]),
                                   atol=1e-5, rtol=1e-5)
        seen = watched.step_attention("w")
        frontier = int(watched.frontier()[1]) - 1  # the step's own position
        for layer in range(LAYERS):
            rows = [watched.rows("w", layer, h) for h in range(KV_HEADS)]
            layer_window = config.sliding_windows[layer]
            hidden = None if layer_window is None else frontier - layer_window
            expected = dense_probs(capture.queries[layer][1], [r[0] for r in rows],
                                   [r[2] for r in rows], hidden, watched.scale, reduce)
            for h in range(KV_HEADS):
                assert seen.owner(layer, h).shape == (len(rows[h][2]),)
                torch.testing.assert_close(seen.owner(layer, h), expected[h], atol=1e-6,
                                           rtol=1e-5)
    with pytest.raises(InvalidModelInput, match="capture"):
        watched.step_attention("full")  # its contract captures nothing


def test_capture_with_expanded_owners_reads_one_query_head_per_owner():
    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    owners = config.q_to_kv_head_map
    keys, values = random_kv(9, seed=3)
    cache = DecodeCache(config, torch.float32, page_rows=ROWS, owner_to_kv_head=owners)
    selected = [[list(range(0, 9, 1 + h)) for h in range(Q_HEADS)] for _ in range(LAYERS)]
    cache.admit_view("e", pack(keys, values, selected, owners), frontier=9,
                     contract=RowContract(capture="sum"))
    capture = StepCapture()
    decode_step(model, cache, [5], capture)
    seen = cache.step_attention("e")
    for layer in range(LAYERS):
        rows = [cache.rows("e", layer, h)[0] for h in range(Q_HEADS)]
        expected = dense_probs(capture.queries[layer][0], rows, None, None, cache.scale, "sum")
        for h in range(Q_HEADS):
            torch.testing.assert_close(seen.owner(layer, h), expected[h], atol=1e-6, rtol=1e-5)
            assert abs(float(seen.owner(layer, h).sum()) - 1.0) < 1e-5  # one head: a softmax


def test_rotate_matches_the_models_rotation_and_undoes_it():
    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, KV_HEADS, D_H, generator=generator)
    positions = torch.tensor([0, 3, 7, 20, 64])
    cos, sin = model.rope(positions, x.dtype)
    assert torch.equal(rotate(x, positions, model.rotary), apply_rotary(x, cos, sin))
    per_head = positions[:, None].expand(-1, KV_HEADS)
    assert torch.equal(rotate(x, per_head, model.rotary), apply_rotary(x, cos, sin))
    back = rotate(rotate(x, positions, model.rotary), -positions, model.rotary)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    assert torch.equal(rotate(x, torch.zeros(5, dtype=torch.long), model.rotary), x)


class PreRopeReference:
    """A dense decode with StreamingLLM's positions, independent of the paged store: per
    (layer, K/V head) lists of pre-RoPE keys; at each step the resident rows are rotated to
    slots 0..n-1 (with the model's own cos/sin tables) and the query to slot n-1."""

    def __init__(self, model: CausalLM, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.model = model
        length = keys.shape[2]
        cos, sin = model.rope(torch.arange(length), keys.dtype)
        # Prompt keys arrive post-RoPE; the reference un-rotates them with -sin.
        pre = [apply_rotary(keys[layer].transpose(0, 1), cos, -sin).transpose(0, 1)
               for layer in range(keys.shape[0])]  # [H, T, d]
        self.keys = [[pre[layer][h] for h in range(KV_HEADS)] for layer in range(LAYERS)]
        self.values = [[values[layer, h] for h in range(KV_HEADS)] for layer in range(LAYERS)]

    def step(self, token: int) -> torch.Tensor:
        return self.model(torch.tensor([token]), torch.tensor([0]), self.attend)

    def attend(self, layer: int):
        def run(q, k, v):  # q [1, H_q, d] pre-RoPE at position 0 (identity); k, v [1, H_kv, d]
            out = torch.empty_like(q)
            group = Q_HEADS // KV_HEADS
            for h in range(KV_HEADS):
                self.keys[layer][h] = torch.cat([self.keys[layer][h], k[0, h][None]])
                self.values[layer][h] = torch.cat([self.values[layer][h], v[0, h][None]])
                n = self.keys[layer][h].shape[0]
                cos, sin = self.model.rope(torch.arange(n), q.dtype)
                rotated = apply_rotary(self.keys[layer][h][:, None], cos, sin)[:, 0]  # [n, d]
                qcos, qsin = cos[n - 1:], sin[n - 1:]
                for g in range(group):
                    query = apply_rotary(q[:, h * group + g][:, None], qcos, qsin)[0, 0]
                    weights = torch.softmax(rotated @ query * self.model.scale, 0)
                    out[0, h * group + g] = weights @ self.values[layer][h]
            return out
        return run

    def evict(self, sinks: int, budget: int) -> None:
        for layer in range(LAYERS):
            for h in range(KV_HEADS):
                n = self.keys[layer][h].shape[0]
                if n > budget:
                    keep = list(range(sinks)) + list(range(n - budget + sinks, n))
                    self.keys[layer][h] = self.keys[layer][h][keep]
                    self.values[layer][h] = self.values[layer][h][keep]


def test_cache_local_decode_equals_a_dense_pre_rope_reference_past_the_trained_context():
    config = tiny_config(max_position_embeddings=16)
    model = CausalLM(config).eval().requires_grad_(False)
    prompt = torch.tensor([1, 5, 9, 2, 7, 3, 11, 4])
    result = prefill(model, prompt)
    sinks, budget = 2, 6
    cache = DecodeCache(config, torch.float32, page_rows=ROWS)
    cache.admit_dense("s", result.source_k, result.source_v,
                      contract=RowContract(positions="cache_local"))
    reference = PreRopeReference(model, result.source_k, result.source_v)
    token = int(result.logits.argmax())
    for step in range(20):  # frontier 8 -> 28: past the 16 positions the config declares
        logits = decode_step(model, cache, [token])
        torch.testing.assert_close(logits[0], reference.step(token)[0], atol=1e-4, rtol=1e-4)
        for layer in range(LAYERS):
            for h in range(KV_HEADS):
                n = int(cache.lengths("s")[layer, h])
                drop = torch.zeros(n, dtype=torch.bool)
                if n > budget:
                    drop[sinks: n - budget + sinks] = True
                    cache.drop_rows("s", layer, h, drop)
                assert int(cache.lengths("s")[layer, h]) <= budget
        reference.evict(sinks, budget)
        _, _, positions = cache.rows("s", 0, 0)
        frontier = 8 + step + 1  # the prompt (8) is over budget at the first step already
        assert positions.tolist() == [0, 1, *range(frontier - budget + sinks, frontier)]
        token = int(logits[0].argmax())


def test_dropping_every_owners_rows_at_once_equals_dropping_them_one_by_one():
    config = tiny_config()
    model = CausalLM(config).eval().requires_grad_(False)
    keys, values = random_kv(14, seed=4)
    selected = [[list(range(14)), [1, 4, 6, 9, 13]], [[0, 2, 3, 5, 7, 8, 10, 12, 13], [13]]]
    one, many = (DecodeCache(config, torch.float32, page_rows=ROWS) for _ in range(2))
    for cache in (one, many):
        cache.admit_view("r", pack(keys, values, selected), frontier=14)
        decode_step(model, cache, [3])
    generator = torch.Generator().manual_seed(9)
    lengths = one.lengths("r")
    drop = torch.zeros(LAYERS, KV_HEADS, 17, dtype=torch.bool)  # wider than any owner
    for layer in range(LAYERS):
        for h in range(KV_HEADS):
            n = int(lengths[layer, h])
            drop[layer, h, :n] = torch.rand(n, generator=generator) < 0.5
            drop[layer, h, n - 1] = False  # every owner keeps its newest row
    freed = sum(one.drop_rows("r", layer, h, drop[layer, h, : int(lengths[layer, h])])
                for layer in range(LAYERS) for h in range(KV_HEADS)
                if bool(drop[layer, h].any()))
    assert many.drop_owner_rows("r", drop) == freed > 0
    assert one.pool.pages_in_use == many.pool.pages_in_use and one.ledger() == many.ledger()
    for layer in range(LAYERS):
        for h in range(KV_HEADS):
            for a, b in zip(one.rows("r", layer, h), many.rows("r", layer, h), strict=True):
                assert torch.equal(a, b)
    torch.testing.assert_close(decode_step(model, one, [4]), decode_step(model, many, [4]))
    many.admit_dense("other", keys, values)  # the layout is each request's own
    assert (many.ledger("r").layout, many.ledger("other").layout) == ("compacted", "ragged")
    with pytest.raises(InvalidModelInput, match="drop"):
        many.drop_owner_rows("r", torch.ones(LAYERS, KV_HEADS, 17, dtype=torch.bool))
