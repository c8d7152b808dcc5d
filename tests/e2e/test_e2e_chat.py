"""Chat with the real SmolLM2-135M-Instruct GGUF through the whole stack (gateway -> prefill ->
gloo transfer -> decode, one process each): the gateway renders the conversation with the
checkpoint's ChatML template, greedy decoding answers the question and stops at the end of
its turn (not at max_tokens), the streamed deltas add up to the decoding of the streamed ids,
`kvrelay chat` holds a two-turn conversation over stdin, and bad messages are refused naming
the field while the gateway keeps serving."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_helpers import E2E_ENV, KVRELAY

from services.gateway.client import GatewayClient, chat_messages, generate_request
from services.launcher.stack import Stack, StackConfig
from services.model.default import default_checkpoint
from services.model.loader import read_checkpoint
from services.model.tokenizer import ChatMessage, TextTokenizer
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.timeout(240)
QUESTION = "What is the capital of France?"
MAX_TOKENS = 48  # the greedy answer ends its turn after 8


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return default_checkpoint()


@pytest.fixture(scope="module")
def smol_stack(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    config = StackConfig.with_free_ports(smollm2, log_dir=tmp_path_factory.mktemp("chat-logs"),
                                         env=tuple(E2E_ENV.items()))
    with Stack(config) as stack:
        yield stack


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> TextTokenizer:
    return read_checkpoint(smollm2).require_tokenizer()


def ask(stack: Stack, turns: list[tuple[str, str]]) -> tuple[list[gateway_pb2.GenerateEvent], str]:
    request = generate_request(chat_messages(turns), policy="full", max_tokens=MAX_TOKENS)
    with GatewayClient(stack.gateway_address, timeout_s=120) as client:
        events = list(client.stream(request))
    return events, "".join(e.token.text for e in events if e.HasField("token"))


def test_greedy_chat_answers_and_stops_at_the_end_of_its_turn(smol_stack: Stack, tokenizer: TextTokenizer) -> None:
    events, text = ask(smol_stack, [("user", QUESTION)])
    summary = events[-1].summary
    ids = [e.token.token_id for e in events[:-1]]
    print(f"answer {text!r}: ttft {summary.ttft_ms:.1f} ms, tpot {summary.tpot_ms:.1f} ms, "
          f"{summary.output_tokens} tokens")
    assert "Paris" in text
    assert summary.finish_reason == common_pb2.FINISH_REASON_STOP and summary.output_tokens < MAX_TOKENS
    assert ids[-1] in tokenizer.end_of_turn_ids() and events[-2].token.text == ""  # sent, as no text
    assert text == tokenizer.decode(ids)  # the deltas add up to the whole decoding
    assert summary.prompt_tokens == len(tokenizer.encode_chat([ChatMessage("user", QUESTION)]))


def test_bad_messages_are_refused_naming_the_field_and_the_gateway_keeps_serving(smol_stack: Stack) -> None:
    bad = [
        ([("system", "Be brief."), ("narrator", QUESTION)], "chat.messages[1].role"),
        ([("user", QUESTION), ("assistant", " \n ")], "chat.messages[1].content"),
        ([], "chat.messages"),
    ]
    with GatewayClient(smol_stack.gateway_address, timeout_s=30) as client:
        for turns, field in bad:
            with pytest.raises(grpc.RpcError) as caught:
                client.generate(generate_request(chat_messages(turns), policy="full", max_tokens=4))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            detail = error_detail(caught.value)  # type: ignore[arg-type]
            assert detail is not None and detail.field == field
    events, text = ask(smol_stack, [("user", QUESTION)])
    assert "Paris" in text


def test_kvrelay_chat_holds_a_two_turn_conversation(smol_stack: Stack) -> None:
    turns = f"{QUESTION}\nAnd what is the capital of Italy?\n"
    done = subprocess.run(
        [*KVRELAY, "chat", "--policy", "full", "--max-tokens", str(MAX_TOKENS), "--summary",
         "--gateway", smol_stack.gateway_address],
        input=turns, capture_output=True, text=True, timeout=120, env={**os.environ, **E2E_ENV},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    replies = [line for line in done.stdout.splitlines() if "assistant> " in line]
    print(done.stdout)
    assert len(replies) == 2
    assert "Paris" in replies[0] and "Rome" in replies[1]
    assert done.stdout.count(" · stop · ") == 2  # each turn's summary line: it ended its turn


def test_kvrelay_generate_sends_the_prompt_as_a_chat(smol_stack: Stack) -> None:
    done = subprocess.run(
        [*KVRELAY, "generate", QUESTION, "--system", "Be brief.", "--policy", "full",
         "--max-tokens", str(MAX_TOKENS), "--gateway", smol_stack.gateway_address],
        capture_output=True, text=True, timeout=120, env={**os.environ, **E2E_ENV},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    answer, table = done.stdout.split("summary", 1)
    assert "Paris" in answer
    assert "finish" in table and " stop " in table
