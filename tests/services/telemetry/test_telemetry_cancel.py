"""A client that cancels a server stream mid-flight logs nothing at ERROR, with tracing off and
on: the handler's generator (and every `with` block in it: a span, a bound request id) is
closed in the call's own task and Context, not left for the garbage collector to finalise in
another one (`... was created in a different Context`). Each mode runs the production server
bootstrap in a fresh interpreter, since a tracer provider is process-global."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)
CANCELS = 5

_PROBE = """
import asyncio, gc, json, logging, sys, time
import grpc
from services.rpc.errors import maps_errors
from services.rpc.server import ServerConfig, ServiceBinding, start_server
from services.telemetry.spans import span
from services.telemetry.tracing import configure_tracing

errors = []


class KeepErrors(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.ERROR:
            cause = record.exc_info[1] if record.exc_info else ""
            errors.append(f"{record.name}: {record.getMessage()} {cause}"[:300])


logging.basicConfig(level=logging.INFO, handlers=[KeepErrors()], force=True)
tracing = configure_tracing("kvrelay-probe")
SERVICE = "kvrelay.test.Stream"
closed = []  # per stream: closed in the task that ran it


class Stream:
    @maps_errors
    async def tokens(self, request, context):
        task = asyncio.current_task()
        # An OpenTelemetry context token and a bound request id, reset when the block exits.
        with span("probe.stream", request_id=request.decode()):
            try:
                for _ in range(1_000_000):  # as fast as grpc sends: a cancel lands mid-send
                    yield b"x" * 4096
            finally:
                closed.append(asyncio.current_task() is task)


def register(server):
    handlers = {"Tokens": grpc.unary_stream_rpc_method_handler(Stream().tokens)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def main():
    bindings = [ServiceBinding(SERVICE, register)]
    server = await start_server(ServerConfig(port=0, shutdown_grace_s=0), bindings)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stream = channel.unary_stream(f"/{SERVICE}/Tokens")
            for k in range(int(sys.argv[1])):
                call = stream(f"req-{k}".encode(), timeout=30)
                for _ in range(3):
                    await call.read()
                call.cancel()
        deadline = time.monotonic() + 10
        while len(closed) < int(sys.argv[1]) and time.monotonic() < deadline:
            gc.collect()
            await asyncio.sleep(0.05)
        for _ in range(3):  # let a finaliser task run and be collected (asyncio logs it then)
            gc.collect()
            await asyncio.sleep(0.05)
    finally:
        await server.stop(0)
    tracing.shutdown()
    result = {"errors": errors, "closed": closed, "tracing": tracing.config.enabled}
    print("PROBE " + json.dumps(result))


asyncio.run(main())
"""


def _probe(environ: dict[str, str]) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(CANCELS)],
        env={**clean, **environ},
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    )
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith("PROBE "))
    return dict(json.loads(line.removeprefix("PROBE ")))


@pytest.mark.parametrize(
    "environ", [{}, {"OTEL_TRACES_EXPORTER": "console"}], ids=["tracing-off", "tracing-on"]
)
def test_cancelled_streams_close_in_their_own_task_and_log_no_error(
    environ: dict[str, str],
) -> None:
    result = _probe(environ)
    assert result["tracing"] is bool(environ)
    assert result["errors"] == []
    assert result["closed"] == [True] * CANCELS
