"""Two prefill and two decode workers under 32 concurrent requests: every request completes
or fails with a clear status (nothing hangs: each call has a deadline that a hang would
exceed), the load spreads over all four workers, and continuous batching on the decode
workers changes no greedy output."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from e2e_helpers import UpStack, needle_ids

from services.gateway.client import generate_request
from services.model import LoadedModel, generate
from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(240)

REQUESTS = 32
POLICIES = ("full", "snapkv", "snapkv-pyramid", "snapkv-adakv")
# The one clear refusal under load when no worker dies: a full prefill queue.
CLEAR = {grpc.StatusCode.RESOURCE_EXHAUSTED}


async def one(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateEvent] | grpc.aio.AioRpcError:
    try:
        return [event async for event in stub.Generate(request, timeout=150)]
    except grpc.aio.AioRpcError as exc:
        return exc


async def test_32_concurrent_requests_complete_or_fail_clearly(stack: UpStack, loaded: LoadedModel) -> None:
    prompts = [needle_ids(loaded, 48 + 24 * (i % 6), 300 + i) for i in range(REQUESTS)]
    requests = [
        generate_request(prompt, policy=POLICIES[i % len(POLICIES)], max_tokens=6 + i % 5, detokenize=False,
                         request_id=f"e2e-load-{i}")
        for i, prompt in enumerate(prompts)
    ]
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        outcomes = await asyncio.wait_for(asyncio.gather(*(one(stub, r) for r in requests)), timeout=200)

    failures = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    for failure in failures:
        assert failure.code() in CLEAR, (failure.code(), failure.details())
        assert error_detail(failure) is not None, failure.details()
    completed = {i: o for i, o in enumerate(outcomes) if not isinstance(o, grpc.aio.AioRpcError)}
    assert len(completed) >= REQUESTS // 2, [f.details() for f in failures]
    summaries = [events[-1].summary for events in completed.values()]
    assert all(s.request_id.startswith("e2e-load-") and s.output_tokens >= 1 for s in summaries)
    assert {s.decode_worker for s in summaries} == set(stack.decode_addresses)
    assert len({s.prefill_worker for s in summaries}) == 2

    for index, events in completed.items():
        if POLICIES[index % len(POLICIES)] == "full":
            tokens = [e.token.token_id for e in events[:-1]]
            assert tokens == generate(loaded, prompts[index], max_new_tokens=6 + index % 5), index
