"""The OpenAI-compatible HTTP front: a FastAPI app over the gateway's own orchestration.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /health

A completion request is authenticated (the `authenticate` hook, if any), parsed and translated
(`convert`), validated by the gateway's `PromptValidator` — the same validation as gRPC — and
run by `services.gateway.service.stream_events`, the same call the gRPC servicer makes. Its
tokens come back as one JSON object or as server-sent events ending `data: [DONE]`; an error
becomes OpenAI's error JSON through the one table in `openai_api.errors`. A client that
disconnects cancels the request: the orchestrator cancels the decode worker's stream (its KV
is freed) and ends the request, as for a cancelled gRPC call. Each request gets a SERVER
span that continues the caller's `traceparent` and is the parent of the gateway's calls to
the workers, so an HTTP request is one trace like a gRPC one; its route, status and duration
land in `kvrelay_http_requests_total` / `kvrelay_http_request_duration_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace

from services.echo import truncated
from services.gateway.errors import DeadlineExceeded
from services.gateway.openai_api.convert import Kind, OpenAIRequest, parse_body
from services.gateway.openai_api.errors import HttpError, http_error
from services.gateway.openai_api.responses import (
    Completion,
    Identity,
    finish_chunk,
    first_chunk,
    text_chunk,
    usage_chunk,
)
from services.gateway.openai_api.stops import StopMatcher
from services.gateway.orchestrator import Orchestrator
from services.gateway.prompts import PromptValidator
from services.gateway.service import stream_events
from services.gateway.validation import GenerationInput
from services.rpc.errors import InvalidArgument, NotFound
from services.rpc.kvrelay.v1 import gateway_pb2
from services.telemetry import metrics
from services.telemetry.spans import record_error, start_server_span

log = logging.getLogger(__name__)

# Sees the request's headers; raises a ServiceError whose code is UNAUTHENTICATED (401) or
# PERMISSION_DENIED (403) to refuse it. API keys plug in here.
Authenticate = Callable[[Mapping[str, str]], Awaitable[None] | None]
_ROUTES: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
CLIENT_CLOSED = 499  # nginx's code for "the client went away"; recorded, never sent


@dataclass(frozen=True)
class Front:
    """What the HTTP front needs of its gateway."""

    prompts: PromptValidator
    orchestrator: Orchestrator
    model_name: str
    ready: Callable[[], bool]
    request_timeout_s: float
    max_body_bytes: int
    authenticate: Authenticate | None = None
    created: int = 0


def create_app(front: Front) -> FastAPI:
    """The ASGI app; uvicorn serves it (`services.gateway.openai_api.server`)."""
    app = FastAPI(title="kvrelay", docs_url=None, redoc_url=None, openapi_url=None)
    handler = _Handler(front)
    app.add_api_route("/health", handler.health, methods=["GET"])
    app.add_api_route("/v1/models", handler.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", handler.model, methods=["GET"])
    app.add_api_route("/v1/chat/completions", handler.chat, methods=["POST"])
    app.add_api_route("/v1/completions", handler.completion, methods=["POST"])
    return app


class _Refused(Exception):
    """A stream that failed before its first event: answered as an ordinary error response."""

    def __init__(self, error: HttpError) -> None:
        super().__init__(error.body["error"]["message"])
        self.error = error


class _EventStream(StreamingResponse):
    """Server-sent events. The status line waits for the first event, so a request refused
    before it (an unknown kv_policy, busy or unavailable workers, the deadline) gets its own
    status and error body, as without streaming. The body generator is closed in the response's
    own task: left to the garbage collector, it would unwind the request's spans in another
    Context. While it waits, a client that disconnects cancels it (starlette listens)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def stream_response(self, send: Any) -> None:
        async with contextlib.aclosing(self._events) as events:
            try:
                first = await anext(events)
            except _Refused as refused:
                answer = JSONResponse(refused.error.body, status_code=refused.error.status)
                await send({"type": "http.response.start", "status": answer.status_code,
                            "headers": answer.raw_headers})
                await send({"type": "http.response.body", "body": answer.body, "more_body": False})
                return
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class _Handler:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.created = front.created or int(time.time())

    async def health(self) -> Response:
        ready = self.front.ready()
        return JSONResponse({"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503)

    async def models(self, request: Request) -> Response:
        return await self._listing(request, "/v1/models", None)

    async def model(self, request: Request, model: str) -> Response:
        return await self._listing(request, "/v1/models/{model}", model)

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completion(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _listing(self, request: Request, route: str, model: str | None) -> Response:
        started = time.perf_counter()
        try:
            await self._authenticate(request)
            if model is not None and model != self.front.model_name:
                raise NotFound(f"the model {truncated(model, 100)!r} does not exist", field="model")
        except Exception as exc:
            return _done(route, started, _error_response(exc))
        card = {"id": self.front.model_name, "object": "model", "created": self.created, "owned_by": "kvrelay"}
        body = card if model is not None else {"object": "list", "data": [card]}
        return _done(route, started, JSONResponse(body))

    async def _complete(self, request: Request, kind: Kind) -> Response:
        route, started = _ROUTES[kind], time.perf_counter()
        span = start_server_span(f"POST {route}", request.headers, **{"http.method": "POST", "http.route": route})
        parsed: OpenAIRequest | None = None
        try:
            with trace.use_span(span, end_on_exit=False):
                await self._authenticate(request)
                parsed = parse_body(await self._body(request), kind, self.front.model_name)
                if parsed.user:
                    span.set_attribute("openai.user", truncated(parsed.user, 64))
                generation = await self.front.prompts.validate(parsed.generate, zero_max_tokens_is_default=True)
        except Exception as exc:
            record_error(span, exc)
            response = _error_response(exc, parsed)
            span.set_attribute("http.status_code", response.status_code)
            span.end()
            return _done(route, started, response)
        run = _Run(self.front, parsed, generation, time.monotonic() + self.front.request_timeout_s, self.created)
        if parsed.stream:
            return _EventStream(run.stream(span, route, started))
        with trace.use_span(span, end_on_exit=True):
            answer = await _unless_disconnected(request, run.collect())
            span.set_attribute("http.status_code", answer.status_code)
        return _done(route, started, answer)

    async def _authenticate(self, request: Request) -> None:
        if self.front.authenticate is not None:
            result = self.front.authenticate(request.headers)
            if inspect.isawaitable(result):
                await result

    async def _body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.front.max_body_bytes:
            raise InvalidArgument(f"{declared} bytes exceeds the limit of {self.front.max_body_bytes}", field="body")
        body = await request.body()
        if len(body) > self.front.max_body_bytes:
            raise InvalidArgument(f"{len(body)} bytes exceeds the limit of {self.front.max_body_bytes}", field="body")
        return body


class _Run:
    """One validated completion request: its events, as one body or as server-sent events."""

    def __init__(self, front: Front, parsed: OpenAIRequest, generation: GenerationInput, deadline: float,
                 created: int) -> None:
        self.front = front
        self.parsed = parsed
        self.generation = generation
        self.deadline = deadline
        self.stops = StopMatcher(parsed.stops) if parsed.stops else None
        identity = Identity(parsed.kind, generation.request_id, front.model_name, created)
        self.completion = Completion(identity)

    async def events(self) -> AsyncGenerator[gateway_pb2.GenerateEvent, None]:
        """The gateway's events within the request timeout (DeadlineExceeded after it)."""
        stops = self.stops
        remaining = max(0.0, self.deadline - time.monotonic())
        events = stream_events(self.front.orchestrator, self.generation, remaining,
                               (lambda: stops.matched) if stops is not None else None)
        async with contextlib.aclosing(events):
            while True:
                try:
                    async with asyncio.timeout_at(_loop_time(self.deadline)):
                        event = await anext(events)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise DeadlineExceeded(f"no answer within the request timeout of "
                                           f"{self.front.request_timeout_s:g} s") from None
                yield event

    def text_of(self, event: gateway_pb2.GenerateEvent) -> str:
        """The text an event adds to the output (stop strings cut, held-back text released)."""
        if event.HasField("summary"):
            self.completion.summary = event.summary
            return self.stops.flush() if self.stops is not None else ""
        return self.stops.feed(event.token.text) if self.stops is not None else event.token.text

    async def collect(self) -> Response:
        try:
            async with contextlib.aclosing(self.events()) as events:
                async for event in events:
                    self.completion.text.append(self.text_of(event))
        except Exception as exc:
            record_error(trace.get_current_span(), exc)
            return _error_response(exc, self.parsed)
        return JSONResponse(self.completion.body())

    async def stream(self, span: trace.Span, route: str, started: float) -> AsyncGenerator[bytes, None]:
        """Chunks of server-sent events; `_Refused` when the request fails before the first."""
        status, sent = 200, False
        with trace.use_span(span, end_on_exit=True):
            try:
                # Closed here when the response closes this generator (a client that went away):
                # left to the garbage collector, the gateway's context vars would unwind elsewhere.
                async with contextlib.aclosing(self.events()) as events:
                    async for event in events:
                        opening = None if sent else first_chunk(self.completion.identity)
                        text = self.text_of(event)
                        for chunk in (opening, text_chunk(self.completion.identity, text) if text else None):
                            if chunk is not None:
                                sent = True
                                yield _sse(chunk)
                sent = True
                yield _sse(finish_chunk(self.completion))
                if self.parsed.include_usage:
                    yield _sse(usage_chunk(self.completion))
            except asyncio.CancelledError:  # the client went away
                status = CLIENT_CLOSED
                raise
            except Exception as exc:
                record_error(span, exc)
                error = http_error(exc, self.parsed.param)
                status = error.status
                if not sent:
                    raise _Refused(error) from exc
                yield _sse(error.body)  # after the 200 went out: the error is the last event
            finally:
                span.set_attribute("http.status_code", status)
                _observe(route, started, status)
            yield _sse("[DONE]")


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, or — when the client disconnects first — `work` cancelled."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("HTTP client disconnected; request cancelled")
    return Response(status_code=CLIENT_CLOSED)


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _loop_time(monotonic_deadline: float) -> float:
    """A time.monotonic() deadline on the event loop's clock."""
    return asyncio.get_running_loop().time() + (monotonic_deadline - time.monotonic())


def _error_response(exc: BaseException, parsed: OpenAIRequest | None = None) -> JSONResponse:
    error = http_error(exc, parsed.param if parsed is not None else lambda field: field)
    return JSONResponse(error.body, status_code=error.status)


def _done(route: str, started: float, response: Response) -> Response:
    _observe(route, started, response.status_code)
    return response


def _observe(route: str, started: float, status: int) -> None:
    metrics.HTTP_REQUESTS.labels(route, str(status)).inc()
    metrics.HTTP_DURATION.labels(route).observe(time.perf_counter() - started)
