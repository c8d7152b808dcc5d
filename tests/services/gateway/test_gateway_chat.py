"""Chat prompts: every bad field of a conversation is named; a good one is rendered with the
checkpoint's chat template into exactly the ids transformers' `apply_chat_template` gives for
the bundled SmolLM2 GGUF, and its generation also stops at the template's end-of-turn token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.demo import needle
from services.gateway.client import ChatHistory, chat_messages, generate_request
from services.gateway.validation import ChatUnsupported, RequestLimits, validate_request
from services.model.tokenizer import ChatMessage, TextTokenizer
from services.rpc.errors import InvalidArgument, status_for
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2
from services.transfer.codec import sampling_to_proto

LIMITS = RequestLimits(vocab_size=49152, context_length=8192, max_prompt_tokens=512, max_tokens_limit=256,
                       default_max_tokens=64, max_chat_messages=8)
IM_END = 2  # SmolLM2's `<|im_end|>`: EOS of the model and end of every ChatML turn

Turns = list[tuple[str, str]]
CONVERSATIONS: list[Turns] = [
    [("user", "What is the capital of France?")],
    [("system", "Answer in one word."), ("user", "What is the capital of France?")],
    [("user", "Hi!"), ("assistant", "Hello! How can I help?"), ("user", "Say  two\n\nlines,  please.")],
    [("system", "Tu es un assistant."), ("user", "Où est la tour Eiffel ? 東京は？ 😀👍🏽🇫🇷")],
    [("user", "  leading and trailing spaces  "), ("assistant", "ok\n"), ("user", "\tand a tab")],
]


def chat_request(turns: Turns, **fields: Any) -> gateway_pb2.GenerateRequest:
    return generate_request(chat_messages(turns), request_id="chat-1", **fields)


def hf_ids(hf_tokenizer: Any, turns: Turns) -> list[int]:
    messages = [{"role": role, "content": content} for role, content in turns]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


@pytest.mark.parametrize("turns", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_chat_is_rendered_like_transformers(
    turns: Turns, smollm2_tokenizer: TextTokenizer, hf_smollm2_tokenizer: Any
) -> None:
    result = validate_request(chat_request(turns), LIMITS, smollm2_tokenizer)
    assert list(result.prompt_ids) == hf_ids(hf_smollm2_tokenizer, turns)
    rendered = smollm2_tokenizer.decode(result.prompt_ids, skip_special_tokens=False)
    assert rendered.endswith("<|im_start|>assistant\n")  # the prompt of the assistant's turn
    assert rendered.count("<|im_start|>system\n") == 1  # the template's default system message


# Any Unicode text (no surrogates or control characters but newlines and tabs), with the pieces
# that stress a byte-level BPE overrepresented: CJK, emoji sequences, runs of spaces and newlines.
PIECES = st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")) | st.sampled_from(
    ["東京", "😀", "👨‍👩‍👧", "👍🏽", " ", "   ", "\n", "\n\n", "\t", "é", " Paris"])
TEXTS = st.lists(PIECES, min_size=1, max_size=30).map("".join).filter(str.strip)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=TEXTS)
def test_any_user_text_is_rendered_like_transformers(
    content: str, smollm2_tokenizer: TextTokenizer, hf_smollm2_tokenizer: Any,
    hf_smollm2_llamacpp_tokenizer: Any,
) -> None:
    turns = [("system", "Be brief."), ("user", content)]
    result = validate_request(chat_request(turns), LIMITS, smollm2_tokenizer)
    messages = [{"role": role, "content": text} for role, text in turns]
    rendered = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert smollm2_tokenizer.render_chat([ChatMessage(r, t) for r, t in turns]) == rendered
    assert list(result.prompt_ids) == hf_ids(hf_smollm2_llamacpp_tokenizer, turns)


def test_digits_after_whitespace_follow_the_declared_pre_tokenizer(
    smollm2_tokenizer: TextTokenizer, hf_smollm2_tokenizer: Any, hf_smollm2_llamacpp_tokenizer: Any
) -> None:
    """The one known divergence from transformers' GGUF tokenizer (see the fixture's docstring)."""
    text = "Room\n 0 and\t7"
    ours = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert ours == hf_smollm2_llamacpp_tokenizer.encode(text, add_special_tokens=False)
    assert ours != hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert smollm2_tokenizer.decode(ours) == text


def test_chat_requests_also_stop_at_the_end_of_turn(smollm2_tokenizer: TextTokenizer) -> None:
    assert smollm2_tokenizer.end_of_turn_ids() == (IM_END,)
    turns = CONVERSATIONS[0]
    default = validate_request(chat_request(turns), LIMITS, smollm2_tokenizer)
    assert default.sampling.stop_token_ids == (IM_END,) and default.max_tokens == LIMITS.default_max_tokens
    mine = validate_request(chat_request(turns, max_tokens=8, stop_token_ids=[13, IM_END, 30]), LIMITS,
                            smollm2_tokenizer).sampling
    assert mine.stop_token_ids == (13, IM_END, 30)  # the client's own, once each
    theirs = validate_request(chat_request(turns, max_tokens=8, stop_token_ids=[13]), LIMITS, smollm2_tokenizer)
    sent = sampling_to_proto(theirs.sampling, theirs.max_tokens)  # what the workers get
    assert sent.stop_token_ids == [13, IM_END]
    text = validate_request(generate_request("The capital of France is", request_id="t-1"), LIMITS,
                            smollm2_tokenizer)
    assert text.sampling.stop_token_ids == ()  # raw text is not a turn


def test_chat_history_keeps_turns_and_skips_empty_replies() -> None:
    history = ChatHistory(system="Be brief.")
    history.record("Hi", "Hello!")
    history.record("Say nothing", "  ")
    prompt = history.prompt("Bye")
    assert [(m.role, m.content) for m in prompt.messages] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "Say nothing"), ("user", "Bye"),
    ]
    history.reset()
    assert [(m.role, m.content) for m in history.prompt("Again").messages] == [
        ("system", "Be brief."), ("user", "Again"),
    ]


BAD: list[tuple[str, Turns, str]] = [
    ("no messages", [], "chat.messages"),
    ("too many messages", [("user", "hi"), ("assistant", "hello")] * 4 + [("user", "again")], "chat.messages"),
    ("unknown role", [("system", "s"), ("user", "u"), ("assistant", "a"), ("narrator", "n")], "chat.messages[3].role"),
    ("empty role", [("", "hello")], "chat.messages[0].role"),
    ("role in capitals", [("user", "hi"), ("User", "hello")], "chat.messages[1].role"),
    ("tool role", [("tool", "{}")], "chat.messages[0].role"),
    ("empty content", [("system", "s"), ("user", "")], "chat.messages[1].content"),
    ("blank content", [("user", " \n\t ")], "chat.messages[0].content"),
    ("huge content", [("user", "x" * 20000), ("user", "y" * 20000)], "chat.messages"),
    ("too many tokens", [("user", " ".join(["word"] * 600))], "chat"),
]


@pytest.mark.parametrize(("case", "turns", "field"), BAD, ids=[case for case, _, _ in BAD])
def test_bad_chat_field_is_named(case: str, turns: Turns, field: str, smollm2_tokenizer: TextTokenizer) -> None:
    with pytest.raises(InvalidArgument) as caught:
        validate_request(chat_request(turns), LIMITS, smollm2_tokenizer)
    assert caught.value.field == field, case
    assert status_for(caught.value).code == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[union-attr]


def test_a_bad_message_is_named_even_past_good_ones(smollm2_tokenizer: TextTokenizer) -> None:
    turns = [("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"), ("user", "  ")]
    with pytest.raises(InvalidArgument) as caught:
        validate_request(chat_request(turns), LIMITS, smollm2_tokenizer)
    assert caught.value.field == "chat.messages[4].content"


def test_a_checkpoint_without_a_chat_template_refuses_chat_but_serves_text(tmp_path: Path) -> None:
    plain = TextTokenizer(backend=needle.build_tokenizer(), path=tmp_path / "tokenizer.json")
    limits = RequestLimits(vocab_size=len(needle.vocabulary()), context_length=256, max_prompt_tokens=200,
                           max_tokens_limit=32, default_max_tokens=8)
    with pytest.raises(ChatUnsupported) as caught:
        validate_request(chat_request(CONVERSATIONS[0]), limits, plain)
    status = status_for(caught.value)
    assert status is not None and status.code == grpc.StatusCode.FAILED_PRECONDITION
    assert status.detail.field == "chat" and "no chat template" in status.detail.message
    assert status.detail.reason == common_pb2.ERROR_REASON_REQUEST_INVALID
    text = validate_request(generate_request("the code of alice", request_id="t-2"), limits, plain)
    assert text.prompt_ids == tuple(plain.encode("the code of alice"))


def test_a_template_that_rejects_the_conversation_names_the_chat(tmp_path: Path) -> None:
    strict = TextTokenizer(
        backend=needle.build_tokenizer(), path=tmp_path / "tokenizer.json",
        chat_template="{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn must be the user') }}"
                      "{% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    limits = RequestLimits(vocab_size=len(needle.vocabulary()), context_length=256, max_prompt_tokens=200,
                           max_tokens_limit=32, default_max_tokens=8)
    with pytest.raises(InvalidArgument) as caught:
        validate_request(chat_request([("assistant", "alice"), ("user", "the code")]), limits, strict)
    assert caught.value.field == "chat" and "first turn must be the user" in caught.value.message
    fine = validate_request(chat_request([("user", "the code of alice")]), limits, strict)
    assert fine.prompt_ids == tuple(strict.encode("the code of alice ", add_special_tokens=False))
