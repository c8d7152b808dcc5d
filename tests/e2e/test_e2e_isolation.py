"""Issue 15, items 1 and 13, through the real stack (`kvrelay up`: every service its own
process, real gRPC, Redis and gloo).

Item 1: a request at a temperature the validator admits but the old sampler could not take
(9e-39 overflowed float32 at its first decode step on this checkpoint: "decode loop failed"
for every stream on its decode worker; <= 3.7e-38 broke prefill on larger logits) arrives while
twelve innocent requests are decoding on the two decode workers. Every request completes: the
innocent ones with the runtime's own greedy output (its first 64 tokens compared), the extreme
ones with valid tokens (at such temperatures, greedy's). Item 13: client cancels leave no
ERROR in any service's log."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import grpc
import pytest
from e2e_helpers import UpStack, needle_ids

from services.gateway.client import generate_request
from services.model import LoadedModel, generate
from services.rpc.kvrelay.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
INNOCENT = 12
INNOCENT_TOKENS = 1500  # still decoding when the extreme requests arrive
CHECKED_TOKENS = 64  # the greedy prefix compared with the runtime's own generation
# (prompt tokens, needle seed, temperature): 9e-39 lies between this prompt's prefill and decode
# logit maxima over float32's largest value, so only the decode loop overflowed; the other two
# are the values.
EXTREME = ((96, 20, 9e-39), (64, 27, 4.6e-38), (48, 2, 1e-45))
CANCELS = 3


class Stream:
    """One Generate call's events and when (client clock) its first and last ones came."""

    def __init__(self, request: gateway_pb2.GenerateRequest) -> None:
        self.request = request
        self.events: list[gateway_pb2.GenerateEvent] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.first_token = asyncio.Event()
        self.first_at = self.done_at = math.inf

    async def run(self, stub: gateway_pb2_grpc.GatewayStub) -> None:
        try:
            async for event in stub.Generate(self.request, timeout=150):
                self.events.append(event)
                if len(self.events) == 2:  # token 1: this request is in a decode batch
                    self.first_at = time.monotonic()
                    self.first_token.set()
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        finally:
            self.done_at = time.monotonic()
            self.first_token.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token.token_id for e in self.events if e.HasField("token")]

    @property
    def summary(self) -> gateway_pb2.GenerateSummary:
        assert self.error is None and self.events and self.events[-1].HasField("summary"), (
            self.error
        )
        return self.events[-1].summary


async def test_extreme_temperatures_fail_no_innocent_request(
    stack: UpStack, loaded: LoadedModel
) -> None:
    innocent_prompts = [needle_ids(loaded, 48 + 8 * (i % 6), 900 + i) for i in range(INNOCENT)]
    innocent = [
        Stream(
            generate_request(
                p,
                policy="full",
                max_tokens=INNOCENT_TOKENS,
                detokenize=False,
                request_id=f"e2e-innocent-{i}",
            )
        )
        for i, p in enumerate(innocent_prompts)
    ]
    extreme_prompts = [needle_ids(loaded, tokens, seed) for tokens, seed, _ in EXTREME]
    extreme = [
        Stream(
            generate_request(
                p,
                policy="full",
                max_tokens=24,
                temperature=t,
                seed=5,
                detokenize=False,
                request_id=f"e2e-extreme-{i}",
            )
        )
        for i, (p, (_, _, t)) in enumerate(zip(extreme_prompts, EXTREME, strict=True))
    ]
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        running = [asyncio.create_task(s.run(stub)) for s in innocent]
        await asyncio.wait_for(asyncio.gather(*(s.first_token.wait() for s in innocent)), 120)
        running += [asyncio.create_task(s.run(stub)) for s in extreme]
        await asyncio.wait_for(asyncio.gather(*running), 200)

    assert [s.error for s in innocent + extreme if s.error is not None] == []
    for stream, prompt in zip(innocent, innocent_prompts, strict=True):
        assert stream.summary.output_tokens == len(stream.tokens)
        assert stream.tokens[:CHECKED_TOKENS] == generate(
            loaded, prompt, max_new_tokens=CHECKED_TOKENS
        )
    vocab = loaded.config.vocab_size
    for stream, prompt in zip(extreme, extreme_prompts, strict=True):
        assert stream.summary.output_tokens == len(stream.tokens) >= 1
        assert all(0 <= t < vocab for t in stream.tokens)
        assert stream.tokens == generate(loaded, prompt, max_new_tokens=24)  # T -> 0 is greedy
    # Innocent requests that were still streaming, on the same decode worker, when an extreme one
    # sampled its first decoded token: at least six shared its batches.
    shared = max(
        sum(
            1
            for s in innocent
            if s.summary.decode_worker == e.summary.decode_worker and s.done_at > e.first_at
        )
        for e in extreme
    )
    assert shared >= 6, [
        (s.summary.decode_worker, round(s.done_at - e.first_at, 3))
        for e in extreme
        for s in innocent
    ]


async def test_client_cancels_log_no_error(stack: UpStack, loaded: LoadedModel) -> None:
    logs = sorted(Path(stack.config.log_dir).glob("*.log"))
    assert {"gateway.log", "decode-0.log", "prefill-0.log"} <= {log.name for log in logs}
    offsets = {log: log.stat().st_size for log in logs}
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for index in range(CANCELS):
            call = stub.Generate(
                generate_request(
                    needle_ids(loaded, 64, 950 + index),
                    max_tokens=400,
                    detokenize=False,
                    request_id=f"e2e-cancel-{index}",
                ),
                timeout=60,
            )
            for _ in range(3):
                assert (await call.read()).HasField("token")
            call.cancel()
        # The next request on the same gateway completes: the cancels left nothing behind.
        done = [
            e
            async for e in stub.Generate(
                generate_request(needle_ids(loaded, 48, 960), max_tokens=4, detokenize=False),
                timeout=60,
            )
        ]
        assert done[-1].HasField("summary")
    await asyncio.sleep(1.0)  # a generator finalised elsewhere would be logged by now (next GC)
    new = {log.name: _read_from(log, offsets[log]) for log in logs}
    assert {name: _errors(text) for name, text in new.items() if _errors(text)} == {}


def _read_from(log: Path, offset: int) -> str:
    with log.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def _errors(text: str) -> list[str]:
    return [
        line[:200] for line in text.splitlines() if " ERROR " in line or "different Context" in line
    ]
