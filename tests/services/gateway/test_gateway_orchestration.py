"""The gateway's request flow against scripted prefill and decode workers over real gRPC
(and a real policy service): forwarding and summary, the retry rule before the first token,
UNAVAILABLE after it, deadlines on silent workers, client cancellation reaching both
workers and the policy service, admission (a bounded wait at the gateway, busy workers tried
again elsewhere), request ids claimed while in flight, and big prompts tokenized off the
event loop."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from policy_service.server import PolicyServer
from services.demo import needle
from services.gateway import DiscoveryConfig, GatewayConfig, WorkerSource
from services.gateway.server import GatewayServer
from services.policy import PolicyClient, PolicyClientConfig
from services.policy.types import Phase
from services.rpc.errors import (
    ERROR_DETAIL_KEY,
    ResourceExhausted,
    Unavailable,
    error_detail,
    maps_errors,
)
from services.rpc.kvrelay.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.rpc.server import RpcServer, ServerConfig, ServiceBinding, start_server

pytestmark = pytest.mark.timeout(60)

VOCAB = {word: index for index, word in enumerate(needle.vocabulary())}
TOKENS = (VOCAB["the"], VOCAB["code"], VOCAB["is"], VOCAB["."])
PROMPT = "what is the code of alice ? answer :"


async def forever(cancelled: asyncio.Event) -> None:
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        cancelled.set()
        raise


class ScriptedPrefill(prefill_pb2_grpc.PrefillWorkerServicer):
    """Answers Prefill per its plan: "ok", "transfer_failed" (as the real worker reports a
    failed handoff), "busy" (RESOURCE_EXHAUSTED, as the real worker's full queue answers),
    "slow" (ok after 0.2 s) or "hang" (until cancelled). The last plan entry repeats.
    `most_at_once` is the most calls it ever had running together."""

    def __init__(self, *plan: str) -> None:
        self.plan = list(plan)
        self.calls: list[prefill_pb2.PrefillRequest] = []
        self.cancelled = asyncio.Event()
        self.running = self.most_at_once = 0

    @maps_errors
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        try:
            return await self._answer(request, context)
        finally:
            self.running -= 1

    async def _answer(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        self.calls.append(request)
        action = self.plan.pop(0) if len(self.plan) > 1 else self.plan[0]
        if action == "busy":
            raise ResourceExhausted("1 prompts in flight and 0 queued; try another prefill worker")
        if action == "slow":
            await asyncio.sleep(0.2)
        if action == "transfer_failed":
            detail = common_pb2.ErrorDetail(reason=common_pb2.ERROR_REASON_TRANSFER_FAILED,
                                            message=f"decode worker {request.decode_worker_address}: peer lost")
            await context.abort(grpc.StatusCode.UNAVAILABLE, detail.message,
                                trailing_metadata=((ERROR_DETAIL_KEY, detail.SerializeToString()),))
        if action == "hang":
            await forever(self.cancelled)
        generations = common_pb2.Generations(request_generation=request.request_generation, state_generation=1)
        return prefill_pb2.PrefillResponse(
            receipt=common_pb2.Receipt(digest="d" * 64, manifest_sha256=request.manifest_sha256,
                                       generations=generations, retained_rows=40, omitted_rows=24),
            transfer=decode_pb2.TransferDescriptor(transfer_id=f"t{request.request_generation}",
                                                   first_token_id=TOKENS[0]),
            ledger=common_pb2.Ledger(full_payload_bytes=1000, visible_payload_bytes=600, bytes_moved=650),
            prefill_worker="prefill-scripted",
        )


class ScriptedDecode(decode_pb2_grpc.DecodeWorkerServicer):
    """Streams TOKENS and a summary per its plan: "ok", "fail_first" (before any event),
    "silent" (nothing, until cancelled), "fail_after_first", "hang_after_first",
    "pause_after_first" (the rest once `resume` is set), "linger_after_summary" (the stream
    ends 0.3 s after the summary; `ended` is set then) or "hang_after_summary" (until cancelled)."""

    def __init__(self, *plan: str) -> None:
        self.plan = list(plan)
        self.calls: list[decode_pb2.StreamTokensRequest] = []
        self.cancelled = asyncio.Event()
        self.resume = asyncio.Event()
        self.ended = asyncio.Event()

    @maps_errors
    async def StreamTokens(self, request: decode_pb2.StreamTokensRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.DecodeEvent]:
        self.calls.append(request)
        action = self.plan.pop(0) if len(self.plan) > 1 else self.plan[0]
        if action == "fail_first":
            raise Unavailable("receive failed: peer lost")
        if action == "silent":
            await forever(self.cancelled)
        yield decode_pb2.DecodeEvent(token=common_pb2.TokenEvent(token_id=TOKENS[0], index=0))
        if action == "fail_after_first":
            raise Unavailable("decode loop died")
        if action == "hang_after_first":
            await forever(self.cancelled)
        if action == "pause_after_first":
            await self.resume.wait()
        for index, token in enumerate(TOKENS[1:], start=1):
            yield decode_pb2.DecodeEvent(token=common_pb2.TokenEvent(token_id=token, index=index, logprob=-0.5))
        generations = common_pb2.Generations(request_generation=request.request_generation, state_generation=1,
                                             cache_generation=1 + len(TOKENS))
        yield decode_pb2.DecodeEvent(summary=decode_pb2.DecodeSummary(
            output_tokens=len(TOKENS), finish_reason=common_pb2.FINISH_REASON_LENGTH, generations=generations,
            ledger=common_pb2.Ledger(full_payload_bytes=1000, visible_payload_bytes=600, bytes_moved=650),
        ))
        if action == "linger_after_summary":
            try:
                await asyncio.sleep(0.3)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            self.ended.set()
        if action == "hang_after_summary":
            await forever(self.cancelled)


async def serve(name: str, register: Callable[[grpc.aio.Server], None]) -> RpcServer:
    return await start_server(ServerConfig(port=0, shutdown_grace_s=0), [ServiceBinding(name, register)])


@dataclass
class Deployment:
    gateway: GatewayServer
    prefill: ScriptedPrefill
    decodes: list[ScriptedDecode]
    decode_addresses: list[str]
    policy: PolicyClient
    stub: gateway_pb2_grpc.GatewayStub
    workers: list[RpcServer]
    prefill_addresses: list[str]


@pytest.fixture
async def deploy(policy_server: PolicyServer, served_checkpoint: Path) -> AsyncIterator[Callable[..., Awaitable[Deployment]]]:
    servers: list[RpcServer] = []
    closers: list[Callable[[], Awaitable[None]]] = []

    async def start(prefill: ScriptedPrefill, *decodes: ScriptedDecode, more_prefill: tuple[ScriptedPrefill, ...] = (),
                    checkpoint: Path | None = None, **overrides: object) -> Deployment:
        for p in (prefill, *more_prefill):
            servers.append(await serve("kvrelay.v1.PrefillWorker",
                                       lambda s, p=p: prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(p, s)))
        for decode in decodes:
            servers.append(await serve("kvrelay.v1.DecodeWorker",
                                       lambda s, d=decode: decode_pb2_grpc.add_DecodeWorkerServicer_to_server(d, s)))
        prefill_addresses = [server.address for server in servers[: 1 + len(more_prefill)]]
        decode_addresses = [server.address for server in servers[1 + len(more_prefill):]]
        settings: dict[str, object] = {"prefill_timeout_s": 10.0, "first_event_timeout_s": 2.0,
                                       "event_timeout_s": 5.0, **overrides}
        gateway = await GatewayServer.start(GatewayConfig(
            checkpoint=checkpoint or served_checkpoint,
            prefill_workers=WorkerSource(addresses=tuple(prefill_addresses)),
            decode_workers=WorkerSource(addresses=tuple(decode_addresses)),
            policy_address=policy_server.address,
            server=ServerConfig(port=0, shutdown_grace_s=0, readiness_interval_s=0.2, readiness_timeout_s=0.2),
            discovery=DiscoveryConfig(health_interval_s=0.2, health_timeout_s=0.5),
            **settings,  # type: ignore[arg-type]
        ))
        channel = grpc.aio.insecure_channel(gateway.address)
        policy = PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0))
        closers.extend([lambda: gateway.stop(0), channel.close, policy.close])
        # Each test starts from a gateway that has seen its workers healthy: on a loaded host the
        # first health round may miss a worker, and a test about admission must not race discovery.
        for _ in range(200):
            if await gateway_health(gateway.address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the gateway never reported SERVING: {gateway.address}")
        return Deployment(gateway, prefill, list(decodes), decode_addresses, policy,
                          gateway_pb2_grpc.GatewayStub(channel), servers, prefill_addresses)

    yield start
    for close in reversed(closers):
        await close()
    for server in servers:
        await server.stop(0)


def request(request_id: str, **fields: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id, text=PROMPT, detokenize=True, **fields)


async def collect(call: grpc.aio.UnaryStreamCall) -> tuple[list[common_pb2.TokenEvent], gateway_pb2.GenerateSummary | None]:
    tokens, summary = [], None
    async for event in call:
        if event.HasField("summary"):
            summary = event.summary
        else:
            tokens.append(event.token)
    return tokens, summary


async def ended_generation(policy: PolicyClient, request_id: str) -> int:
    """The request generation once the fence says ENDED (the gateway ends in the background)."""
    for _ in range(100):
        fence = await policy.get_fence(request_id)
        if fence.phase is Phase.ENDED:
            return fence.request_generation
        await asyncio.sleep(0.05)
    raise AssertionError(f"request {request_id} was never ended: {fence}")


async def test_tokens_are_forwarded_detokenized_then_summarized(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("ok"))
    tokens, summary = await collect(d.stub.Generate(request("happy-1")))
    assert [t.token_id for t in tokens] == list(TOKENS)
    assert "".join(t.text for t in tokens) == "the code is ."
    assert summary is not None
    sent = d.prefill.calls[0]
    assert sent.decode_worker_address == d.decode_addresses[0] and sent.sampling.max_tokens == 64
    assert list(sent.prompt_token_ids) == [VOCAB["<bos>"], *(VOCAB[w] for w in PROMPT.split())]
    assert (summary.request_id, summary.output_tokens, summary.prompt_tokens) == ("happy-1", 4, len(PROMPT.split()) + 1)
    assert summary.manifest_sha256 == sent.manifest_sha256  # the default policy, registered at start-up
    assert (summary.retained_rows, summary.omitted_rows, summary.bytes_moved) == (40, 24, 650)
    assert summary.finish_reason == common_pb2.FINISH_REASON_LENGTH and summary.ttft_ms > 0
    assert (summary.prefill_worker, summary.decode_worker) == ("prefill-scripted", d.decode_addresses[0])
    assert summary.generations.cache_generation == 5
    assert await ended_generation(d.policy, "happy-1") == sent.request_generation


async def test_ids_only_when_not_detokenizing(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("ok"))
    tokens, _ = await collect(d.stub.Generate(gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=[1, 5, 6]), detokenize=False)))
    assert [t.text for t in tokens] == [""] * 4
    assert d.prefill.calls[0].request_id.startswith("gen-")


@pytest.mark.parametrize(("prefill_plan", "first_decode_plan"), [
    (("ok",), "fail_first"),               # the decode stream fails before its first event
    (("transfer_failed", "ok"), "ok"),     # the prefill worker reports the transfer to D failed
    (("ok",), "silent"),                   # D sends nothing before the first-event deadline
])
async def test_failure_before_first_token_retries_on_the_other_decode_worker(
    deploy, prefill_plan: tuple[str, ...], first_decode_plan: str  # type: ignore[no-untyped-def]
) -> None:
    d = await deploy(ScriptedPrefill(*prefill_plan), ScriptedDecode(first_decode_plan), ScriptedDecode("ok"))
    tokens, summary = await collect(d.stub.Generate(request("retry-1")))
    assert [t.token_id for t in tokens] == list(TOKENS) and summary is not None
    first, second = d.prefill.calls
    assert [first.decode_worker_address, second.decode_worker_address] == d.decode_addresses
    assert second.request_generation > first.request_generation  # the failed attempt is fenced out
    assert [c.request_generation for c in d.decodes[1].calls] == [second.request_generation]
    assert summary.decode_worker == d.decode_addresses[1]
    assert summary.generations.request_generation == second.request_generation
    if first_decode_plan == "silent":
        await asyncio.wait_for(d.decodes[0].cancelled.wait(), 5)
    assert await ended_generation(d.policy, "retry-1") == second.request_generation


async def test_failure_after_first_token_ends_with_unavailable(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("fail_after_first"), ScriptedDecode("ok"))
    call = d.stub.Generate(request("late-1"))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for event in call:
            received.append(event)
    assert [e.token.token_id for e in received] == [TOKENS[0]]
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert d.decode_addresses[0] in caught.value.details()
    assert len(d.prefill.calls) == 1 and not d.decodes[1].calls
    # A failed request is ended (fenced) too: EndRequest is the gateway's alone.
    assert await ended_generation(d.policy, "late-1") == d.prefill.calls[0].request_generation


async def test_second_failure_is_reported_not_retried_again(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("fail_first"), ScriptedDecode("fail_first"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(d.stub.Generate(request("twice-1")))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "receive failed" in caught.value.details()
    assert len(d.prefill.calls) == 2
    detail = error_detail(caught.value)
    assert detail is not None and detail.reason == common_pb2.ERROR_REASON_BACKEND_UNAVAILABLE
    assert await ended_generation(d.policy, "twice-1") == d.prefill.calls[1].request_generation


async def test_cancel_during_prefill_reaches_the_prefill_worker(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("hang"), ScriptedDecode("ok"))
    call = d.stub.Generate(request("cancel-1"))
    for _ in range(200):
        if d.prefill.calls:
            break
        await asyncio.sleep(0.02)
    call.cancel()
    await asyncio.wait_for(d.prefill.cancelled.wait(), 5)
    assert await ended_generation(d.policy, "cancel-1") == d.prefill.calls[0].request_generation
    assert not d.decodes[0].calls


async def test_cancel_during_decode_reaches_the_decode_worker(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("hang_after_first"))
    call = d.stub.Generate(request("cancel-2"))
    first = await call.read()
    assert first.token.token_id == TOKENS[0]
    call.cancel()
    await asyncio.wait_for(d.decodes[0].cancelled.wait(), 5)
    await ended_generation(d.policy, "cancel-2")


async def test_a_summarized_stream_ends_on_its_own_and_is_not_cancelled(deploy) -> None:  # type: ignore[no-untyped-def]
    # The summary is not the end of the call: the worker's OK status follows it. A cancel sent
    # at once raced that status, and the decode worker counted a finished decode as CANCELLED.
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("linger_after_summary"))
    started = time.monotonic()
    tokens, summary = await collect(d.stub.Generate(request("settle-1")))
    assert summary is not None and len(tokens) == len(TOKENS)
    assert not d.decodes[0].ended.is_set(), "the client waited for the decode stream's end"
    await asyncio.wait_for(d.decodes[0].ended.wait(), 5)
    assert time.monotonic() - started >= 0.3 and not d.decodes[0].cancelled.is_set()


async def test_a_stream_left_open_after_its_summary_is_cancelled_at_the_event_deadline(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("hang_after_summary"), event_timeout_s=0.5)
    tokens, summary = await collect(d.stub.Generate(request("settle-2")))
    assert summary is not None and len(tokens) == len(TOKENS)
    await asyncio.wait_for(d.decodes[0].cancelled.wait(), 5)


async def test_invalid_input_and_unknown_policy_never_reach_a_worker(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("ok"))
    unknown = common_pb2.ManifestSelector(by_name=common_pb2.ManifestNameRef(name="no-such-policy"))
    for bad, field in [(request("bad-1", manifest=unknown), "manifest.by_name.name"),
                       (gateway_pb2.GenerateRequest(text=""), "text"),
                       (request("bad-2", sampling=common_pb2.SamplingParams(max_tokens=0)), "sampling.max_tokens")]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await collect(d.stub.Generate(bad))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        detail = error_detail(caught.value)
        assert detail is not None and detail.field == field
    assert not d.prefill.calls
    tokens, _ = await collect(d.stub.Generate(request("good-after-bad")))
    assert len(tokens) == 4


async def gateway_health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return reply.status


async def test_gateway_serves_only_while_each_role_has_a_healthy_worker(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("ok"))
    assert await gateway_health(d.gateway.address) == health_pb2.HealthCheckResponse.SERVING
    await d.workers[1].stop(0)  # the only decode worker
    for _ in range(100):
        if await gateway_health(d.gateway.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the gateway kept reporting SERVING without a decode worker")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(d.stub.Generate(request("no-decode-1")))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy decode worker" in caught.value.details()


async def test_a_stream_that_stops_mid_way_ends_at_the_inter_event_deadline(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("hang_after_first"), event_timeout_s=0.5)
    call = d.stub.Generate(request("idle-1"))
    assert (await call.read()).token.token_id == TOKENS[0]
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    assert time.monotonic() - started < 0.5 + 2.0
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"decode worker {d.decode_addresses[0]}: no token within 0.5 s" in (caught.value.details() or "")
    await asyncio.wait_for(d.decodes[0].cancelled.wait(), 5)  # the decode call was let go
    assert await ended_generation(d.policy, "idle-1") == d.prefill.calls[0].request_generation


async def test_a_reused_in_flight_request_id_is_refused_and_the_first_stream_finishes(deploy) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("pause_after_first", "ok"))
    first = d.stub.Generate(request("dup-1"))
    assert (await first.read()).token.token_id == TOKENS[0]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(d.stub.Generate(request("dup-1")))
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    detail = error_detail(caught.value)
    assert detail is not None and detail.field == "request_id" and "dup-1" in detail.message
    d.decodes[0].resume.set()
    rest = [await first.read() for _ in TOKENS]
    assert [e.token.token_id for e in rest[:-1]] == list(TOKENS[1:])
    assert rest[-1].summary.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await first.read() is grpc.aio.EOF
    assert await first.code() == grpc.StatusCode.OK
    assert len(d.prefill.calls) == 1  # the newcomer never began (and so never fenced the first out)
    assert await ended_generation(d.policy, "dup-1") == d.prefill.calls[0].request_generation
    tokens, _ = await collect(d.stub.Generate(request("dup-1")))  # once finished, the id is free again
    assert len(tokens) == len(TOKENS)


async def test_a_busy_prefill_worker_is_tried_again_elsewhere_without_using_a_retry(deploy) -> None:  # type: ignore[no-untyped-def]
    busy, free = ScriptedPrefill("busy"), ScriptedPrefill("ok")
    d = await deploy(busy, ScriptedDecode("ok"), more_prefill=(free,), max_retries=0)
    tokens, summary = await collect(d.stub.Generate(request("busy-1")))
    assert len(tokens) == len(TOKENS) and summary is not None
    assert (len(busy.calls), len(free.calls)) == (1, 1)  # listing order first, then the other one


async def test_the_only_busy_prefill_worker_is_asked_again_until_it_has_room(deploy) -> None:  # type: ignore[no-untyped-def]
    prefill = ScriptedPrefill("busy", "busy", "ok")
    d = await deploy(prefill, ScriptedDecode("ok"), max_retries=0)
    tokens, _ = await collect(d.stub.Generate(request("busy-2")))
    assert len(tokens) == len(TOKENS)
    generations = [call.request_generation for call in prefill.calls]
    assert len(generations) == 3 and generations == sorted(set(generations))


async def test_resource_exhausted_only_once_the_admission_wait_expires(deploy) -> None:  # type: ignore[no-untyped-def]
    prefill = ScriptedPrefill("busy")
    d = await deploy(prefill, ScriptedDecode("ok"), admission_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(d.stub.Generate(request("busy-3")))
    waited = time.monotonic() - started
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value.details()
    assert 0.5 <= waited < 3.0
    assert len(prefill.calls) >= 2  # asked again (with backoff) while the wait lasted
    assert await ended_generation(d.policy, "busy-3") == prefill.calls[-1].request_generation


async def test_a_burst_waits_its_turn_at_the_gateway(deploy) -> None:  # type: ignore[no-untyped-def]
    prefill = ScriptedPrefill("slow")
    d = await deploy(prefill, ScriptedDecode("ok"), prefill_max_outstanding=2)
    results = await asyncio.gather(*(collect(d.stub.Generate(request(f"burst-{i}"))) for i in range(8)))
    assert all(len(tokens) == len(TOKENS) and summary is not None for tokens, summary in results)
    assert (len(prefill.calls), prefill.most_at_once) == (8, 2)


async def test_the_wait_at_the_gateway_is_bounded(deploy) -> None:  # type: ignore[no-untyped-def]
    prefill = ScriptedPrefill("hang")
    d = await deploy(prefill, ScriptedDecode("ok"), prefill_max_outstanding=1, admission_timeout_s=0.3)
    holder = d.stub.Generate(request("holder-1"))
    for _ in range(200):
        if prefill.calls:
            break
        await asyncio.sleep(0.02)
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await collect(d.stub.Generate(request("waiter-1")))
    assert 0.3 <= time.monotonic() - started < 2.5
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "healthy prefill workers had 1 requests outstanding" in (caught.value.details() or "")
    assert len(prefill.calls) == 1  # the waiter never reached the worker
    holder.cancel()
    await ended_generation(d.policy, "waiter-1")


@pytest.fixture
def long_context_checkpoint(served_checkpoint: Path, tmp_path: Path) -> Path:
    """The served checkpoint with a 65536-token context: text up to 4 MB passes the size bound."""
    config = json.loads((served_checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 65536}))
    (tmp_path / "tokenizer.json").write_bytes((served_checkpoint / "tokenizer.json").read_bytes())
    return tmp_path


async def test_big_prompts_do_not_stall_an_unrelated_request(deploy, long_context_checkpoint: Path) -> None:  # type: ignore[no-untyped-def]
    d = await deploy(ScriptedPrefill("ok"), ScriptedDecode("ok"), checkpoint=long_context_checkpoint)
    rng = random.Random(0)
    words = needle.vocabulary()[4:]
    big = " ".join(rng.choice(words) for _ in range(300_000))  # ~1.5 MB: about a second to tokenize
    bigs = [asyncio.ensure_future(collect(d.stub.Generate(gateway_pb2.GenerateRequest(request_id=f"big-{i}", text=big))))
            for i in range(4)]
    latencies: list[float] = []
    try:
        while not all(task.done() for task in bigs) and len(latencies) < 500:
            started = time.monotonic()
            tokens, _ = await collect(d.stub.Generate(request(f"short-{len(latencies)}")))
            latencies.append(time.monotonic() - started)
            assert len(tokens) == len(TOKENS)
    finally:
        outcomes = await asyncio.gather(*bigs, return_exceptions=True)
    for outcome in outcomes:  # tokenized in full, then refused: 300k tokens do not fit 65535
        assert isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tokens exceeds the model maximum" in (outcome.details() or "")
    assert len(latencies) >= 3, latencies  # short requests were served while the big ones tokenized
    assert max(latencies) < 0.9, latencies  # below one big tokenization (~1 s)
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # beyond 65535 x 64 bytes: refused untokenized
        await collect(d.stub.Generate(gateway_pb2.GenerateRequest(text="é" * 2_100_000)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(caught.value)
    assert detail is not None and detail.field == "text" and "4200000 UTF-8 bytes" in detail.message
