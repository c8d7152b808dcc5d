"""GGUF loading on tiny synthetic files written by gguf.GGUFWriter: dequantization of every
supported ggml type against a hand-written block decoder (ggml's reference C, transcribed),
exact inversion of llama.cpp's Q/K row permutation, and logits of tiny llama / qwen2 GGUFs
with mixed tensor types against transformers' own GGUF loading of the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_checkpoints import (
    GGUFRecipe,
    Q,
    encode_tensor,
    gguf_weights,
    llama_recipe,
    tiny_hf_model,
    tiny_tokens,
)
from transformers import AutoModelForCausalLM

from services.model import load, read_checkpoint
from services.model.attention import causal_chunk_attention
from services.model.gguf_metadata import open_gguf
from services.model.gguf_tensors import SUPPORTED_TYPES, dequantize_tensor
from services.model.gguf_tokenizer import byte_level_bpe

torch.set_num_threads(1)
BLOCK_BYTES = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144, Q.Q6_K: 210}
# How far each type's stored values may sit from N(0, 1) inputs (K-quants hold random blocks).
ROUND_TRIP_ATOL = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2, Q.Q4_0: 0.5, Q.Q4_1: 0.5}
MIXED_TYPES = {
    "token_embd.weight": Q.Q8_0, "output.weight": Q.F16,
    "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_1, "blk.0.attn_v.weight": Q.BF16,
    "blk.0.attn_output.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q4_1,
    "blk.0.ffn_up.weight": Q.Q4_0, "blk.0.ffn_down.weight": Q.Q4_K,
    "blk.1.attn_q.weight": Q.BF16, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.F16,
    "blk.1.ffn_down.weight": Q.Q6_K,
}


def _f16(block: np.ndarray, at: int) -> float:
    return float(block[at : at + 2].view(np.float16)[0])


def _int8(values: np.ndarray) -> list[int]:
    return [int(v) - 256 if v > 127 else int(v) for v in values]


def _q8_0(b: np.ndarray) -> list[float]:
    d = _f16(b, 0)
    return [d * q for q in _int8(b[2:34])]


def _q4_0(b: np.ndarray) -> list[float]:
    d, qs = _f16(b, 0), [int(q) for q in b[2:18]]
    return [((q & 15) - 8) * d for q in qs] + [((q >> 4) - 8) * d for q in qs]


def _q4_1(b: np.ndarray) -> list[float]:
    d, m, qs = _f16(b, 0), _f16(b, 2), [int(q) for q in b[4:20]]
    return [(q & 15) * d + m for q in qs] + [(q >> 4) * d + m for q in qs]


def _q4_k(b: np.ndarray) -> list[float]:
    d, dmin, scales, qs = _f16(b, 0), _f16(b, 2), [int(s) for s in b[4:16]], b[16:144]

    def scale_min(j: int) -> tuple[int, int]:  # ggml get_scale_min_k4
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return ((scales[j + 4] & 15) | ((scales[j - 4] >> 6) << 4),
                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4))

    out: list[float] = []
    for chunk in range(4):  # 64 values: 32 low nibbles, then 32 high nibbles
        q = [int(x) for x in qs[32 * chunk : 32 * chunk + 32]]
        (s1, m1), (s2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        out += [d * s1 * (x & 15) - dmin * m1 for x in q]
        out += [d * s2 * (x >> 4) - dmin * m2 for x in q]
    return out


def _q6_k(b: np.ndarray) -> list[float]:
    ql, qh = [int(x) for x in b[:128]], [int(x) for x in b[128:192]]
    scales, d = _int8(b[192:208]), _f16(b, 208)
    out = [0.0] * 256
    for half in range(2):
        lo, hi, sc, base = ql[64 * half :], qh[32 * half :], scales[8 * half :], 128 * half
        for j in range(32):
            s = j // 16
            q1 = ((lo[j] & 15) | ((hi[j] & 3) << 4)) - 32
            q2 = ((lo[j + 32] & 15) | (((hi[j] >> 2) & 3) << 4)) - 32
            q3 = ((lo[j] >> 4) | (((hi[j] >> 4) & 3) << 4)) - 32
            q4 = ((lo[j + 32] >> 4) | (((hi[j] >> 6) & 3) << 4)) - 32
            out[base + j] = d * sc[s] * q1
            out[base + j + 32] = d * sc[s + 2] * q2
            out[base + j + 64] = d * sc[s + 4] * q3
            out[base + j + 96] = d * sc[s + 6] * q4
    return out


BLOCK_DECODERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}


def _reference_decode(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """Decode a stored row-major tensor by hand: floats by bit pattern, blocks one by one."""
    if qtype == Q.F32:
        return raw.view(np.float32).astype(np.float64)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float64)
    if qtype == Q.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    blocks = raw.reshape(-1).view(np.uint8).reshape(-1, BLOCK_BYTES[qtype])
    return np.array([v for block in blocks for v in BLOCK_DECODERS[qtype](block)])


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_a_hand_written_block_decoder(qtype, tmp_path):
    rng = np.random.default_rng(7)
    original = rng.standard_normal((3, 512)).astype(np.float32)  # 3 rows x 2 K-quant blocks
    recipe = GGUFRecipe("llama")
    stored = encode_tensor(original, qtype, rng)
    recipe.tensors["t"] = (stored.astype(np.float16) if qtype == Q.F16 else stored, qtype)
    tensor = open_gguf(recipe.write(tmp_path / "one.gguf")).tensors[0]
    assert tensor.tensor_type == qtype
    values = dequantize_tensor(tensor)
    assert values.shape == (3, 512) and values.dtype == np.float32 and values.flags.writeable
    expected = _reference_decode(np.asarray(tensor.data), qtype).reshape(3, 512)
    np.testing.assert_allclose(values, expected, rtol=1e-6, atol=1e-7)
    if qtype in ROUND_TRIP_ATOL:  # same orientation and scale as what was written
        np.testing.assert_allclose(values, original, rtol=0, atol=ROUND_TRIP_ATOL[qtype])


def _all_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits `[T, V]` at every position (one causal chunk per layer)."""
    def attention(_layer: int):
        return lambda q, k, v: causal_chunk_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), 0, None, model.scale
        )
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[0]), attention)


