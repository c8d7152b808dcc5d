"""Prometheus metrics of every kvrelay service.

The families below are module-level objects that the code paths update directly; each
process exposes the families of its role (`registry_for(role)`: its own plus the RPC and
process families) on its metrics port (`serve_metrics`, `KVRELAY_<ROLE>_METRICS_PORT`,
defaults gateway 9091, policy 9092, prefill 9093, decode 9094; 0 turns the endpoint off).

| family (kvrelay_...)                         | roles            | what                                    |
| -------------------------------------------- | ---------------- | --------------------------------------- |
| rpc_requests_total, rpc_duration_seconds     | all              | served calls by method and status code  |
| stale_rejections_total{stage}                | prefill, decode, policy | work refused for an older generation |
| policy_undecodable_entries_total             | policy           | manifest index entries a listing skipped |
| policy_sessions_total{transport}, policy_sessions_open{transport} | policy | Session streams opened / open: grpc, framed |
| gateway_ttft_seconds, gateway_tpot_seconds   | gateway          | as the client sees the stream           |
| gateway_requests_in_flight, gateway_retries_total | gateway     | load and retries on other workers       |
| http_requests_total{route,status}, http_request_duration_seconds{route} | gateway | the OpenAI-compatible HTTP front (a stream: until its last event) |
| prefill_stage_seconds{stage}                 | prefill          | forward, score, allocate, select, pack, publish, send |
| prefill_in_flight, prefill_queue_depth       | prefill          | prompts running / waiting for a slot    |
| kv_rows_total{policy,kind}, kv_bytes_total{policy,kind} | prefill | retained and omitted rows and K/V bytes |
| transfer_bytes_total{direction}, transfer_seconds{direction} | prefill, decode | rows moved over pair groups |
| pair_groups_created_total{side}, pair_groups_evicted_total{side,cause} | prefill, decode | lru, idle, discarded |
| decode_transfers_rejected_total{error}       | decode           | views refused before decoding           |
| decode_requests_active, decode_requests_waiting, decode_kv_reserved_bytes | decode | queue and KV resident |
| decode_batch_size, decode_tokens_total, decode_tpot_seconds | decode | the continuous-batching loop |
| decode_non_finite_total                      | decode           | requests failed alone: their logits were not finite |
| offload_store_bytes                          | prefill          | host bytes held for recallable_remote requests |
| offload_refusals_total{reason}               | prefill          | requests the store refused (they degrade to irrecoverable) |
| offload_released_total{cause}                | prefill          | stored states dropped: end, expired, fenced, evicted |
| offload_recalls_served_total{outcome}        | prefill          | Recall calls answered, by outcome       |
| recalls_total{outcome}                       | decode           | recalls: ok, timeout, unavailable, stale, rejected |
| recall_rows_total, recall_bytes_total        | decode           | rows and K/V + position bytes recalled  |
| recall_seconds                               | decode           | one recall, asked to rows in hand       |
| recall_fallbacks_total{kind}                 | decode           | declared fallbacks taken (e.g. recall_timeout:continue_lossy) |
| decode_retention_resident_rows               | decode           | decode-time retention: rows of a request's fullest owner after a step |
| decode_retention_over_budget_total           | decode           | steps after which an owner held more rows than its budget (stays 0) |
| decode_retention_evicted_rows_total          | decode           | rows evicted by decode-time retention   |
| decode_retention_publications_total{outcome} | decode           | successor states told to the policy service: published, unavailable |
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.registry import Collector

from services.rpc.handlers import HandlerInterceptor, rewrap

log = logging.getLogger(__name__)

ROLES = ("gateway", "policy", "prefill", "decode")
DEFAULT_METRICS_PORTS = {"gateway": 9091, "policy": 9092, "prefill": 9093, "decode": 9094}
# Seconds, from a policy-service round trip to a long prompt's prefill on CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ROW_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
# Calls that are probes or tooling, not requests.
_UNMEASURED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def _unregistered(kind: type[Any], name: str, documentation: str, labels: Iterable[str] = (), **kwargs: Any) -> Any:
    return kind(name, documentation, list(labels), registry=None, **kwargs)


RPC_REQUESTS = _unregistered(Counter, "kvrelay_rpc_requests", "gRPC calls served, by method and status code",
                             ("method", "code"))
RPC_DURATION = _unregistered(Histogram, "kvrelay_rpc_duration_seconds",
                             "Served gRPC call duration (a stream: until its last message), by method and status code",
                             ("method", "code"), buckets=LATENCY_BUCKETS)
STALE_REJECTIONS = _unregistered(Counter, "kvrelay_stale_rejections",
                                 "Work refused because it carries an older request/state/cache generation",
                                 ("stage",))

POLICY_UNDECODABLE_ENTRIES = _unregistered(
    Counter, "kvrelay_policy_undecodable_entries",
    "Manifest index entries in Redis that a listing skipped because they do not decode (each time;"
    " a non-zero rate means a bad entry is still there)")
POLICY_SESSIONS = _unregistered(Counter, "kvrelay_policy_sessions",
                                "Session streams opened, by transport (grpc, framed)", ("transport",))
POLICY_SESSIONS_OPEN = _unregistered(Gauge, "kvrelay_policy_sessions_open",
                                     "Session streams open now, by transport (grpc, framed)", ("transport",))

GATEWAY_TTFT = _unregistered(Histogram, "kvrelay_gateway_ttft_seconds",
                             "Time to first token, from accepting the request", buckets=LATENCY_BUCKETS)
GATEWAY_TPOT = _unregistered(Histogram, "kvrelay_gateway_tpot_seconds",
                             "Mean time per output token after the first, per request", buckets=TOKEN_BUCKETS)
GATEWAY_IN_FLIGHT = _unregistered(Gauge, "kvrelay_gateway_requests_in_flight", "Generate calls being served")
GATEWAY_WAITING = _unregistered(Gauge, "kvrelay_gateway_admission_waiting",
                                "Requests waiting at the gateway for a worker with room, by role", ("role",))
GATEWAY_RETRIES = _unregistered(Counter, "kvrelay_gateway_retries",
                                "Attempts retried on other workers after a failure before the first token")
HTTP_REQUESTS = _unregistered(Counter, "kvrelay_http_requests",
                              "Requests served by the OpenAI-compatible HTTP front, by route and HTTP status",
                              ("route", "status"))
HTTP_DURATION = _unregistered(Histogram, "kvrelay_http_request_duration_seconds",
                              "HTTP front request duration (a stream: until its last event), by route",
                              ("route",), buckets=LATENCY_BUCKETS)

PREFILL_STAGE = _unregistered(Histogram, "kvrelay_prefill_stage_seconds", "Prefill pipeline stage duration",
                              ("stage",), buckets=LATENCY_BUCKETS)
PREFILL_IN_FLIGHT = _unregistered(Gauge, "kvrelay_prefill_in_flight", "Prompts running the pipeline")
PREFILL_QUEUE_DEPTH = _unregistered(Gauge, "kvrelay_prefill_queue_depth", "Prompts waiting for a pipeline slot")
KV_ROWS = _unregistered(Counter, "kvrelay_kv_rows", "K/V rows per (layer, owner) kept or dropped by compression",
                        ("policy", "kind"))
KV_BYTES = _unregistered(Counter, "kvrelay_kv_bytes", "K/V payload bytes kept or dropped by compression",
                         ("policy", "kind"))

TRANSFER_BYTES = _unregistered(Counter, "kvrelay_transfer_bytes", "Bytes moved over pair groups", ("direction",))
TRANSFER_SECONDS = _unregistered(Histogram, "kvrelay_transfer_seconds",
                                 "Transfer duration (send: AcceptTransfer to the last layer out; recv: receives posted to the whole view in)",
                                 ("direction",), buckets=LATENCY_BUCKETS)
PAIR_GROUPS_CREATED = _unregistered(Counter, "kvrelay_pair_groups_created", "Pairwise process groups created",
                                    ("side",))
PAIR_GROUPS_EVICTED = _unregistered(Counter, "kvrelay_pair_groups_evicted",
                                    "Pairwise process groups closed to make room (lru), when idle (idle), or after a failure, a cancel or the peer's close (discarded)",
                                    ("side", "cause"))

DECODE_REJECTED = _unregistered(Counter, "kvrelay_decode_transfers_rejected",
                                "Transfers rejected before decoding, by error", ("error",))
DECODE_ACTIVE = _unregistered(Gauge, "kvrelay_decode_requests_active", "Requests admitted or waiting for the batch")
DECODE_WAITING = _unregistered(Gauge, "kvrelay_decode_requests_waiting", "Verified requests waiting for room in the batch")
DECODE_KV_RESERVED = _unregistered(Gauge, "kvrelay_decode_kv_reserved_bytes",
                                   "KV bytes reserved by accepted transfers (resident rows plus room to append)")
DECODE_KV_ALLOCATED = _unregistered(Gauge, "kvrelay_decode_kv_allocated_bytes",
                                    "KV bytes of the pool pages decode caches hold now (<= reserved)")
DECODE_BATCH = _unregistered(Histogram, "kvrelay_decode_batch_size", "Requests per decode step",
                             buckets=BATCH_BUCKETS)
DECODE_TOKENS = _unregistered(Counter, "kvrelay_decode_tokens", "Output tokens decoded (the first comes from prefill)")
DECODE_TPOT = _unregistered(Histogram, "kvrelay_decode_tpot_seconds",
                            "Mean time per decoded token, per finished request", buckets=TOKEN_BUCKETS)
DECODE_NON_FINITE = _unregistered(Counter, "kvrelay_decode_non_finite",
                                  "Requests failed alone because their logits were not finite (their batch went on)")

OFFLOAD_STORE_BYTES = _unregistered(Gauge, "kvrelay_offload_store_bytes",
                                    "Host bytes of omitted rows held for recallable_remote requests")
OFFLOAD_REFUSALS = _unregistered(Counter, "kvrelay_offload_refusals",
                                 "Requests whose omitted rows the offload store refused (they continue irrecoverable)",
                                 ("reason",))
OFFLOAD_RELEASED = _unregistered(Counter, "kvrelay_offload_released",
                                 "Stored states dropped: request ended, lease expired, generation fenced out, LRU-evicted",
                                 ("cause",))
OFFLOAD_RECALLS_SERVED = _unregistered(Counter, "kvrelay_offload_recalls_served",
                                       "Recall calls answered by this prefill worker, by outcome", ("outcome",))
RECALLS = _unregistered(Counter, "kvrelay_recalls", "Recalls of omitted pages, by outcome", ("outcome",))
RECALL_ROWS = _unregistered(Counter, "kvrelay_recall_rows", "Omitted rows brought back by recalls")
RECALL_BYTES = _unregistered(Counter, "kvrelay_recall_bytes", "Bytes of recalled rows (K, V and positions)")
RECALL_SECONDS = _unregistered(Histogram, "kvrelay_recall_seconds",
                               "One recall, from asking to the rows in hand (or giving up)", buckets=LATENCY_BUCKETS)
RECALL_FALLBACKS = _unregistered(Counter, "kvrelay_recall_fallbacks",
                                 "Declared fallbacks taken, e.g. recall_timeout:continue_lossy", ("kind",))
RETENTION_RESIDENT = _unregistered(Histogram, "kvrelay_decode_retention_resident_rows",
                                   "Rows of a retaining request's fullest (layer, owner) after a decode step",
                                   buckets=ROW_BUCKETS)
RETENTION_OVER_BUDGET = _unregistered(Counter, "kvrelay_decode_retention_over_budget",
                                      "Decode steps after which an owner held more rows than its declared budget")
RETENTION_EVICTED = _unregistered(Counter, "kvrelay_decode_retention_evicted_rows",
                                  "Rows evicted by decode-time retention")
RETENTION_PUBLICATIONS = _unregistered(Counter, "kvrelay_decode_retention_publications",
                                       "Retention successor states told to the policy service, by outcome",
                                       ("outcome",))

_COMMON: tuple[Collector, ...] = (RPC_REQUESTS, RPC_DURATION)
_TRANSFER: tuple[Collector, ...] = (TRANSFER_BYTES, TRANSFER_SECONDS, PAIR_GROUPS_CREATED, PAIR_GROUPS_EVICTED)
ROLE_FAMILIES: dict[str, tuple[Collector, ...]] = {
    "gateway": (GATEWAY_TTFT, GATEWAY_TPOT, GATEWAY_IN_FLIGHT, GATEWAY_WAITING, GATEWAY_RETRIES, HTTP_REQUESTS,
                HTTP_DURATION),
    "policy": (STALE_REJECTIONS, POLICY_UNDECODABLE_ENTRIES, POLICY_SESSIONS, POLICY_SESSIONS_OPEN),
    "prefill": (STALE_REJECTIONS, PREFILL_STAGE, PREFILL_IN_FLIGHT, PREFILL_QUEUE_DEPTH, KV_ROWS, KV_BYTES,
                OFFLOAD_STORE_BYTES, OFFLOAD_REFUSALS, OFFLOAD_RELEASED, OFFLOAD_RECALLS_SERVED, *_TRANSFER),
    "decode": (STALE_REJECTIONS, DECODE_REJECTED, DECODE_ACTIVE, DECODE_WAITING, DECODE_KV_RESERVED, DECODE_KV_ALLOCATED,
               DECODE_BATCH, DECODE_TOKENS, DECODE_TPOT, DECODE_NON_FINITE, RECALLS, RECALL_ROWS, RECALL_BYTES,
               RECALL_SECONDS, RECALL_FALLBACKS, RETENTION_RESIDENT, RETENTION_OVER_BUDGET, RETENTION_EVICTED,
               RETENTION_PUBLICATIONS, *_TRANSFER),
}


def registry_for(role: str) -> CollectorRegistry:
    """A registry with the families `role` exposes, plus process and runtime collectors."""
    if role not in ROLE_FAMILIES:
        raise ValueError(f"role: {role!r} is not one of {ROLES}")
    registry = CollectorRegistry(auto_describe=True)
    for collector in (*_COMMON, *ROLE_FAMILIES[role], PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


@dataclass(frozen=True)
class MetricsEndpoint:
    """A running metrics HTTP server; `stop()` closes it."""

    host: str
    port: int
    server: Any

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(role: str, host: str, port: int) -> MetricsEndpoint | None:
    """Serve `registry_for(role)` at http://host:port/metrics on a daemon thread; None when
    `port` is 0 or the port is taken (logged: the service keeps serving without metrics)."""
    if port == 0:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry_for(role))
    except OSError as exc:
        log.error("metrics endpoint %s:%d not started (%s); this %s service runs without metrics",
                  host, port, exc, role)
        return None
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsEndpoint(host, bound, server)


@contextlib.contextmanager
def timed(histogram: Any) -> Any:
    """Observe the block's wall time (seconds) in `histogram` (a labelled child is fine)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        histogram.observe(time.perf_counter() - started)


