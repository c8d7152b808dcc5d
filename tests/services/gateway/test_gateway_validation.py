"""Every bad field of a GenerateRequest is rejected with INVALID_ARGUMENT naming it; good
requests come out as a typed GenerationInput with defaults filled in."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from services.demo import needle
from services.gateway.validation import (
    GenerationInput,
    ManifestChoice,
    RequestLimits,
    check_prompt_size,
    validate_request,
)
from services.model.sampler import SamplingParams
from services.model.tokenizer import TextTokenizer
from services.rpc.errors import InvalidArgument
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2
from services.transfer.codec import sampling_to_proto

LIMITS = RequestLimits(vocab_size=50, context_length=64, max_prompt_tokens=40, max_tokens_limit=32,
                       default_max_tokens=16)
SHA = "ab" * 32


# The needle vocabulary: BOS, then one id per word (words it lacks are <unk> = 3, so every id
# of these tests' texts is < 50).
TOKENIZER = TextTokenizer(backend=needle.build_tokenizer(), path=Path("needle/tokenizer.json"))


def valid(**overrides: object) -> gateway_pb2.GenerateRequest:
    fields: dict[str, object] = {"request_id": "req-1", "token_ids": gateway_pb2.TokenIds(ids=[1, 2, 3])}
    fields.update(overrides)
    return gateway_pb2.GenerateRequest(**fields)


def check(request: gateway_pb2.GenerateRequest) -> GenerationInput:
    return validate_request(request, LIMITS, TOKENIZER, new_request_id=lambda: "assigned-1")


def sampling(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_tokens": 4, **fields})


def test_text_prompt_is_tokenized_and_defaults_fill_in() -> None:
    result = check(gateway_pb2.GenerateRequest(text="the code of bb", detokenize=True))
    assert result == GenerationInput(
        request_id="assigned-1",
        prompt_ids=(1, 4, 5, 6, 3),
        sampling=SamplingParams(),
        max_tokens=16,
        manifest=ManifestChoice(),
        detokenize=True,
    )


def test_sampling_and_manifest_selectors_pass_through() -> None:
    by_name = common_pb2.ManifestSelector(by_name=common_pb2.ManifestNameRef(name="snapkv-pyramid", policy_generation=2))
    request = valid(sampling=sampling(temperature=0.7, top_k=5, top_p=0.9, seed=11, stop_token_ids=[4, 49]),
                    manifest=by_name)
    result = check(request)
    sampled = result.sampling
    assert (sampled.temperature, sampled.top_p) == (pytest.approx(0.7), pytest.approx(0.9))
    assert (sampled.top_k, sampled.seed, sampled.stop_token_ids, result.max_tokens) == (5, 11, (4, 49), 4)
    assert result.manifest == ManifestChoice(name="snapkv-pyramid", policy_generation=2)
    assert check(valid(manifest=common_pb2.ManifestSelector(sha256=SHA))).manifest == ManifestChoice(sha256=SHA)
    assert sampling_to_proto(result.sampling, result.max_tokens).stop_token_ids == [4, 49]


def test_default_max_tokens_shrinks_to_the_context_left() -> None:
    result = check(valid(token_ids=gateway_pb2.TokenIds(ids=[1] * 40)))
    assert result.max_tokens == 16
    tight = RequestLimits(vocab_size=50, context_length=44, max_prompt_tokens=40, max_tokens_limit=32,
                          default_max_tokens=16)
    assert validate_request(valid(token_ids=gateway_pb2.TokenIds(ids=[1] * 40)), tight, TOKENIZER).max_tokens == 4


BAD: list[tuple[str, gateway_pb2.GenerateRequest, str]] = [
    ("no prompt", gateway_pb2.GenerateRequest(request_id="r"), "prompt"),
    ("empty text", valid(text=""), "text"),
    ("blank text", valid(text="  \n "), "text"),
    ("huge text", valid(text="x" * (40 * 64 + 1)), "text"),
    ("text too long", valid(text=" ".join(["w"] * 40)), "text"),
    ("empty ids", valid(token_ids=gateway_pb2.TokenIds(ids=[])), "token_ids.ids"),
    ("negative id", valid(token_ids=gateway_pb2.TokenIds(ids=[1, -3])), "token_ids.ids[1]"),
    ("id past vocab", valid(token_ids=gateway_pb2.TokenIds(ids=[50])), "token_ids.ids[0]"),
    ("ids too long", valid(token_ids=gateway_pb2.TokenIds(ids=[1] * 41)), "token_ids.ids"),
    ("max_tokens 0", valid(sampling=sampling(max_tokens=0)), "sampling.max_tokens"),
    ("max_tokens < 0", valid(sampling=sampling(max_tokens=-2)), "sampling.max_tokens"),
    ("max_tokens over limit", valid(sampling=sampling(max_tokens=33)), "sampling.max_tokens"),
    ("past the context", valid(token_ids=gateway_pb2.TokenIds(ids=[1] * 40), sampling=sampling(max_tokens=25)),
     "sampling.max_tokens"),
    ("negative temperature", valid(sampling=sampling(temperature=-0.5)), "sampling.temperature"),
    ("nan temperature", valid(sampling=sampling(temperature=math.nan)), "sampling.temperature"),
    ("inf temperature", valid(sampling=sampling(temperature=math.inf)), "sampling.temperature"),
    ("negative top_k", valid(sampling=sampling(top_k=-1)), "sampling.top_k"),
    ("top_p above 1", valid(sampling=sampling(top_p=1.5)), "sampling.top_p"),
    ("negative top_p", valid(sampling=sampling(top_p=-0.1)), "sampling.top_p"),
    ("nan top_p", valid(sampling=sampling(top_p=math.nan)), "sampling.top_p"),
    ("stop id past vocab", valid(sampling=sampling(stop_token_ids=[3, 77])), "sampling.stop_token_ids[1]"),
    ("too many stop ids", valid(sampling=sampling(stop_token_ids=[1] * 65)), "sampling.stop_token_ids"),
    ("bad request id", valid(request_id="has space"), "request_id"),
    ("bad sha", valid(manifest=common_pb2.ManifestSelector(sha256="XYZ")), "manifest.sha256"),
    ("bad policy name", valid(manifest=common_pb2.ManifestSelector(by_name=common_pb2.ManifestNameRef(name="Bad Name"))),
     "manifest.by_name.name"),
    ("negative policy generation",
     valid(manifest=common_pb2.ManifestSelector(by_name=common_pb2.ManifestNameRef(name="full", policy_generation=-1))),
     "manifest.by_name.policy_generation"),
]


@pytest.mark.parametrize(("case", "request_message", "field"), BAD, ids=[case for case, _, _ in BAD])
def test_bad_field_is_named(case: str, request_message: gateway_pb2.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check(request_message)
    assert caught.value.field == field, case


def test_unknown_wire_fields_are_rejected() -> None:
    data = valid().SerializeToString() + bytes([0xA0, 0x06, 0x01])  # field 100, varint 1
    with pytest.raises(InvalidArgument) as caught:
        check(gateway_pb2.GenerateRequest.FromString(data))
    assert caught.value.field == "#100"


class NeverTokenizes:
    """The needle tokenizer, but a call to tokenize fails the test: size checks come first."""

    chat_template = TOKENIZER.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized a prompt that the size bound should have refused")

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:  # type: ignore[no-untyped-def]
        raise AssertionError("rendered a chat that the size bound should have refused")

    def end_of_turn_ids(self) -> tuple[int, ...]:
        return ()


@pytest.mark.parametrize(("request_message", "field", "says"), [
    # 40 tokens allow 2560 characters and 2560 UTF-8 bytes: 1300 two-byte characters pass the one, not the other.
    (gateway_pb2.GenerateRequest(text="é" * 1300), "text", "2600 UTF-8 bytes"),
    (gateway_pb2.GenerateRequest(text="a" * 2561), "text", "2561 characters"),
    (gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatMessages(messages=[
        gateway_pb2.ChatMessage(role="user", content="é" * 700)] * 2)), "chat.messages", "2800 UTF-8 bytes"),
    # A huge id list is refused by its count, before any id is looked at (these are past the vocabulary).
    (gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=[10**6] * 100_000)), "token_ids.ids",
     "100000 tokens exceeds"),
])
def test_oversized_prompts_are_refused_before_tokenizing(
    request_message: gateway_pb2.GenerateRequest, field: str, says: str
) -> None:
    for check_size in (lambda: check_prompt_size(request_message, LIMITS),
                       lambda: validate_request(request_message, LIMITS, NeverTokenizes())):
        with pytest.raises(InvalidArgument) as caught:
            check_size()
        assert caught.value.field == field and says in caught.value.message