def _ids(length: int, seed: int) -> torch.Tensor:
    vocab = len(tiny_tokens()[0])
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def test_f32_gguf_restores_the_hf_weights_exactly(tmp_path):
    hf = tiny_hf_model("llama", seed=1)
    path = llama_recipe(hf.config, gguf_weights(hf.state_dict(), hf.config, permute=True)).write(
        tmp_path / "tiny-f32.gguf"
    )
    loaded = load(path)
    ours = loaded.model.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(ours[name], tensor), name  # the Q/K un-permutation is exact
    ids = _ids(48, seed=2)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    torch.testing.assert_close(_all_logits(loaded.model, ids), expected, atol=1e-5, rtol=1e-5)
    assert loaded.dtype == torch.float32 and not loaded.config.tie_word_embeddings


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_type_gguf_matches_transformers_gguf_loading(family, tmp_path):
    hf = tiny_hf_model(family, seed=3)
    weights = gguf_weights(hf.state_dict(), hf.config, permute=family == "llama")
    path = llama_recipe(hf.config, weights, MIXED_TYPES, architecture=family, seed=4).write(
        tmp_path / f"tiny-{family}.gguf"
    )
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    loaded = load(path)
    assert loaded.config.family == family and loaded.config.qkv_bias == (family == "qwen2")
    ids = _ids(64, seed=5)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    ours = _all_logits(loaded.model, ids)
    scale = expected.abs().max().item()
    torch.testing.assert_close(ours, expected, atol=1e-5 * max(scale, 1.0), rtol=1e-5)


def test_read_checkpoint_reports_the_gguf_metadata_without_weights(tmp_path):
    hf = tiny_hf_model("llama", seed=6)
    path = llama_recipe(hf.config, gguf_weights(hf.state_dict(), hf.config, True)).write(
        tmp_path / "meta.gguf"
    )
    info = read_checkpoint(path)
    tokens, _ = tiny_tokens()
    assert info.path == path and info.config.num_layers == 2 and info.config.head_dim == 16
    assert info.config.rope.theta == pytest.approx(hf.config.rope_parameters["rope_theta"])
    eos = (tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"))  # eos, then eot
    assert info.generation_config.eos_token_ids == eos
    assert info.generation_config.bos_token_id == tokens.index("<|im_start|>")
    tokenizer = info.require_tokenizer()
    assert tokenizer.add_bos is False and tokenizer.eos_token == "<|im_end|>"
    ids = {token: index for index, token in enumerate(tokens)}
    expected = [ids["<|im_start|>"], ids["Ġthe"], ids["Ġthe"]]
    assert tokenizer.encode("<|im_start|> the the") == expected
    assert tokenizer.encode("the") == [ids["t"], ids["he"]]  # no "t he" merge
    assert tokenizer.end_of_turn_ids() == (ids["<|im_end|>"],)


# What llama.cpp's split of each family does to digits, an upper-case contraction and
# punctuation before newlines (llama-vocab.cpp; the HF tokenizer.json of GPT-2, SmolLM, Llama 3
# and Qwen2 split the same way).
@pytest.mark.parametrize("pre, pieces", [
    ("default", ["12345", "ĠI", "'", "LL", "ĠĠ", "Ġx", "!!", "ĊĊ"]),
    ("smollm", ["1", "2", "3", "4", "5", "ĠI", "'", "LL", "ĠĠ", "Ġx", "!!", "ĊĊ"]),
    ("llama-bpe", ["123", "45", "ĠI", "'LL", "ĠĠ", "Ġx", "!!ĊĊ"]),
    ("qwen2", ["1", "2", "3", "4", "5", "ĠI", "'LL", "ĠĠ", "Ġx", "!!ĊĊ"]),
])
def test_pre_tokenizer_follows_tokenizer_ggml_pre(pre, pieces):
    tokens, types = tiny_tokens()
    backend = byte_level_bpe(tokens, [], types, pre=pre)
    split = backend.pre_tokenizer.pre_tokenize_str("12345 I'LL   x!!\n\n")
    assert [piece for piece, _ in split] == pieces


def test_gguf_loads_in_bfloat16_on_request(tmp_path):
    hf = tiny_hf_model("llama", seed=8)
    path = llama_recipe(hf.config, gguf_weights(hf.state_dict(), hf.config, True)).write(
        tmp_path / "bf16.gguf"
    )
    fp32, bf16 = load(path), load(path, dtype="bfloat16")
    assert bf16.dtype == torch.bfloat16 and bf16.tensor_contract.k_dtype.value == "bfloat16"
    ids = _ids(32, seed=9)
    torch.testing.assert_close(_all_logits(bf16.model, ids), _all_logits(fp32.model, ids),
                               atol=5e-2, rtol=5e-2)
