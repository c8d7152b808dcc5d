"""One request through a real local stack (policy service + embedded Redis, prefill, decode,
gateway: separate processes on loopback) with tracing pointed at an OTLP/gRPC receiver that
runs inside the test: every span of DESIGN §8 arrives in ONE trace with the real parent
links — gateway → prefill → (descriptor) → decode, policy-service spans under their callers —
every service's metrics endpoint counts the request, and the JSON log lines written under it
carry its trace id."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from telemetry_helpers import (
    CLIENT_KIND,
    SERVER_KIND,
    OtlpReceiver,
    ReceivedSpan,
    sample,
    save_tiny_checkpoint,
    scrape,
)

from services.launcher.stack import Stack, StackConfig
from services.redis_embedded import free_loopback_port
from services.rpc.kvrelay.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(240)

REQUEST_ID = "telemetry-req-1"
PROMPT_TOKENS = 96
MAX_TOKENS = 20
STEPS_PER_SPAN = 16  # decode_worker.config.SchedulerConfig.trace_steps_per_span
PIPELINE = ("prefill.forward", "kv.score", "kv.allocate", "kv.select", "kv.pack", "policy.publish", "transfer.send")
DECODE = ("transfer.recv", "kv.verify", "decode.step")
GENERATE = "/kvrelay.v1.Gateway/Generate"
ROLES = ("gateway", "policy", "prefill", "decode")


@dataclass(frozen=True)
class Served:
    """The running stack, its metrics ports, and the one request it served."""

    stack: Stack
    receiver: OtlpReceiver
    metrics_ports: dict[str, int]
    summary: gateway_pb2.GenerateSummary


def _generate(address: str) -> gateway_pb2.GenerateSummary:
    request = gateway_pb2.GenerateRequest(request_id=REQUEST_ID, detokenize=False)
    request.token_ids.ids.extend(4 + (7 * i) % 60 for i in range(PROMPT_TOKENS))
    request.manifest.by_name.name = "snapkv"
    request.sampling.CopyFrom(common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    with grpc.insecure_channel(address) as channel:
        events = list(gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120))
    assert events and events[-1].HasField("summary"), events
    return events[-1].summary


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    checkpoint = save_tiny_checkpoint(tmp_path_factory.mktemp("telemetry-checkpoint"))
    receiver = OtlpReceiver()
    ports = {role: free_loopback_port() for role in ROLES}
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "KVRELAY_LOG_FORMAT": "json",
        "KVRELAY_HEALTH_INTERVAL_S": "0.5",
    }
    config = StackConfig.with_free_ports(
        checkpoint, log_dir=tmp_path_factory.mktemp("telemetry-logs"), start_timeout_s=150.0,
        env=tuple(env.items()),
        extra_args=tuple((role, ("--metrics-port", str(port))) for role, port in ports.items()),
    )
    stack = Stack(config)
    try:
        stack.start()
        yield Served(stack, receiver, ports, _generate(stack.gateway_address))
    finally:
        stack.stop()
        receiver.stop()


def _request_trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    roots = [s for s in spans if s.name == GENERATE and s.kind == SERVER_KIND]
    if len(roots) != 1:
        return []
    return [s for s in spans if s.trace_id == roots[0].trace_id]


def _complete(spans: list[ReceivedSpan], output_tokens: int) -> bool:
    trace = _request_trace(spans)
    names = {s.name for s in trace}
    steps = sum(int(s.attributes.get("steps", 0)) for s in trace if s.name == "decode.step")  # type: ignore[call-overload]
    ended = any(s.name.endswith("/EndRequest") and s.service == "kvrelay-policy" for s in trace)
    # Services export in batches, so a child can arrive before its parent: wait until every
    # parent that a received span names has arrived too.
    ids = {s.span_id for s in trace}
    parents_arrived = all(not s.parent_span_id or s.parent_span_id in ids for s in trace)
    return {*PIPELINE, *DECODE, "prefill"} <= names and steps == output_tokens - 1 and ended and parents_arrived


@pytest.fixture(scope="module")
def trace(served: Served) -> list[ReceivedSpan]:
    output_tokens = served.summary.output_tokens
    assert output_tokens >= 2, "the request must decode at least one step"
    spans = served.receiver.wait_for(lambda spans: _complete(spans, output_tokens), timeout_s=30)
    assert _complete(spans, output_tokens), sorted({(s.service, s.name) for s in _request_trace(spans)})
    return _request_trace(spans)


def _one(trace: list[ReceivedSpan], name: str, service: str | None = None) -> ReceivedSpan:
    found = [s for s in trace if s.name == name and (service is None or s.service == service)]
    assert len(found) == 1, (name, service, found)
    return found[0]


def _ancestors(trace: list[ReceivedSpan], span: ReceivedSpan) -> list[ReceivedSpan]:
    by_id = {s.span_id: s for s in trace}
    chain = []
    while span.parent_span_id:
        span = by_id[span.parent_span_id]
        chain.append(span)
    return chain


def test_every_span_of_the_request_arrives_in_one_trace(served: Served, trace: list[ReceivedSpan]) -> None:
    trace_id = trace[0].trace_id
    ours = [s for s in served.receiver.spans() if s.attributes.get("request_id") == REQUEST_ID]
    assert {s.trace_id for s in ours} == {trace_id}
    by_id = {s.span_id for s in trace}
    orphans = [(s.service, s.name) for s in trace if s.parent_span_id and s.parent_span_id not in by_id]
    assert orphans == [], "their parent spans never arrived"
    assert [s.name for s in trace if not s.parent_span_id] == [GENERATE]
    assert {s.service for s in trace} == {f"kvrelay-{role}" for role in ROLES}
    root = _one(trace, GENERATE, "kvrelay-gateway")
    assert served.summary.trace_id == trace_id  # the id to open in Jaeger
    assert root.attributes["request_id"] == REQUEST_ID and root.attributes["retained_rows"] == served.summary.retained_rows


def test_prefill_stages_hang_under_the_gateways_call(trace: list[ReceivedSpan]) -> None:
    prefill = _one(trace, "prefill", "kvrelay-prefill")
    for name in PIPELINE:
        assert _one(trace, name, "kvrelay-prefill").parent_span_id == prefill.span_id, name
    chain = _ancestors(trace, prefill)
    assert [(s.service, s.kind) for s in chain[:2]] == [("kvrelay-prefill", SERVER_KIND), ("kvrelay-gateway", CLIENT_KIND)]
    assert chain[-1].name == GENERATE and chain[-1].service == "kvrelay-gateway"
    publish = _one(trace, "policy.publish")
    assert publish.attributes["request_id"] == REQUEST_ID
    assert publish.attributes["manifest_name"] == "snapkv" and publish.attributes["state_generation"] == 1
    assert int(publish.attributes["retained_rows"]) > 0 and int(publish.attributes["omitted_rows"]) > 0  # type: ignore[call-overload]


def test_decode_spans_are_children_of_transfer_send_across_the_transfer(
    served: Served, trace: list[ReceivedSpan]
) -> None:
    send = _one(trace, "transfer.send", "kvrelay-prefill")
    for name in ("transfer.recv", "kv.verify"):
        span = _one(trace, name, "kvrelay-decode")
        assert span.parent_span_id == send.span_id, name
        assert span.attributes["request_id"] == REQUEST_ID
    steps = [s for s in trace if s.name == "decode.step"]
    assert {(s.service, s.parent_span_id) for s in steps} == {("kvrelay-decode", send.span_id)}
    decoded = served.summary.output_tokens - 1
    assert len(steps) == -(-decoded // STEPS_PER_SPAN)  # one span per batch of steps, not per token
    assert sorted(int(s.attributes["first_index"]) for s in steps) == list(range(1, decoded + 1, STEPS_PER_SPAN))  # type: ignore[call-overload]
    assert send.attributes["bytes_moved"] == _one(trace, "transfer.recv").attributes["bytes_moved"] > 0


def test_policy_service_spans_hang_under_their_callers(trace: list[ReceivedSpan]) -> None:
    publish = _one(trace, "/kvrelay.v1.PolicyService/PublishState", "kvrelay-policy")
    client = _ancestors(trace, publish)[0]
    assert (client.service, client.kind) == ("kvrelay-prefill", CLIENT_KIND)
    assert _ancestors(trace, client)[0].name == "policy.publish"
    assert publish.attributes["request_id"] == REQUEST_ID and publish.attributes["state_generation"] == 1
    fence = _one(trace, "/kvrelay.v1.PolicyService/GetFence", "kvrelay-policy")
    assert "kv.verify" in [s.name for s in _ancestors(trace, fence)]
    begin = _one(trace, "/kvrelay.v1.PolicyService/BeginRequest", "kvrelay-policy")
    assert _ancestors(trace, begin)[-1].name == GENERATE


def test_every_service_counts_the_request(served: Served, trace: list[ReceivedSpan]) -> None:
    metrics = {role: scrape(port) for role, port in served.metrics_ports.items()}
    requests = "kvrelay_rpc_requests_total"
    assert sample(metrics["gateway"], requests, method=GENERATE, code="OK") == 1
    assert sample(metrics["policy"], requests, method="/kvrelay.v1.PolicyService/PublishState", code="OK") == 1
    assert sample(metrics["prefill"], requests, method="/kvrelay.v1.PrefillWorker/Prefill", code="OK") == 1
    assert sample(metrics["decode"], requests, method="/kvrelay.v1.DecodeWorker/StreamTokens", code="OK") == 1
    prefill, decode = metrics["prefill"], metrics["decode"]
    assert sample(prefill, "kvrelay_kv_rows_total", policy="snapkv", kind="retained") == served.summary.retained_rows
    assert sample(prefill, "kvrelay_kv_rows_total", policy="snapkv", kind="omitted") == served.summary.omitted_rows
    assert sample(prefill, "kvrelay_prefill_stage_seconds_count", stage="prefill.forward") == 1
    moved = served.summary.bytes_moved
    assert sample(prefill, "kvrelay_transfer_bytes_total", direction="send") == moved > 0
    assert sample(decode, "kvrelay_transfer_bytes_total", direction="recv") == moved
    assert sample(prefill, "kvrelay_pair_groups_created_total", side="sender") == 1
    assert sample(decode, "kvrelay_pair_groups_created_total", side="receiver") == 1
    assert sample(decode, "kvrelay_decode_tokens_total") == served.summary.output_tokens - 1
    assert sample(decode, "kvrelay_decode_tpot_seconds_count") == 1
    assert ("kvrelay_decode_kv_reserved_bytes", ()) in decode and ("kvrelay_prefill_queue_depth", ()) in prefill
    assert sample(metrics["gateway"], "kvrelay_gateway_ttft_seconds_count") == 1
    assert sample(metrics["gateway"], "kvrelay_gateway_requests_in_flight") == 0


def _json_lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_json_log_lines_carry_the_trace_and_request_ids(served: Served, trace: list[ReceivedSpan]) -> None:
    trace_id = trace[0].trace_id
    for name, words in (("gateway", "done"), ("prefill-0", "prefilled"), ("decode-0", "verified")):
        lines = [r for r in _json_lines(served.stack.log_dir / f"{name}.log") if words in str(r["message"])]
        assert len(lines) == 1, name
        record = lines[0]
        assert record["trace_id"] == trace_id and record["request_id"] == REQUEST_ID
        assert record["span_id"] in {s.span_id for s in trace}
        assert record["service"] == f"kvrelay-{name.split('-')[0]}"
