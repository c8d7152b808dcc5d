"""The HTTP front's pure parts: stop strings against a brute-force reference, the translation
of an OpenAI body into the gateway's request (every refused parameter named), and the one
error table (typed error -> HTTP status and OpenAI error JSON)."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from services.gateway.admission import WorkersBusy
from services.gateway.console import summary_table
from services.gateway.errors import (
    DeadlineExceeded,
    PermissionDenied,
    RelayedError,
    RequestInFlight,
    Unauthenticated,
)
from services.gateway.openai_api.convert import openai_param, parse_body
from services.gateway.openai_api.errors import http_error
from services.gateway.openai_api.responses import kvrelay_summary
from services.gateway.openai_api.stops import StopMatcher, check_stops
from services.rpc.errors import InvalidArgument, NotFound, ServiceError, Unavailable
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2

MODEL = "tiny"


def reference_cut(text: str, stops: list[str]) -> str:
    """The output up to the first stop string to complete (the longer of two ending together)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)]
    return text


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc ", max_size=30), stops=st.lists(st.text("abc ", min_size=1, max_size=4), min_size=1,
       max_size=3), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_emits_the_reference_cut_however_the_text_is_split(text: str, stops: list[str],
                                                                        cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher = StopMatcher(stops)
    emitted = [matcher.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    expected = reference_cut(text, stops)
    assert "".join(emitted) + matcher.flush() == expected
    assert matcher.matched == (expected != text or any(s in text for s in stops))
    for stop in stops:  # nothing emitted ever held the beginning of a stop string that then completed
        assert stop not in "".join(emitted)


def test_check_stops_names_the_bad_entry() -> None:
    assert check_stops(["a", "b"]) == ("a", "b")
    for stops, field in ((["a", ""], "stop[1]"), ([""], "stop"), (["x" * 257], "stop"), (["a"] * 5, "stop")):
        with pytest.raises(InvalidArgument) as caught:
            check_stops(stops)
        assert caught.value.field == field


def body(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "the code", **fields}).encode()


def chat(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_a_body_becomes_the_gateway_request() -> None:
    parsed = parse_body(body(max_tokens=5, temperature=0, top_p=0.5, seed=0, stop="x", kv_policy="full",
                             stream=True, stream_options={"include_usage": True}, user="u1",
                             frequency_penalty=0), "completion", MODEL)
    sampling = parsed.generate.sampling
    assert (parsed.generate.text, sampling.max_tokens, sampling.temperature, sampling.top_p) == ("the code", 5, 0, 0.5)
    assert sampling.seed == 1  # HTTP seed 0 is a seed; the wire's 0 means unseeded
    assert parsed.generate.manifest.by_name.name == "full" and parsed.stops == ("x",)
    assert parsed.stream and parsed.include_usage and parsed.user == "u1" and parsed.generate.detokenize
    defaults = parse_body(chat(kv_policy="sha256:" + "a" * 64), "chat", MODEL)
    assert defaults.generate.sampling.temperature == 1.0 and defaults.generate.sampling.max_tokens == 0
    assert defaults.generate.manifest.sha256 == "a" * 64
    assert [(m.role, m.content) for m in defaults.generate.chat.messages] == [("user", "hi")]
    parts = parse_body(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}],
                            max_completion_tokens=3), "chat", MODEL)
    assert parts.generate.chat.messages[0].content == "ab" and parts.max_tokens_param == "max_completion_tokens"
    ids = parse_body(body(prompt=[4, 5, 6]), "completion", MODEL)
    assert list(ids.generate.token_ids.ids) == [4, 5, 6]


