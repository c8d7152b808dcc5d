"""The `kvrelay.v1.PrefillWorker` servicer: validate, resolve the manifest, wait for a slot,
run the pipeline, answer. Typed errors become status codes in `@maps_errors`."""

from __future__ import annotations

import logging

import grpc

from prefill_worker.admission import Admission
from prefill_worker.manifests import ServableManifests
from prefill_worker.pipeline import PrefillJob, PrefillOutcome, PrefillPipeline
from prefill_worker.wire import RequestLimits, parse_prefill_request
from services.rpc.errors import maps_errors
from services.rpc.kvrelay.v1 import prefill_pb2, prefill_pb2_grpc
from services.telemetry.spans import annotate, extract_context, span
from services.transfer import Deadline

log = logging.getLogger(__name__)
SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    """Thin adapter from gRPC to `PrefillPipeline`."""

    def __init__(
        self,
        pipeline: PrefillPipeline,
        manifests: ServableManifests,
        admission: Admission,
        limits: RequestLimits,
        worker_id: str,
    ) -> None:
        self._pipeline = pipeline
        self._manifests = manifests
        self._admission = admission
        self._limits = limits
        self._worker_id = worker_id

    @maps_errors
    async def Prefill(  # noqa: N802 - the proto's method name
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        call = parse_prefill_request(request, self._limits)
        parent = extract_context(dict(call.trace_context))
        with span("prefill", parent, request_id=call.request_id, request_generation=call.request_generation,
                  manifest_sha256=call.manifest_sha256, prompt_tokens=call.prompt_tokens,
                  decode_worker=call.decode.worker_id, prefill_worker=self._worker_id):
            job = PrefillJob(call, await self._manifests.get(call.manifest_sha256))
            annotate(manifest_name=job.manifest.name)
            async with self._admission.slot():
                outcome = await self._pipeline.run(job, _call_deadline(context))
            ledger = outcome.packed.ledger
            log.info("request %s@r%d prefilled under %s: %d of %d rows retained, %d bytes to %s",
                     call.request_id, call.request_generation, job.manifest.name, ledger.visible_rows,
                     ledger.full_rows, outcome.handoff.bytes_moved, outcome.handoff.decode_worker)
        return self._response(outcome)

    def _response(self, outcome: PrefillOutcome) -> prefill_pb2.PrefillResponse:
        """The receipt and ledger as the accepted descriptor carries them (converted once, by the
        handoff), the ledger with the bytes that moved."""
        sent = outcome.handoff.descriptor
        response = prefill_pb2.PrefillResponse(
            receipt=sent.receipt, transfer=sent, ledger=sent.ledger,
            prefill_ms=outcome.prefill_ms, prefill_worker=self._worker_id,
        )
        response.ledger.bytes_moved = outcome.handoff.bytes_moved
        return response


def _call_deadline(context: grpc.aio.ServicerContext) -> Deadline | None:
    remaining = context.time_remaining()
    return None if remaining is None else Deadline.after(max(0.0, remaining))
