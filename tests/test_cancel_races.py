"""A cancel that lands in the same event-loop turn as the result it waited for must still
cancel. On Python 3.11 `asyncio.wait_for` returns the result instead and the cancel is lost
(CPython gh-86296): a client that left mid-stream then had its request decoded to the last
token (seen in CI: 3,499 tokens after a 1 s client timeout). The waits a cancel must reach
while tokens keep arriving use `asyncio.timeout`; these tests fail with `wait_for` there."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from decode_worker.admit import Decoding
from decode_worker.stream import _next_event
from services.gateway.orchestrator import Orchestrator
from services.gateway.summary import TokenClock
from services.rpc.kvrelay.v1 import decode_pb2


class ReadyCall:
    """A decode stream call whose next event the test hands over."""

    def __init__(self) -> None:
        self.next: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def read(self) -> Any:
        return await self.next


async def cancelled_as_it_resolves(waiting: asyncio.Task[Any], resolve: Any) -> None:
    await asyncio.sleep(0)  # the task is waiting now
    resolve()  # its result is ready ...
    waiting.cancel()  # ... and the cancel comes in the same turn
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_the_gateway_stops_reading_a_decode_stream_it_was_cancelled_on() -> None:
    call = ReadyCall()
    orchestrator = Orchestrator.__new__(Orchestrator)  # _read touches no pool on a good event
    decode = SimpleNamespace(address="127.0.0.1:1")  # the worker it reads from, named in errors
    reading = asyncio.create_task(orchestrator._read(call, 5.0, decode, TokenClock()))  # type: ignore[arg-type]
    await cancelled_as_it_resolves(reading, lambda: call.next.set_result(decode_pb2.DecodeEvent()))


async def test_the_decode_worker_stops_streaming_a_request_it_was_cancelled_on() -> None:
    events: asyncio.Queue[decode_pb2.DecodeEvent] = asyncio.Queue()
    decoding = Decoding(events, None, lambda: None)
    streaming = asyncio.create_task(_next_event(decoding, 5.0))
    await cancelled_as_it_resolves(streaming, lambda: events.put_nowait(decode_pb2.DecodeEvent()))
    assert events.qsize() == 1  # the event it was cancelled on is not lost either


PRODUCT = ("services", "policy_service", "prefill_worker", "decode_worker", "kvrelay")


def test_no_product_code_waits_with_wait_for() -> None:
    root = Path(__file__).resolve().parents[1]
    found = [f"{path.relative_to(root)}:{number}" for package in PRODUCT for path in sorted((root / package).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if "asyncio.wait_for(" in line]
    assert not found, f"asyncio.wait_for can lose a cancel on Python 3.11; use asyncio.timeout: {found}"
