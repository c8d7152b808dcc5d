"""A prefill worker (a real process) dies mid-transfer: the decode worker releases the
reservation and the pair group within the transfer's deadline, and the stream fails UNAVAILABLE."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection

import grpc
import pytest
import torch

from services.rpc.errors import error_detail
from services.rpc.kvrelay.v1 import common_pb2, decode_pb2

pytestmark = pytest.mark.timeout(120)
DEADLINE_S = 8.0
PEER_START_S = 60.0


def _doomed_sender(conn: Connection, rendezvous_address: str, deadline_s: float) -> None:
    """Send the descriptor and the first layer of a two-layer view, then wait to be killed."""
    from decode_helpers import OBS_WINDOW, describe, pack_state, synthetic_prefill

    from services.kvpolicy.manifest import DType, TensorContract, default_manifests
    from services.transfer import KVSender, layer_of

    torch.set_num_threads(1)
    contract = TensorContract(2, 4, 2, 16, DType.FLOAT32, DType.FLOAT32)
    manifest = default_manifests(contract, observation_window=OBS_WINDOW)["full"]
    packed = pack_state(manifest, synthetic_prefill(contract, 64, seed=1), "req-doomed")
    sent = describe(packed, KVSender("doomed-prefill"), rendezvous_address, deadline_s=deadline_s)
    transfer = sent.start()
    conn.send(sent.message.SerializeToString())
    conn.recv()  # AcceptTransfer answered
    sent.lease.group.wait_ready(sent.deadline, sent.descriptor.key)
    transfer.send_layer(layer_of(packed.view, 0))
    conn.send("layer 0 sent")
    conn.recv()  # the test kills this process here


async def test_sender_death_releases_the_reservation_within_the_deadline(stub, worker):
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_doomed_sender, args=(child_conn, worker.rendezvous_address, DEADLINE_S), daemon=True)
    child.start()
    try:
        assert await asyncio.to_thread(conn.poll, PEER_START_S), "sender process did not start"
        message = decode_pb2.TransferDescriptor.FromString(conn.recv())
        response = await stub.AcceptTransfer(decode_pb2.AcceptTransferRequest(descriptor=message), timeout=10)
        assert response.accepted
        budget = worker.servicer.scheduler.budget
        assert budget.used_bytes == response.reserved_bytes > 0
        request = decode_pb2.StreamTokensRequest(
            request_id=message.request_id, request_generation=message.receipt.generations.request_generation,
            transfer_id=message.transfer_id,
        )
        stream = asyncio.ensure_future(_first_event(stub, request))
        conn.send("accepted")
        assert await asyncio.to_thread(conn.poll, 30.0), "sender never sent layer 0"
        conn.recv()
        await asyncio.sleep(0.2)

        os.kill(child.pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline_left = message.deadline_unix_ms / 1000.0 - time.time()
        while budget.used_bytes:
            assert time.monotonic() - killed < deadline_left + 1.0, "reservation outlived the deadline"
            await asyncio.sleep(0.02)
        released_after = time.monotonic() - killed

        error = await asyncio.wait_for(stream, 10.0)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error_detail(error).reason == common_pb2.ERROR_REASON_TRANSFER_FAILED
        assert worker.servicer.rejections == {"TransferFailed:transfer": 1}
        assert worker.servicer.receiver.group_ids() == []
        assert released_after < deadline_left
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


async def _first_event(stub, request) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async for _ in stub.StreamTokens(request, timeout=30):
            pass
    return error.value
