"""Agreement with NVIDIA kvpress: on a tiny random Llama (transformers, fp32) a kvrelay manifest
stating SnapKVPress's rule keeps exactly the prompt rows kvpress keeps, per (layer, K/V head);
kvrelay's default `snapkv` keeps a superset of SnapKVPress's rows at the same window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eval_helpers import TINY_NEEDLE_LLAMA

from services.demo import needle
from services.evaluation.kvpress_agreement import (
    KVPRESS_DEFAULT_WINDOW,
    agreement_markdown,
    measure_agreement,
)

kvpress = pytest.importorskip("kvpress", reason="kvpress is not installed (kvpress==0.5.5)")

PROMPT_LEN = 320  # kvpress keeps floor(320 x 0.25) = 80 rows per head, above its 64-row window


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init transformers Llama saved with `save_pretrained`, plus the needle tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "bos_token_id", "eos_token_id")
    model = LlamaForCausalLM(LlamaConfig(**{k: TINY_NEEDLE_LLAMA[k] for k in keys})).eval()
    directory = tmp_path_factory.mktemp("hf-llama")
    model.save_pretrained(directory)
    needle.build_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def test_manifest_with_kvpress_rule_keeps_exactly_kvpress_rows(hf_checkpoint: Path) -> None:
    results = {r.case: r for r in measure_agreement(hf_checkpoint, (PROMPT_LEN,))}
    exact = results["exact rule"]
    assert exact.kvpress_window == KVPRESS_DEFAULT_WINDOW
    assert torch.equal(exact.kvpress_rows, torch.full_like(exact.kvpress_rows, PROMPT_LEN // 4))
    assert torch.equal(exact.kvrelay_rows, exact.kvpress_rows)
    assert torch.equal(exact.overlap, torch.ones_like(exact.overlap))

    same_window = results["default/16"]
    assert torch.equal(same_window.overlap, torch.ones_like(same_window.overlap))
    assert bool((same_window.kvrelay_rows >= same_window.kvpress_rows).all())

    other_window = results[f"default/{KVPRESS_DEFAULT_WINDOW}"]
    assert float(other_window.overlap.mean()) < 1.0  # 16 vs 64 voting queries: different rows
    text = agreement_markdown(list(results.values()))
    assert "| exact rule | 320 | 64 |" in text and "100.0% | 100.0% |" in text
