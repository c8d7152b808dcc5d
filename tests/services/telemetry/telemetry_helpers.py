"""Helpers of the telemetry tests (imported by basename; tests have no packages): a real
OTLP/gRPC trace receiver, a tiny checkpoint a whole stack can serve, metric scraping."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from prometheus_client.parser import text_string_to_metric_families

VOCAB = 64
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, flattened: ids as hex, attributes as Python values."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    status_code: int


def _value(value: common_pb2.AnyValue) -> object:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


def _flatten(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service=str(resource.get("service.name", "")),
                    name=span.name,
                    kind=span.kind,
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_span_id=span.parent_span_id.hex(),
                    attributes={a.key: _value(a.value) for a in span.attributes},
                    status_code=span.status.code,
                ))
    return spans


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1 (random port) that keeps every span."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(  # noqa: N802 - the proto's method name
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        spans = _flatten(request)
        with self._lock:
            self._spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """Poll until `done(spans)` (bounded); returns the spans either way."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.spans()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return spans

    def stop(self) -> None:
        self._server.stop(0)


SERVER_KIND = trace_pb2.Span.SPAN_KIND_SERVER
CLIENT_KIND = trace_pb2.Span.SPAN_KIND_CLIENT


def save_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (d_model 64, 4 query heads on 2 K/V heads, head_dim 16, float32) with
    weights drawn by kvrelay's own model class, and a word-level tokenizer over `VOCAB` words:
    all a stack needs to serve (no transformers import: it is slow on a busy machine)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from services.model.config import parse_model_config
    from services.model.model import CausalLM

    raw = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    }
    torch.manual_seed(seed)
    model = CausalLM(parse_model_config(raw))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.1)
    save_file({name: t.contiguous() for name, t in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(raw))
    words = [*SPECIALS, *(f"w{i}" for i in range(VOCAB - len(SPECIALS)))]
    tokenizer = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of http://127.0.0.1:port/metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The summed value of `name` over the samples whose labels include `labels` (0 if none)."""
    return sum(
        value for (key, sample_labels), value in samples.items()
        if key == name and set(labels.items()) <= set(sample_labels)
    )
