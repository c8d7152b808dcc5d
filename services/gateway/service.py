"""The Gateway servicer: a thin adapter from the wire request to the orchestrator.

`Generate` validates every field first (INVALID_ARGUMENT naming it; a text prompt is
tokenized and a chat rendered with the checkpoint's template, a big one on a tokenizer
thread), then streams what the orchestrator yields (within the client's deadline, if it set
one); typed errors become status codes in `services.rpc.errors`. The call's server span is
the root of the request's trace: it carries the request id and the summary
(whose `trace_id` names the trace to open in Jaeger), and TTFT/TPOT land in the metrics.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry import trace

from services.gateway.orchestrator import Orchestrator, StopRequested
from services.gateway.prompts import PromptValidator
from services.gateway.validation import GenerationInput
from services.rpc.errors import maps_errors
from services.rpc.kvrelay.v1 import gateway_pb2, gateway_pb2_grpc
from services.telemetry import metrics
from services.telemetry.logs import bound_request_id
from services.telemetry.spans import annotate

log = logging.getLogger(__name__)
SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Implements kvrelay.v1.Gateway."""

    def __init__(self, prompts: PromptValidator, orchestrator: Orchestrator) -> None:
        self.prompts = prompts
        self.orchestrator = orchestrator

    @maps_errors
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        generation = await self.prompts.validate(request)
        # Closed here, in the call's task, on a cancel too: its `with` blocks bind context vars.
        async with contextlib.aclosing(stream_events(self.orchestrator, generation, context.time_remaining())) as events:
            async for event in events:
                yield event


async def stream_events(
    orchestrator: Orchestrator,
    generation: GenerationInput,
    time_remaining_s: float | None = None,
    stop_requested: StopRequested | None = None,
) -> AsyncGenerator[gateway_pb2.GenerateEvent, None]:
    """One validated request through the orchestrator, as both fronts (gRPC `Generate` and
    the OpenAI-compatible HTTP front) serve it: counted in flight, its request id bound for
    the logs, its summary recorded on the current span and in the metrics."""
    annotate(request_id=generation.request_id, prompt_tokens=len(generation.prompt_ids))
    with bound_request_id(generation.request_id), metrics.GATEWAY_IN_FLIGHT.track_inprogress():
        async with contextlib.aclosing(
            orchestrator.generate(generation, time_remaining_s, stop_requested)
        ) as events:
            async for event in events:
                if event.HasField("summary"):
                    record_summary(event.summary)
                yield event


def record_summary(summary: gateway_pb2.GenerateSummary) -> None:
    """Stamp the trace id on the summary, record it on the span, in the metrics and the log."""
    ids = trace.get_current_span().get_span_context()
    if ids.is_valid:
        summary.trace_id = trace.format_trace_id(ids.trace_id)
    annotate(manifest_sha256=summary.manifest_sha256, request_generation=summary.generations.request_generation,
             state_generation=summary.generations.state_generation, retained_rows=summary.retained_rows,
             omitted_rows=summary.omitted_rows, bytes_moved=summary.bytes_moved,
             output_tokens=summary.output_tokens, prefill_worker=summary.prefill_worker,
             decode_worker=summary.decode_worker)
    metrics.GATEWAY_TTFT.observe(summary.ttft_ms / 1000.0)
    if summary.output_tokens > 1:
        metrics.GATEWAY_TPOT.observe(summary.tpot_ms / 1000.0)
    log.info("request %s done: %d tokens, ttft %.1f ms, tpot %.1f ms, %d rows retained, %d omitted",
             summary.request_id, summary.output_tokens, summary.ttft_ms, summary.tpot_ms, summary.retained_rows,
             summary.omitted_rows)