class RpcMetricsInterceptor(HandlerInterceptor):
    """Counts and times every served call (unary and server-streaming) by method and final
    status code; health checks and reflection are left out."""

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if method.startswith(_UNMEASURED_PREFIXES):
            return handler
        measured = rewrap(handler, unary=functools.partial(_measured_unary, method),
                          stream=functools.partial(_measured_stream, method), async_only=False)
        return measured if measured is not None else handler


def _measured_unary(method: str, behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            return await behavior(request, context)
        except BaseException as exc:
            error = exc
            raise
        finally:
            observe_rpc(method, _final_code(context, error), started)

    return unary


def _measured_stream(
    method: str, behavior: Callable[..., AsyncGenerator[Any, None]]
) -> Callable[..., Awaitable[None]]:
    """The outermost layer of every served stream, so it also owns the stream's lifetime: it
    writes each response (`context.write`) instead of yielding it, and closes the handler's
    generator in this task. grpc abandons a yielding handler that is cancelled while a
    response is being sent; Python then finalises that generator, and each one it delegates
    to, in a task of its own, whose contextvars Context is not the one their `with` blocks
    were entered in, so every context token reset there (OpenTelemetry's detach, a bound
    request id) fails and is logged at ERROR. Here a client cancel arrives at `write`, and
    every layer unwinds in the call's own task and Context."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    await context.write(response)
        except BaseException as exc:
            error = exc
            raise
        finally:
            observe_rpc(method, _final_code(context, error), started)

    return stream


def _final_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return grpc.StatusCode.OK.name
    if isinstance(error, GeneratorExit | asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED.name
    return grpc.StatusCode.UNKNOWN.name


def observe_rpc(method: str, code: str, started: float) -> None:
    """Count and time one served call (`method` as "/package.Service/Method", `code` a status
    name): for calls that are not gRPC calls of their own, such as those of a policy Session."""
    count, duration = _rpc_series(method, code)
    count.inc()
    duration.observe(time.perf_counter() - started)


@functools.lru_cache(maxsize=1024)
def _rpc_series(method: str, code: str) -> tuple[Any, Any]:
    """The two labelled series of (method, code), looked up once: `labels()` takes a lock and
    builds a key on every call, a cost the policy service paid twice per call at thousands of
    calls per second. Bounded: methods and codes are fixed sets."""
    return RPC_REQUESTS.labels(method, code), RPC_DURATION.labels(method, code)
