"""Run by test_decode_recall_telemetry.py in a fresh interpreter (an installed tracer provider is
process-global): the decode loop decodes two recallable requests on a tiny random Llama with an
in-memory span exporter installed, and prints what telemetry saw as one JSON object.

- "local": recallable_local, every page recalled at the first step (full-recall gate);
- "gone": recallable_remote whose offload tier does not answer (nothing listens at its
  address), continue_lossy: every evaluated step falls back.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import tempfile
import threading
from pathlib import Path

import grpc
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "prefill_worker"))
from prefill_helpers import prompt_ids, write_tiny_checkpoint  # noqa: E402

from decode_worker.config import SchedulerConfig  # noqa: E402
from decode_worker.recall import RemoteHandoff, RemotePageFetcher  # noqa: E402
from decode_worker.scheduler import DecodeFinished, DecodeRequest, DecodeScheduler  # noqa: E402
from services.kvpolicy.compress import StateIdentity, compress  # noqa: E402
from services.kvpolicy.manifest import RecoverabilityMode, TimeoutFallback, default_manifests  # noqa: E402
from services.model import PrefillOptions, SamplingParams, load, prefill  # noqa: E402
from services.offload.fetchers import LocalPageFetcher  # noqa: E402
from services.offload.pages import gather_omitted, summarize_pages  # noqa: E402
from services.offload.recall import PageFetcher, RecallKnobs, RecallSession, with_recall  # noqa: E402
from services.rpc.kvrelay.v1 import offload_pb2_grpc  # noqa: E402
from services.telemetry.metrics import registry_for  # noqa: E402
from services.transfer import KVReceiver  # noqa: E402

OBS, PAGE, PROMPT, MAX_TOKENS = 4, 4, 40, 5


def main() -> None:
    torch.set_num_threads(1)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    loaded = load(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny"), "cpu", "float32")
    base = default_manifests(loaded.tensor_contract, observation_window=OBS)["snapkv"]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    scheduler = DecodeScheduler(loaded, SchedulerConfig(max_batch=2, kv_budget_bytes=64 * 1024 * 1024))
    scheduler.start()
    receiver = KVReceiver()
    finished: dict[str, object] = {}
    try:
        for name, mode, fallback, gate in (
            ("local", RecoverabilityMode.RECALLABLE_LOCAL, TimeoutFallback.CONTINUE_LOSSY, 1e-6),
            ("gone", RecoverabilityMode.RECALLABLE_REMOTE, TimeoutFallback.CONTINUE_LOSSY, None),
        ):
            knobs = RecallKnobs(threshold=0.0, page_size=PAGE, max_pages_per_step=64, cadence_steps=1,
                                timeout_ms=1000, fallback=fallback, full_recall_gate=gate)
            manifest = with_recall(base, knobs, mode=mode)
            event = decode(loaded, manifest, scheduler, receiver, loop, f"probe-{name}")
            finished[name] = {"recall_count": event.recall_count, "recalled_rows": event.recalled_rows,
                              "recalled_bytes": event.recalled_bytes, "fallbacks": list(event.fallbacks),
                              "output_tokens": event.output_tokens, "cache_generation": event.cache_generation}
    finally:
        scheduler.stop()
        receiver.close()
    spans = [{"name": s.name, "attributes": dict(s.attributes or {}), "status": s.status.status_code.name}
             for s in exporter.get_finished_spans() if s.name == "kv.recall"]
    print(json.dumps({"spans": spans, "finished": finished, "metrics": recall_metrics()}))


def decode(loaded, manifest, scheduler, receiver, loop, request_id: str) -> DecodeFinished:  # type: ignore[no-untyped-def]
    prompt = prompt_ids(PROMPT, seed=5)
    result = prefill(loaded.model, prompt, PrefillOptions(obs_window=OBS))
    compressed = compress(manifest, result, StateIdentity(request_id, 1))
    view, state = compressed.view, compressed.state
    selected = state.selected_positions
    summaries = summarize_pages(result.source_k, selected, PAGE)
    fetch: PageFetcher
    if manifest.recoverability.mode is RecoverabilityMode.RECALLABLE_LOCAL:
        fetch = LocalPageFetcher(gather_omitted(result.source_k, result.source_v, summaries))
    else:
        stub = asyncio.run_coroutine_threadsafe(_stub("127.0.0.1:9"), loop).result(5)
        fetch = RemotePageFetcher(RemoteHandoff(request_id, 1, "h", "127.0.0.1:9"), stub, receiver, loop, lambda: 1)
    session = RecallSession(manifest, summaries, fetch, state=state)
    events: queue.Queue = queue.Queue()
    reservation = scheduler.budget.reserve(1024, request_id)
    scheduler.submit(DecodeRequest(
        request_id=request_id, view=view, frontier=PROMPT, first_token=int(result.logits.argmax()),
        sampling=SamplingParams(), max_tokens=MAX_TOKENS, cache_generation=1, reservation=reservation,
        sink=events.put, request_generation=1, recall=session,
    ))
    while True:
        event = events.get(timeout=60)
        if isinstance(event, DecodeFinished):
            return event
        if not hasattr(event, "token_id"):
            raise RuntimeError(f"{request_id}: {event}")


async def _stub(address: str) -> offload_pb2_grpc.OffloadServiceStub:
    return offload_pb2_grpc.OffloadServiceStub(grpc.aio.insecure_channel(address))


def recall_metrics() -> dict[str, float]:
    text = generate_latest(registry_for("decode")).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvrelay_recall"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


if __name__ == "__main__":
    main()
