"""Helpers of the evaluation tests (imported by basename): tiny checkpoints that speak the needle
language (random, or with one head built to copy the code), and a dense masked decode reference."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.demo import needle
from services.kvpolicy.state import PositionGrid
from services.model import LoadedModel, PrefillResult
from services.model.config import parse_model_config
from services.model.model import CausalLM

VOCAB = len(needle.vocabulary())
TINY_NEEDLE_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
COPY_LAYER, COPY_HEAD = 0, 1  # the query head built to copy (it reads K/V head 0)


def write_needle_checkpoint(
    directory: Path, seed: int = 0, weights: dict[str, torch.Tensor] | None = None
) -> Path:
    """A 2-layer GQA Llama (H_q 4, H_kv 2, d_h 16) over the needle vocabulary with random
    weights (or `weights`), as config.json + model.safetensors + tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(weights or random_weights(seed), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TINY_NEEDLE_LLAMA))
    needle.build_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def random_weights(seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        model = CausalLM(parse_model_config(TINY_NEEDLE_LLAMA))
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in model.state_dict().items():
        noise = torch.randn(param.shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if name.endswith("norm.weight") else scale * noise
    return weights


def copy_head_weights(seed: int, strength: float = 2.0) -> dict[str, torch.Tensor]:
    """Small random weights plus one retrieval head: query head COPY_HEAD of layer COPY_LAYER
    attends from every token to the code tokens (numbers) and to nothing else.

    Embedding feature 0 flags a code token, feature 1 is on for every token. The head's query
    reads feature 1 and its K/V head's key reads feature 0, both into the lowest-frequency RoPE
    pair (dims 7 and 15 of 16), whose rotation over a few hundred tokens is negligible: the
    logit of a code key is about strength^2 x 10 above any other key.
    """
    weights = random_weights(seed, scale=0.02)
    vocabulary = needle.vocabulary()
    codes = [vocabulary.index(code) for code in needle.CODES]
    embed = weights["model.embed_tokens.weight"]  # [V, D]
    embed[:, 0] = 0.0
    embed[codes, 0] = 1.0
    embed[:, 1] = 1.0
    head_dim = TINY_NEEDLE_LLAMA["head_dim"]
    group = TINY_NEEDLE_LLAMA["num_attention_heads"] // TINY_NEEDLE_LLAMA["num_key_value_heads"]
    prefix = f"model.layers.{COPY_LAYER}."
    weights[prefix + "input_layernorm.weight"] = torch.ones(TINY_NEEDLE_LLAMA["hidden_size"])
    q_rows = slice(COPY_HEAD * head_dim, (COPY_HEAD + 1) * head_dim)
    kv_rows = slice((COPY_HEAD // group) * head_dim, (COPY_HEAD // group + 1) * head_dim)
    weights[prefix + "self_attn.q_proj.weight"][q_rows] = 0.0
    weights[prefix + "self_attn.k_proj.weight"][kv_rows] = 0.0
    low = head_dim // 2 - 1
    for other in range((COPY_HEAD // group) * group, (COPY_HEAD // group + 1) * group):
        # the group's other query heads must not read the code feature from the shared key
        for dim in (low, low + head_dim // 2):
            weights[prefix + "self_attn.q_proj.weight"][other * head_dim + dim] = 0.0
    weights[prefix + "self_attn.q_proj.weight"][q_rows.start + low, 1] = strength
    weights[prefix + "self_attn.k_proj.weight"][kv_rows.start + low, 0] = strength
    return weights


class MaskedDenseDecode:
    """Decode one request over every K/V row of the prompt, hiding the rows a selection
    omitted with an additive -inf mask per (layer, owner); new rows are visible to all.
    Query heads are walked one by one (no grouped reshape), so it shares no attention code
    with the runtime's ragged decode."""

    def __init__(
        self,
        loaded: LoadedModel,
        result: PrefillResult,
        selected: PositionGrid,
        owner_of_query_head: Sequence[int],
    ) -> None:
        self.model, self.config = loaded.model, loaded.config
        self.owner_of = list(owner_of_query_head)
        self.keys = [result.source_k[layer].clone() for layer in range(self.config.num_layers)]
        self.values = [result.source_v[layer].clone() for layer in range(self.config.num_layers)]
        self.visible = []  # per layer: bool [H_owner, S]
        for per_layer in selected:
            mask = torch.zeros(len(per_layer), result.prompt_length, dtype=torch.bool)
            for owner, positions in enumerate(per_layer):
                mask[owner, list(positions)] = True
            self.visible.append(mask)
        self.position = result.prompt_length

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Feed one token at the next position; logits `[V]`."""
        logits = self.model(torch.tensor([token]), torch.tensor([self.position]), self._attend)
        self.position += 1
        return logits[0]

    def _attend(self, layer: int):  # noqa: ANN202 - returns the runtime's Attend
        kv_of_query = self.config.q_to_kv_head_map

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q [1, H_q, d_h]; k, v [1, H_kv, d_h]
            self.keys[layer] = torch.cat([self.keys[layer], k[0][:, None]], dim=1)
            self.values[layer] = torch.cat([self.values[layer], v[0][:, None]], dim=1)
            visible = self.visible[layer]
            self.visible[layer] = torch.cat(
                [visible, torch.ones(visible.shape[0], 1, dtype=torch.bool)], dim=1
            )
            heads = []
            for head in range(q.shape[1]):
                keys = self.keys[layer][kv_of_query[head]]  # [S, d_h]
                values = self.values[layer][kv_of_query[head]]
                shown = self.visible[layer][self.owner_of[head]]  # [S]
                logits = (keys.float() @ q[0, head].float()) * self.model.scale
                probs = torch.softmax(logits.masked_fill(~shown, float("-inf")), dim=0)
                heads.append(probs @ values.float())
            return torch.stack(heads)[None].to(q.dtype)

        return attend


def needle_prompt_ids(loaded: LoadedModel, length: int, seed: int) -> list[int]:
    """Token ids of a needle prompt of `length` tokens (question at the end, cue included)."""
    prompt = needle.build_prompt(length, 0.5, needle.Placement.END, seed=seed, distractors=1)
    return loaded.require_tokenizer().encode(prompt.text)
