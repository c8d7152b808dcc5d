"""Fixtures of the gateway tests: a real policy service on the shared `redis_server`, and a served
checkpoint directory holding what the gateway reads (config.json, tokenizer.json; no weights)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from policy_service.config import PolicyServiceConfig
from policy_service.server import PolicyServer
from services.model import needle
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


@pytest.fixture
async def policy_server(redis_server: EmbeddedRedis) -> AsyncIterator[PolicyServer]:
    config = PolicyServiceConfig(
        server=ServerConfig(port=0, shutdown_grace_s=0.2), redis_url=redis_server.url,
        key_prefix=f"g{uuid.uuid4().hex[:12]}:",
    )
    server = await PolicyServer.start(config)
    yield server
    await server.stop(0)
