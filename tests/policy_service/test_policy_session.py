"""PolicyService.Session: the per-request calls multiplexed on one stream, against a real policy
service on a real redis-server. Each call must end exactly as its unary twin does (value, typed
error, field), bounded by its own deadline, without touching the other calls on the stream;
a draining service ends its streams at once; a client of a service without Session falls back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from policy_helpers import lifecycle, publication, service_config

from policy_service.server import PolicyServer
from policy_service.service import PolicyServicer
from policy_service.session import Sessions
from services.policy import (
    NotFound,
    PolicyClient,
    PolicyClientConfig,
    PolicyUnavailable,
)
from services.redis_embedded import EmbeddedRedis
from services.rpc.kvrelay.v1 import policy_pb2, policy_pb2_grpc
from services.rpc.server import ServerConfig, ServiceBinding, start_server
from services.telemetry.metrics import RPC_REQUESTS

CALLS = 200


def served(method: str, code: str) -> float:
    return RPC_REQUESTS.labels(f"/kvrelay.v1.PolicyService/{method}", code)._value.get()  # type: ignore[no-any-return]


async def test_every_call_ends_in_a_session_as_its_unary_twin_does(policy_server: PolicyServer, snapkv_sha: str) -> None:
    before = served("PublishState", "OK"), served("PublishState", "FAILED_PRECONDITION")
    address = policy_server.address
    async with PolicyClient(PolicyClientConfig(address, timeout_s=5.0, session_streams=1)) as session, \
            PolicyClient(PolicyClientConfig(address, timeout_s=5.0, session_streams=0)) as unary:
        assert session._sessions is not None and unary._sessions is None
        over_session = await lifecycle(session, "twin-session", snapkv_sha)
        assert session._sessions is not None  # never fell back
        over_unary = await lifecycle(unary, "twin-unary", snapkv_sha)
    assert over_session == over_unary
    # Counted under the method's own name, with its own status, on both paths.
    assert served("PublishState", "OK") - before[0] == 2 * 2
    assert served("PublishState", "FAILED_PRECONDITION") - before[1] == 2 * 3


@pytest.mark.parametrize("framed", [False, True], ids=["grpc", "framed"])
async def test_many_calls_on_one_stream_each_get_their_own_answer(
    policy_server: PolicyServer, snapkv_sha: str, framed: bool,
) -> None:
    config = PolicyClientConfig(policy_server.address, timeout_s=20.0, session_streams=1,
                                session_target=policy_server.session_address if framed else "")
    async with PolicyClient(config) as client:
        fences = await asyncio.gather(*(client.begin_request(f"many-{i}") for i in range(CALLS)))
        published = await asyncio.gather(*(
            client.publish_state(publication(f.request_id, f.request_generation, 0, snapkv_sha)) for f in fences))
        read = await asyncio.gather(*(client.get_fence(f"many-{i}") for i in range(CALLS)),
                                    client.get_fence("many-none"), return_exceptions=True)
    assert [p.fence.request_id for p in published] == [f"many-{i}" for i in range(CALLS)]
    assert all(p.fence.state_generation == 1 and not p.already_published for p in published)
    assert [f.request_id for f in read[:CALLS]] == [f"many-{i}" for i in range(CALLS)]  # type: ignore[union-attr]
    assert isinstance(read[CALLS], NotFound)  # one call's error is its own


async def test_streams_are_replaced_without_losing_or_repeating_a_call(policy_server: PolicyServer) -> None:
    """Streams live `session_max_age_s` (the first ones, opened before the channel was READY,
    `SETTLE_S`); a replaced one is half-closed after the calls written on it and the service
    answers those: every call succeeds at its first attempt (a retry would count twice)."""
    config = PolicyClientConfig(policy_server.address, timeout_s=5.0, session_streams=2, session_max_age_s=0.02)
    before = served("BeginRequest", "OK"), served("GetFence", "OK")
    calls, deadline = 0, time.monotonic() + 20.0
    async with PolicyClient(config) as client:
        assert client._sessions is not None

        async def loop(index: int) -> None:
            nonlocal calls
            for serial in range(60):
                fence = await client.begin_request(f"replaced-{index}-{serial}")
                assert (await client.get_fence(fence.request_id)).request_generation == fence.request_generation
                calls += 1
                await asyncio.sleep(0.01)

        await asyncio.wait_for(asyncio.gather(*(loop(i) for i in range(8))), deadline - time.monotonic())
        opened = client._sessions.opened
    assert calls == 8 * 60
    assert served("BeginRequest", "OK") - before[0] == calls  # none sent twice
    assert served("GetFence", "OK") - before[1] == calls
    assert opened > 2 * 4, opened  # the first two lived 0.5 s, the next 20 ms each (of >= 0.6 s)


async def raw_session(address: str, calls: list[policy_pb2.SessionCall]) -> list[policy_pb2.SessionReply]:
    async with grpc.aio.insecure_channel(address) as channel:
        stream = policy_pb2_grpc.PolicyServiceStub(channel).Session(iter(calls), timeout=10)
        return [reply async for reply in stream]


async def test_an_envelope_without_a_call_or_with_unknown_fields_is_refused_naming_the_field(
    policy_server: PolicyServer,
) -> None:
    fence = policy_pb2.SessionCall(call_id=2)
    fence.get_fence.request_id = "x"
    unknown = policy_pb2.SessionCall.FromString(fence.SerializeToString() + b"\xf8\x06\x01")  # #111: not in it
    wrong_type = policy_pb2.SessionCall(call_id=3)
    wrong_type.publish_state.ParseFromString(b"\x12\x01x")  # request_generation sent as a string
    replies = await raw_session(policy_server.address, [policy_pb2.SessionCall(call_id=1), unknown, wrong_type])
    by_id = {reply.call_id: reply for reply in replies}
    assert sorted(by_id) == [1, 2, 3]
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert (by_id[1].error.code, by_id[1].error.detail.field) == (invalid, "call")
    assert (by_id[2].error.code, by_id[2].error.detail.field) == (invalid, "#111")
    assert (by_id[3].error.code, by_id[3].error.detail.field) == (invalid, "request_generation")


async def test_a_call_past_its_deadline_ends_alone_and_the_others_are_answered(
    policy_server: PolicyServer, redis_server: EmbeddedRedis,
) -> None:
    from redis.asyncio import Redis

    async with PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0)) as client:
        await client.begin_request("deadline")
    short, long = policy_pb2.SessionCall(call_id=1, timeout_ms=100), policy_pb2.SessionCall(call_id=2, timeout_ms=5000)
    for call in (short, long):
        call.get_fence.request_id = "deadline"
    admin = Redis.from_url(redis_server.url)
    try:
        sleeping = asyncio.create_task(admin.execute_command("DEBUG", "SLEEP", "0.8"))
        await asyncio.sleep(0.1)  # Redis sleeps: no call can be answered before it wakes
        arrivals = await raw_session(policy_server.address, [short, long])
        await sleeping
    finally:
        await admin.aclose()
    # The service answers a call past its deadline with DEADLINE_EXCEEDED (once its Redis call
    # unwinds: redis-py closes the connection under a cancelled command); the client gave up at
    # the deadline itself (next test) and drops this reply.
    replies = {reply.call_id: reply for reply in arrivals}
    assert sorted(replies) == [1, 2]
    first, second = replies[1], replies[2]
    assert first.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert not second.HasField("error")
    assert second.get_fence.fence.request_id == "deadline"


@pytest.mark.parametrize("framed", [False, True], ids=["grpc", "framed"])
async def test_a_client_gives_up_at_its_deadline_and_calls_on(
    policy_server: PolicyServer, redis_server: EmbeddedRedis, framed: bool,
) -> None:
    from redis.asyncio import Redis

    admin = Redis.from_url(redis_server.url)
    config = PolicyClientConfig(policy_server.address, timeout_s=5.0, session_streams=1,
                                session_target=policy_server.session_address if framed else "")
    try:
        async with PolicyClient(config) as client:
            await client.begin_request("gives-up")
            sleeping = asyncio.create_task(admin.execute_command("DEBUG", "SLEEP", "0.6"))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            with pytest.raises(PolicyUnavailable, match="DEADLINE_EXCEEDED") as caught:
                await client.get_fence("gives-up", timeout_s=0.2)
            waited = time.monotonic() - started
            await sleeping
            fence = await client.get_fence("gives-up")
    finally:
        await admin.aclose()
    assert waited < 0.5, (caught.value, waited)
    assert fence.request_id == "gives-up"


async def test_a_stopping_service_ends_its_sessions_at_once(redis_server: EmbeddedRedis) -> None:
    config = service_config(redis_server.url, server=ServerConfig(port=0, shutdown_grace_s=5.0))
    server = await PolicyServer.start(config)
    stopped_in = None
    try:
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=2.0, session_streams=1)) as client:
            await client.begin_request("drain")
            started = time.monotonic()
            await server.stop()
            stopped_in = time.monotonic() - started
    finally:
        if stopped_in is None:
            await server.stop(0)
    # Without the drain the open stream would hold the server for its whole grace of 5 s.
    assert stopped_in < 2.0, stopped_in


async def test_sessions_drain_answers_what_it_read() -> None:
    gate = asyncio.Event()

    async def slow_fence(request: policy_pb2.GetFenceRequest) -> policy_pb2.GetFenceResponse:
        await gate.wait()
        return policy_pb2.GetFenceResponse()

    sessions = Sessions({"get_fence": ("GetFence", slow_fence)})
    queue: asyncio.Queue[policy_pb2.SessionCall] = asyncio.Queue()

    async def calls() -> AsyncIterator[policy_pb2.SessionCall]:
        while True:
            yield await queue.get()

    replies = sessions.serve(calls())
    first = policy_pb2.SessionCall(call_id=7)
    first.get_fence.request_id = "r"
    queue.put_nowait(first)
    next_reply = asyncio.ensure_future(anext(replies))
    await asyncio.sleep(0.05)
    sessions.drain()  # the reader stops; the call it read is still answered
    await asyncio.sleep(0.05)
    queue.put_nowait(policy_pb2.SessionCall(call_id=8))  # never read: never answered
    gate.set()
    reply = await asyncio.wait_for(next_reply, 5)
    assert reply.call_id == 7 and not reply.HasField("error")
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(replies), 5)


class _BeforeSessions(PolicyServicer):
    """The servicer as released before Session: the generated base answers UNIMPLEMENTED."""

    Session = policy_pb2_grpc.PolicyServiceServicer.Session  # type: ignore[assignment]


async def test_a_client_of_a_service_without_sessions_falls_back_to_unary_calls(
    redis_server: EmbeddedRedis, snapkv_sha: str, policy_server: PolicyServer,
) -> None:
    old = _BeforeSessions(policy_server.servicer.store, policy_server.config)
    binding = ServiceBinding("kvrelay.v1.PolicyService",
                             lambda server: policy_pb2_grpc.add_PolicyServiceServicer_to_server(old, server))
    server = await start_server(ServerConfig(port=0, shutdown_grace_s=0), [binding])
    try:
        async with PolicyClient(PolicyClientConfig(server.address, timeout_s=5.0)) as client:
            fence = await client.begin_request("fallback")
            assert client._sessions is None  # UNIMPLEMENTED once, unary from then on
            result = await client.publish_state(publication("fallback", fence.request_generation, 0, snapkv_sha))
    finally:
        await server.stop(0)
    assert result.fence.state_generation == 1


async def test_calls_of_a_closed_client_fail_instead_of_waiting(policy_server: PolicyServer) -> None:
    client = PolicyClient(PolicyClientConfig(policy_server.address, timeout_s=5.0, session_streams=1))
    await client.begin_request("closed")
    await client.close()
    started = time.monotonic()
    with pytest.raises(Exception, match="closed|CANCELLED"):
        await client.get_fence("closed")
    assert time.monotonic() - started < 1.0


async def test_a_client_that_stops_reading_replies_stops_being_read(monkeypatch: pytest.MonkeyPatch) -> None:
    import policy_service.session as session_module

    monkeypatch.setattr(session_module, "MAX_IN_FLIGHT", 4)

    async def fence(request: policy_pb2.GetFenceRequest) -> policy_pb2.GetFenceResponse:
        return policy_pb2.GetFenceResponse()

    read = 0

    async def calls() -> AsyncIterator[policy_pb2.SessionCall]:
        nonlocal read
        for call_id in range(1, 101):
            read += 1
            call = policy_pb2.SessionCall(call_id=call_id)
            call.get_fence.request_id = "r"
            yield call

    replies = Sessions({"get_fence": ("GetFence", fence)}).serve(calls())
    first = await asyncio.wait_for(anext(replies), 5)
    await asyncio.sleep(0.2)  # answers pile up unsent: the reader must stop
    assert first.call_id == 1 and read <= 4 + 2, read
    rest = [reply.call_id async for reply in replies]  # reading again drains every call
    assert sorted([first.call_id, *rest]) == list(range(1, 101))
