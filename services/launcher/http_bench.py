"""`kvrelay bench http`: TTFT and TPOT through the OpenAI-compatible HTTP front vs the gRPC
`Generate`, the same prompts, one stack, one run.

A local stack (policy service, one prefill worker, one decode worker, the gateway with its HTTP
front; each its own process) starts on free ports. At each concurrency (default 1 and 16) the
same prompts go through both fronts in alternating rounds of `concurrency` simultaneous
requests (gRPC then HTTP, then HTTP then gRPC, ...), so drift in the machine's load hits both alike. HTTP
requests are `/v1/completions` with the prompt's token ids and `stream: true` (server-sent
events, read with the standard library's http.client); gRPC requests are `Generate` with the
same ids, both detokenized, greedy, same policy and max_tokens. Timed as the client sees it:
TTFT from sending the request to the first token; TPOT the mean gap per output token after the
first (the last token's arrival minus the first's, over output tokens - 1). Reported: p50 and
p90 of each per (front, concurrency), and their HTTP/gRPC ratios.
"""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from services.gateway.client import GatewayClient, generate_request
from services.launcher.bench import filler_ids
from services.launcher.stack import Stack, StackConfig
from services.model.loader import read_checkpoint
from services.model.tokenizer import TextTokenizer
from services.redis_embedded import free_loopback_port

FRONTS = ("grpc", "http")