@pytest.mark.parametrize(("raw", "kind", "param"), [
    (b"{not json", "completion", ""),
    (body(model="other"), "completion", "model"),
    (json.dumps({"prompt": "x"}).encode(), "completion", "model"),
    (body(prompt=None), "completion", "prompt"),
    (body(prompt=["a", "b"]), "completion", "prompt"),
    (body(prompt=[1, -1]), "completion", "prompt[1]"),
    (body(temperature="hot"), "completion", "temperature"),
    (body(top_p=0), "completion", "top_p"),
    (body(seed=-1), "completion", "seed"),
    (body(max_tokens=0), "completion", "max_tokens"),
    (body(max_tokens=2**40), "completion", "max_tokens"),
    (body(n=2), "completion", "n"),
    (body(stop=["a", ""]), "completion", "stop[1]"),
    (body(stop=3), "completion", "stop"),
    (body(stream_options={"include_usage": True}), "completion", "stream_options"),
    (body(stream=True, stream_options={"other": 1}), "completion", "stream_options.other"),
    (body(frequency_penalty=0.5), "completion", "frequency_penalty"),
    (body(logprobs=2), "completion", "logprobs"),
    (body(unknown_thing=1), "completion", "unknown_thing"),
    (body(user=5), "completion", "user"),
    (body(kv_policy=7), "completion", "kv_policy"),
    (chat(messages=None), "chat", "messages"),
    (chat(messages=[{"role": "user"}]), "chat", "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]), "chat",
     "messages[0].content"),
    (chat(max_tokens=3, max_completion_tokens=4), "chat", "max_completion_tokens"),
    (chat(tools=[{"type": "function"}]), "chat", "tools"),
    (chat(logprobs=True), "chat", "logprobs"),
])
def test_each_refused_parameter_is_named(raw: bytes, kind: str, param: str) -> None:
    with pytest.raises(ServiceError) as caught:
        parse_body(raw, kind, MODEL)  # type: ignore[arg-type]
    assert caught.value.field == param
    expected = 404 if param == "model" and b"other" in raw else 400
    assert http_error(caught.value).status == expected


@pytest.mark.parametrize(("field", "param"), [
    ("sampling.temperature", "temperature"), ("sampling.top_p", "top_p"), ("sampling.seed", "seed"),
    ("text", "prompt"), ("token_ids.ids[3]", "prompt[3]"), ("chat", "messages"),
    ("chat.messages[2].role", "messages[2].role"), ("manifest.by_name.name", "kv_policy"),
    ("manifest", "kv_policy"), ("model", "model"), ("stop[1]", "stop[1]"),
])
def test_gateway_fields_are_named_as_openai_parameters(field: str, param: str) -> None:
    assert openai_param(field) == param
    assert openai_param("sampling.max_tokens", "max_completion_tokens") == "max_completion_tokens"


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidArgument("bad", field="sampling.top_p"), 400, "invalid_request_error"),
    (Unauthenticated("no key"), 401, "authentication_error"),
    (PermissionDenied("not yours"), 403, "permission_error"),
    (NotFound("no such model", field="model"), 404, "not_found_error"),
    (RequestInFlight("busy id", field="request_id"), 409, "conflict_error"),
    (WorkersBusy("every decode worker is at its limit"), 429, "rate_limit_error"),
    (Unavailable("no healthy decode worker"), 503, "service_unavailable_error"),
    (DeadlineExceeded("too slow"), 504, "timeout_error"),
    (RelayedError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  common_pb2.ErrorDetail(reason=common_pb2.ERROR_REASON_CAPACITY, message="kv budget"),
                  "decode worker x"), 429, "rate_limit_error"),
])
def test_the_error_table(error: ServiceError, status: int, kind: str) -> None:
    answer = http_error(error, openai_param)
    assert answer.status == status
    assert answer.body["error"]["type"] == kind
    assert answer.body["error"]["message"] == error.message
    assert answer.body["error"]["param"] == (openai_param(error.field) if error.field else None)


def test_an_unknown_error_is_a_500_that_says_only_its_type() -> None:
    answer = http_error(RuntimeError("secret path /etc/x"))
    assert answer.status == 500 and "secret" not in answer.body["error"]["message"]
    long = http_error(InvalidArgument("x" * 5000, field="prompt"))
    assert len(long.body["error"]["message"].encode()) <= 1024


def test_the_kvrelay_block_says_the_decode_time_retention_when_there_is_one() -> None:
    summary = gateway_pb2.GenerateSummary(request_id="r", retained_rows=40)
    assert "retention" not in kvrelay_summary(summary)
    assert "decode-time retention" not in _rendered(summary_table(summary))
    summary.retention.CopyFrom(common_pb2.RetentionSummary(
        prompt_method="snapkv", decode_method="h2o", positions="original", budget_rows=1024,
        resident_max=1024, score_state_bytes_per_row=12, score_state_bytes=4096,
        layout="compacted", evicted_rows=77, publications=3))
    block = kvrelay_summary(summary)["retention"]
    assert block["decode_method"] == "h2o" and block["budget_rows"] == 1024  # ints, not strings
    assert block["publications"] == 3 and len(block) == 10
    text = _rendered(summary_table(summary))
    assert "snapkv + h2o (original)" in text and "1024 / 1024" in text and "77 / 3" in text


def _rendered(table: Table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()
