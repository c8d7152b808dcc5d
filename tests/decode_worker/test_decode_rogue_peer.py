"""A stranger (a real process) who reaches the rendezvous store and knows everything in a
descriptor except its pair-group secret joins the group and tries to feed tensors: the
decode worker rejects the transfer before receiving any of them, releases the reservation
and the pair group, and the legitimate transfer that follows still works."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from multiprocessing.connection import Connection

import grpc
import pytest
import torch

from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2
from services.transfer import KVSender

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 8.0
PEER_START_S = 60.0
CALL_S = 30.0


def _rogue(conn: Connection, address: str, source_worker: str, epoch: int) -> None:
    """Join pair group (source_worker, gloo, epoch) at `address` as the sender with a key of its
    own, answer the handshake with it, then post the first layer's messages regardless."""
    import torch.distributed as dist

    from services.transfer.deadline import Deadline
    from services.transfer.pairgroup import (
        _NONCE_TAG,
        _PROOF_TAG,
        SENDER_RANK,
        GroupId,
        PairGroup,
        _connect,
        connect_store,
        new_secret,
        wire_tag,
    )

    torch.set_num_threads(1)
    conn.send("ready")
    conn.recv()  # the transfer was accepted
    deadline = Deadline.after(DEADLINE_S)
    group = PairGroup(GroupId(source_worker, "gloo", epoch), SENDER_RANK, address, torch.device("cpu"),
                      "127.0.0.1", new_secret())
    backend = _connect(dist.PrefixStore(group.id.prefix, connect_store(address, deadline)), SENDER_RANK,
                       group, deadline)
    nonce = torch.zeros(32, dtype=torch.uint8)
    backend.send([torch.ones(32, dtype=torch.uint8)], 1, _NONCE_TAG).wait(deadline.timedelta())
    backend.recv([nonce], 1, _NONCE_TAG).wait(deadline.timedelta())
    # Held so the forged sends stay posted while the decode worker decides.
    forged = [backend.send([torch.full((32,), 7, dtype=torch.uint8)], 1, _PROOF_TAG)]
    forged += [backend.send([torch.full((64,), 1e9)], 1, wire_tag(0, field)) for field in range(4)]
    conn.send("joined and sent")
    conn.recv()  # the test ends the process here


async def test_a_stranger_without_the_secret_cannot_feed_a_transfer(stub, worker, policy, loaded, manifests):
    from decode_helpers import describe, prompt_ids, run_prefill, send_all
    from test_decode_service import begin_and_publish

    prefilled = run_prefill(loaded, prompt_ids(12, seed=3))
    packed = await begin_and_publish(policy, manifests["full"], prefilled, "req-rogue")
    sender = KVSender("prefill-honest")
    # The deadline is long enough for a loaded machine: the rejection must come before it.
    victim = await asyncio.to_thread(describe, packed, sender, worker.rendezvous_address, deadline_s=3 * DEADLINE_S)
    route = victim.descriptor.route
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    args = (child_conn, worker.rendezvous_address, sender.worker_id, route.epoch)
    child = ctx.Process(target=_rogue, args=args, daemon=True)
    budget = worker.servicer.scheduler.budget
    try:
        child.start()
        assert await asyncio.to_thread(conn.poll, PEER_START_S), "the rogue did not start"
        assert conn.recv() == "ready"
        response = await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=victim.message), timeout=CALL_S)
        assert response.accepted and budget.used_bytes == response.reserved_bytes > 0
        conn.send("go")
        error = await _stream_error(stub, victim)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error_detail(error).reason == common_pb2.ERROR_REASON_TRANSFER_FAILED
        assert "secret" in error.details()
        assert worker.servicer.rejections == {"TransferFailed:transfer": 1}
        assert budget.used_bytes == 0 and worker.servicer.receiver.group_ids() == []
        assert await asyncio.to_thread(conn.poll, PEER_START_S), "the rogue never joined"
        assert conn.recv() == "joined and sent"
    finally:
        sender.cancel(victim.lease, "test over")
        if child.is_alive():
            child.kill()
        child.join(10)

    honest = await asyncio.to_thread(describe, packed, sender, worker.rendezvous_address)
    await asyncio.to_thread(honest.start)
    response = await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=honest.message), timeout=CALL_S)
    assert response.accepted
    await asyncio.to_thread(send_all, honest, packed.view)
    events = [event async for event in stub.StreamTokens(_stream_request(honest), timeout=CALL_S)]
    assert events[-1].HasField("summary") and sum(e.HasField("token") for e in events) > 0
    assert budget.used_bytes == 0
    sender.close()


def _stream_request(sent) -> decode_pb2.StreamTokensRequest:
    key = sent.descriptor.key
    return decode_pb2.StreamTokensRequest(
        request_id=key.request_id, request_generation=key.request_generation, transfer_id=key.transfer_id
    )


async def _stream_error(stub, sent) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in stub.StreamTokens(_stream_request(sent), timeout=CALL_S):
            pass
    return error.value