@dataclass(frozen=True)
class HttpBenchConfig:
    checkpoint: Path
    concurrency: tuple[int, ...] = (1, 16)
    rounds: int = 4
    context: int = 256
    max_tokens: int = 32
    policy: str = "snapkv"
    threads: int = 1
    seed: int = 0
    start_timeout_s: float = 300.0

    def rounds_at(self, level: int) -> int:
        """`rounds`, and more at low concurrency: every cell measures at least 16 requests."""
        return max(self.rounds, -(-16 // level))

    def __post_init__(self) -> None:
        if not self.concurrency or any(not 1 <= c <= 64 for c in self.concurrency):
            raise ValueError(f"concurrency: {self.concurrency} must be levels in 1..64")
        if not 1 <= self.rounds <= 50:
            raise ValueError(f"rounds: {self.rounds} must be in 1..50")
        if self.context < 16 or self.max_tokens < 2 or self.threads < 1:
            raise ValueError("context/max_tokens/threads: need context >= 16, max_tokens >= 2 (a TPOT), threads >= 1")


@dataclass(frozen=True)
class Timing:
    """One request as the client saw it (ms)."""

    ttft_ms: float
    tpot_ms: float
    output_tokens: int


@dataclass(frozen=True)
class Cell:
    front: str
    concurrency: int
    timings: tuple[Timing, ...]

    def quantile(self, name: str, q: float) -> float:
        values = sorted(getattr(t, name) for t in self.timings)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def _timing(began: float, first: float, last: float, tokens: int) -> Timing:
    if tokens < 2:
        raise RuntimeError(f"{tokens} token(s) streamed: no TPOT (the model ended early)")
    return Timing(1000 * (first - began), 1000 * (last - first) / (tokens - 1), tokens)


def grpc_request(client: GatewayClient, ids: Sequence[int], config: HttpBenchConfig) -> Timing:
    """One Generate on a shared channel (gRPC clients multiplex one connection)."""
    request = generate_request(list(ids), policy=config.policy, max_tokens=config.max_tokens)
    began = time.perf_counter()
    arrivals = [time.perf_counter() for event in client.stream(request) if event.HasField("token")]
    return _timing(began, arrivals[0], arrivals[-1], len(arrivals))


# uvicorn closes a kept-alive connection after 5 s idle; the pool drops them sooner.
_MAX_IDLE_S = 2.0


class Connections:
    """Kept-alive HTTP/1.1 connections, one per request in flight (as an HTTP client pools them)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._idle: queue.SimpleQueue[tuple[float, http.client.HTTPConnection]] = queue.SimpleQueue()

    def take(self) -> http.client.HTTPConnection:
        while True:
            try:
                since, connection = self._idle.get_nowait()
            except queue.Empty:
                return http.client.HTTPConnection(self.host, self.port, timeout=600)
            if time.monotonic() - since < _MAX_IDLE_S:
                return connection
            connection.close()

    def give(self, connection: http.client.HTTPConnection) -> None:
        self._idle.put((time.monotonic(), connection))

    def close(self) -> None:
        while not self._idle.empty():
            self._idle.get_nowait()[1].close()


def http_request(connections: Connections, model: str, ids: Sequence[int], config: HttpBenchConfig) -> Timing:
    body = json.dumps({"model": model, "prompt": list(ids), "max_tokens": config.max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}, "kv_policy": config.policy})
    connection = connections.take()
    began = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        connection.close()
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    arrivals, tokens = _read_events(response)
    connections.give(connection)
    return _timing(began, arrivals[0], arrivals[-1], tokens)


def _read_events(response: http.client.HTTPResponse) -> tuple[list[float], int]:
    """Arrival times of the chunks that carry text, and the completion tokens of the usage."""
    arrivals: list[float] = []
    tokens = 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: "):])
        if "error" in chunk:
            raise RuntimeError(f"stream failed: {chunk['error']}")
        if chunk.get("usage"):
            tokens = int(chunk["usage"]["completion_tokens"])
        elif chunk["choices"] and chunk["choices"][0]["text"]:
            arrivals.append(time.perf_counter())
    return arrivals, tokens


def _round(send: Callable[[Sequence[int]], Timing], prompts: Sequence[Sequence[int]]) -> list[Timing]:
    """All `prompts` at once, one thread each."""
    start = threading.Barrier(len(prompts))

    def one(ids: Sequence[int]) -> Timing:
        start.wait(timeout=60)
        return send(ids)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def run_http_bench(config: HttpBenchConfig) -> list[Cell]:
    """One stack; per concurrency level, alternating gRPC and HTTP rounds of the same prompts."""
    tokenizer = read_checkpoint(config.checkpoint).require_tokenizer()
    stack = Stack(StackConfig.with_free_ports(config.checkpoint, threads=config.threads, metrics_base_port=0,
                                              http_port=free_loopback_port(),
                                              start_timeout_s=config.start_timeout_s))
    model = config.checkpoint.stem if config.checkpoint.suffix == ".gguf" else config.checkpoint.name
    connections = Connections(stack.config.host, stack.config.http_port)
    with stack, GatewayClient(stack.gateway_address, timeout_s=600) as client:
        fronts: dict[str, Callable[[Sequence[int]], Timing]] = {
            "grpc": lambda ids: grpc_request(client, ids, config),
            "http": lambda ids: http_request(connections, model, ids, config),
        }
        try:
            return _measure(config, fronts, tokenizer)
        finally:
            connections.close()


def _measure(config: HttpBenchConfig, fronts: dict[str, Callable[[Sequence[int]], Timing]],
             tokenizer: TextTokenizer) -> list[Cell]:
    warmup = [filler_ids(tokenizer, config.context, config.seed)] * max(config.concurrency)
    for send in fronts.values():  # channels, connections, caches
        _round(send, warmup)
    cells = []
    for level in config.concurrency:
        timings: dict[str, list[Timing]] = {front: [] for front in FRONTS}
        for index in range(config.rounds_at(level)):
            prompts = [filler_ids(tokenizer, config.context, config.seed + 1000 * index + i) for i in range(level)]
            for front in FRONTS if index % 2 == 0 else FRONTS[::-1]:  # ABBA: neither always goes first
                timings[front] += _round(fronts[front], prompts)
        cells += [Cell(front, level, tuple(timings[front])) for front in FRONTS]
    return cells


def render_markdown(config: HttpBenchConfig, cells: Sequence[Cell], command: str, host: str) -> str:
    columns = ["concurrency", "front", "requests", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms"]
    rows = []
    for level in config.concurrency:
        by_front = {c.front: c for c in cells if c.concurrency == level}
        for front in FRONTS:
            cell = by_front[front]
            rows.append([level, front, len(cell.timings), *(round(cell.quantile(n, q), 2) for n in ("ttft_ms", "tpot_ms")
                                                            for q in (0.5, 0.9))])
        grpc, http = by_front["grpc"], by_front["http"]
        rows.append([level, "http/grpc", "", *(round(http.quantile(n, q) / grpc.quantile(n, q), 3)
                                              for n in ("ttft_ms", "tpot_ms") for q in (0.5, 0.9))])
    table = ["| " + " | ".join(columns) + " |", "|" + "|".join("---:" for _ in columns) + "|"]
    table += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    return "\n".join([
        "# The OpenAI-compatible HTTP front vs gRPC Generate", "",
        f"`{command}` ({host}). Checkpoint `{config.checkpoint.name}`, policy `{config.policy}`, "
        f"{config.context}-token prompts, {config.max_tokens} output tokens (greedy, detokenized), "
        f"{config.threads} torch thread(s) per service. One stack; at each concurrency c, "
        f"max({config.rounds}, 16/c) rounds of c simultaneous requests per front, gRPC and HTTP rounds alternating (ABBA), the "
        "same prompts on both. HTTP = `/v1/completions` with `stream: true` (SSE); gRPC = `Generate`. "
        "Client-side times: TTFT from sending to the first token; TPOT the mean gap per token after "
        "the first. The client's threads share the machine with the stack.", "",
        *table, "",
    ])
