"""Transfers between real processes over gloo pair groups on loopback.

The test process plays one side; spawned peer processes play the other and are driven over
a pipe, the way the gRPC control plane will drive them. Every wait is bounded.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from services.kvpolicy.ledger import build_ledger
from services.kvpolicy.manifest import DType, TensorContract
from services.kvpolicy.packing import PackedKVView, pack
from services.transfer import (
    Deadline,
    KVReceiver,
    KVSender,
    PairGroupConfig,
    PeerLost,
    TransferDescriptor,
    TransferError,
    TransferKey,
    TransferTimeout,
    ViewLayout,
    layer_of,
)
from services.transfer.codec import descriptor_from_proto, descriptor_to_proto
from services.transfer.descriptor import PairRoute

pytestmark = pytest.mark.timeout(90)

NUM_LAYERS, NUM_HEADS, SEQ_LEN, HEAD_DIM = 4, 3, 12, 4
# Ragged on purpose: segment lengths differ per (layer, head), one head and one whole
# layer retain nothing (the empty layer still sends its offsets).
SELECTED = [
    [[0, 3, 7, 11], [2], [1, 2, 5, 6, 9]],
    [[11], list(range(12)), [4, 8]],
    [[5, 6], [], [0, 10]],
    [[], [], []],
]
PEER_START_S = 60.0
REPLY_S = 30.0


def symbolic_view() -> PackedKVView:
    """K[l, h, t, c] = 1000 l + 100 h + 10 t + c and V = 5000 + K, packed by SELECTED."""
    shape = (NUM_LAYERS, NUM_HEADS, SEQ_LEN, HEAD_DIM)
    grid = torch.meshgrid(*(torch.arange(n) for n in shape), indexing="ij")
    source_k = (1000 * grid[0] + 100 * grid[1] + 10 * grid[2] + grid[3]).float()  # [L, H_kv, T, d_h]
    return pack(source_k, 5000 + source_k, SELECTED)


def ledger_traffic_bytes() -> int:
    contract = TensorContract(
        num_layers=NUM_LAYERS,
        num_q_heads=NUM_HEADS,
        num_kv_heads=NUM_HEADS,
        head_dim=HEAD_DIM,
        k_dtype=DType.FLOAT32,
        v_dtype=DType.FLOAT32,
    )
    return build_ledger(contract, SEQ_LEN, SELECTED).traffic_bytes


def key_of(transfer_id: str) -> TransferKey:
    return TransferKey(f"req-{transfer_id}", 3, 2, transfer_id)


def describe(view: PackedKVView, sender: KVSender, route: PairRoute, transfer_id: str) -> TransferDescriptor:
    key = key_of(transfer_id)
    return TransferDescriptor(
        transfer_id=transfer_id,
        request_id=key.request_id,
        request_generation=key.request_generation,
        state_generation=key.state_generation,
        cache_generation=1,
        receipt_digest=hashlib.sha256(transfer_id.encode()).hexdigest(),
        source_worker=sender.worker_id,
        route=route,
        layout=ViewLayout.of(view),
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )


def check_symbolic(view: PackedKVView) -> None:
    """Every received value equals the formula at its (layer, head, original position)."""
    assert view.selected_positions() == SELECTED
    channel = torch.arange(HEAD_DIM, dtype=torch.float32)  # [d_h]
    for layer in range(NUM_LAYERS):
        for head in range(NUM_HEADS):
            rows = view.rows(layer, head)
            positions = view.original_position_map[rows].float()  # [R_lh]
            expected_k = 1000 * layer + 100 * head + 10 * positions[:, None] + channel  # [R_lh, d_h]
            assert torch.equal(view.packed_k[rows], expected_k)
            assert torch.equal(view.packed_v[rows], 5000 + expected_k)


# --- peer processes ---------------------------------------------------------------------


def _sender_peer(conn: Connection, group_config: PairGroupConfig) -> None:
    """A prefill worker: one KVSender per worker id, sends the symbolic view on command."""
    torch.set_num_threads(1)
    senders: dict[str, KVSender] = {}
    view = symbolic_view()
    conn.send(("ready", os.getpid()))
    while True:
        command, args = conn.recv()
        if command == "stop":
            return
        if command == "groups":
            conn.send(("groups", {w: [g.epoch for g in s.group_ids()] for w, s in senders.items()}))
            continue
        sender = senders.setdefault(args["worker"], KVSender(args["worker"], group_config))
        conn.send(_send_symbolic(conn, sender, view, **args["send"]))


def _send_symbolic(
    conn: Connection, sender: KVSender, view: PackedKVView, address: str, transfer_id: str,
    deadline_s: float, pause_after: int | None = None,
) -> tuple[Any, ...]:
    deadline = Deadline.after(deadline_s)
    started = time.monotonic()
    try:
        lease = sender.reserve(key_of(transfer_id), address, "cpu", deadline)
        descriptor = describe(view, sender, lease.route, transfer_id)
        transfer = sender.start_send(descriptor, lease, deadline)
        conn.send(("descriptor", descriptor_to_proto(descriptor).SerializeToString()))
        for layer in range(view.num_layers):
            transfer.send_layer(layer_of(view, layer))
            if layer == pause_after:
                conn.send(("paused", layer))
                conn.recv()  # resume
        moved = transfer.wait_for_send(deadline)
    except TransferError as exc:
        groups = [g.epoch for g in sender.group_ids()]
        return ("error", type(exc).__name__, str(exc), time.monotonic() - started, groups)
    return ("sent", moved, lease.route.epoch)


def _receiver_peer(conn: Connection) -> None:
    """A decode worker that receives one view and stops after `pause_after` layers."""
    torch.set_num_threads(1)
    receiver = KVReceiver(PairGroupConfig())
    conn.send(("ready", receiver.address))
    command, args = conn.recv()
    if command == "stop":
        return
    transfer = receiver.start_recv(descriptor_from_proto(_descriptor_message(args["descriptor"])), Deadline.after(REPLY_S))
    for layer in range(args["pause_after"] + 1):
        transfer.wait_for_layer(layer, Deadline.after(REPLY_S))
    conn.send(("paused", args["pause_after"]))
    conn.recv()  # the test kills this process here


def _descriptor_message(data: bytes) -> Any:
    from services.rpc.kvrelay.v1 import decode_pb2

    return decode_pb2.TransferDescriptor.FromString(data)


@dataclass
class Peer:
    process: mp.process.BaseProcess
    conn: Connection
    hello: Any = None

    def send(self, command: str, **args: Any) -> None:
        self.conn.send((command, args))

    def expect(self, tag: str, timeout: float = REPLY_S) -> tuple[Any, ...]:
        assert self.conn.poll(timeout), f"peer sent nothing within {timeout}s (expected {tag!r})"
        reply = self.conn.recv()
        assert reply[0] == tag, f"expected {tag!r}, got {reply}"
        return reply

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(REPLY_S)
        assert self.process.exitcode == -signal.SIGKILL


def _spawn(target: Any, *args: Any) -> Peer:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    return Peer(process, parent)


@pytest.fixture(scope="module")
def peers() -> Any:
    """Start every peer at once so their (slow) interpreter start-ups overlap."""
    torch.set_num_threads(1)
    started = {
        "sender": _spawn(_sender_peer, PairGroupConfig()),
        "doomed_sender": _spawn(_sender_peer, PairGroupConfig()),
        "doomed_receiver": _spawn(_receiver_peer),
    }
    for peer in started.values():
        peer.hello = peer.expect("ready", PEER_START_S)[1]
    yield started
    for peer in started.values():
        if peer.process.is_alive():
            peer.send("stop")
            peer.process.join(5)
        if peer.process.is_alive():
            peer.process.kill()


@pytest.fixture
def receiver() -> Any:
    receiver = KVReceiver(PairGroupConfig())
    yield receiver
    receiver.close()


def _receive(receiver: KVReceiver, peer: Peer, deadline_s: float = 10.0) -> tuple[PackedKVView, TransferDescriptor, int]:
    descriptor = descriptor_from_proto(_descriptor_message(peer.expect("descriptor")[1]))
    transfer = receiver.start_recv(descriptor, Deadline.after(deadline_s))
    view = transfer.wait_for_view(Deadline.after(deadline_s))
    return view, descriptor, transfer.bytes_moved


def _send_args(address: str, transfer_id: str, deadline_s: float = 10.0, **extra: Any) -> dict[str, Any]:
    return {"address": address, "transfer_id": transfer_id, "deadline_s": deadline_s, **extra}


# --- tests ------------------------------------------------------------------------------


def test_ragged_view_arrives_layer_by_layer_with_every_value(peers: dict[str, Peer], receiver: KVReceiver) -> None:
    sender = peers["sender"]
    sender.send("send", worker="prefill-a", send=_send_args(receiver.address, "t-roundtrip", pause_after=0))
    descriptor = descriptor_from_proto(_descriptor_message(sender.expect("descriptor")[1]))
    transfer = receiver.start_recv(descriptor, Deadline.after(10))
    sender.expect("paused")
    # Layer 0 is usable while the sender has not even queued layer 1.
    first = transfer.wait_for_layer(0, Deadline.after(10))
    assert first.row_offsets.tolist() == [0, 4, 5, 10]
    assert first.original_position_map.tolist() == [0, 3, 7, 11, 2, 1, 2, 5, 6, 9]
    sender.send("resume")
    view = transfer.wait_for_view(Deadline.after(10))
    _, moved, _ = sender.expect("sent")

    check_symbolic(view)
    assert torch.equal(view.row_offsets, symbolic_view().row_offsets)
    assert descriptor.key.request_id == "req-t-roundtrip" and descriptor.state_generation == 2
    assert descriptor.trace_carrier()["traceparent"].startswith("00-0af7")
    assert moved == transfer.bytes_moved


def test_bytes_moved_equal_the_ledger_payload_plus_metadata(peers: dict[str, Peer], receiver: KVReceiver) -> None:
    sender = peers["sender"]
    sender.send("send", worker="prefill-a", send=_send_args(receiver.address, "t-bytes"))
    view, descriptor, received = _receive(receiver, sender)
    _, sent, _ = sender.expect("sent")
    expected = ledger_traffic_bytes()
    assert view.payload_bytes + view.metadata_bytes == expected
    assert sent == received == descriptor.layout.nbytes == expected


def test_transfers_reuse_one_pair_group(peers: dict[str, Peer], receiver: KVReceiver) -> None:
    sender = peers["sender"]
    epochs = []
    for index in range(4):
        sender.send("send", worker="prefill-reuse", send=_send_args(receiver.address, f"t-reuse-{index}"))
        view, _, _ = _receive(receiver, sender)
        epochs.append(sender.expect("sent")[2])
        check_symbolic(view)
    assert len(set(epochs)) == 1
    assert [g.epoch for g in receiver.group_ids()] == epochs[:1]


def test_least_recently_used_group_is_evicted_at_the_bound(peers: dict[str, Peer]) -> None:
    receiver = KVReceiver(PairGroupConfig(max_groups=2))
    try:
        sender = peers["sender"]
        epochs = {}
        for worker in ("prefill-e1", "prefill-e2", "prefill-e3"):
            sender.send("send", worker=worker, send=_send_args(receiver.address, f"t-{worker}"))
            _receive(receiver, sender)
            epochs[worker] = sender.expect("sent")[2]
            assert len(receiver.group_ids()) <= 2
        assert {g.sender for g in receiver.group_ids()} == {"prefill-e2", "prefill-e3"}
        # prefill-e1 still holds its side, sees the group closed, and builds a fresh one.
        sender.send("send", worker="prefill-e1", send=_send_args(receiver.address, "t-e1-again"))
        view, _, _ = _receive(receiver, sender)
        assert sender.expect("sent")[2] != epochs["prefill-e1"]
        check_symbolic(view)
        assert {g.sender for g in receiver.group_ids()} == {"prefill-e1", "prefill-e3"}
    finally:
        receiver.close()


def test_idle_group_is_closed_and_replaced(peers: dict[str, Peer]) -> None:
    receiver = KVReceiver(PairGroupConfig(idle_timeout_s=0.2))
    try:
        sender = peers["sender"]
        sender.send("send", worker="prefill-idle", send=_send_args(receiver.address, "t-idle-1"))
        _receive(receiver, sender)
        first_epoch = sender.expect("sent")[2]
        time.sleep(0.3)
        assert [g.epoch for g in receiver.sweep()] == [first_epoch]
        assert receiver.group_ids() == []
        sender.send("send", worker="prefill-idle", send=_send_args(receiver.address, "t-idle-2"))
        _receive(receiver, sender)
        assert sender.expect("sent")[2] != first_epoch
    finally:
        receiver.close()


def test_sender_killed_mid_transfer(peers: dict[str, Peer], receiver: KVReceiver) -> None:
    doomed = peers["doomed_sender"]
    doomed.send("send", worker="prefill-k", send=_send_args(receiver.address, "t-killed", pause_after=1))
    descriptor = descriptor_from_proto(_descriptor_message(doomed.expect("descriptor")[1]))
    transfer = receiver.start_recv(descriptor, Deadline.after(10))
    doomed.expect("paused")
    transfer.wait_for_layer(1, Deadline.after(10))
    doomed.kill()

    started = time.monotonic()
    with pytest.raises(PeerLost) as caught:
        transfer.wait_for_view(Deadline.after(5))
    assert time.monotonic() - started < 5.0
    assert caught.value.key == descriptor.key
    assert receiver.group_ids() == []

    # The prefill worker comes back under the same id: a fresh group, and it works.
    sender = peers["sender"]
    sender.send("send", worker="prefill-k", send=_send_args(receiver.address, "t-after-kill"))
    view, fresh, _ = _receive(receiver, sender)
    sender.expect("sent")
    assert fresh.route.epoch != descriptor.route.epoch
    check_symbolic(view)


def test_stalled_sender_times_out_and_both_sides_release(peers: dict[str, Peer], receiver: KVReceiver) -> None:
    sender = peers["sender"]
    sender.send("send", worker="prefill-stall", send=_send_args(receiver.address, "t-stall", pause_after=0))
    descriptor = descriptor_from_proto(_descriptor_message(sender.expect("descriptor")[1]))
    transfer = receiver.start_recv(descriptor, Deadline.after(10))
    sender.expect("paused")

    started = time.monotonic()
    with pytest.raises(TransferTimeout) as caught:
        transfer.wait_for_view(Deadline.after(1.0))
    assert 0.9 < time.monotonic() - started < 2.5
    assert caught.value.key == descriptor.key
    assert receiver.group_ids() == []

    sender.send("resume")
    _, kind, _, elapsed, groups_left = sender.expect("error")
    assert kind == "PeerLost" and elapsed < 10 and groups_left == []

    sender.send("send", worker="prefill-stall", send=_send_args(receiver.address, "t-after-stall"))
    view, fresh, _ = _receive(receiver, sender)
    sender.expect("sent")
    assert fresh.route.epoch != descriptor.route.epoch
    check_symbolic(view)


def test_receiver_killed_mid_transfer(peers: dict[str, Peer]) -> None:
    doomed = peers["doomed_receiver"]
    sender = KVSender("prefill-main")
    view = symbolic_view()
    deadline = Deadline.after(5)
    lease = sender.reserve(key_of("t-receiver-killed"), doomed.hello, "cpu", deadline)
    descriptor = describe(view, sender, lease.route, "t-receiver-killed")
    transfer = sender.start_send(descriptor, lease, deadline)
    doomed.send("recv", descriptor=descriptor_to_proto(descriptor).SerializeToString(), pause_after=0)
    transfer.send_layer(layer_of(view, 0))
    doomed.expect("paused")
    doomed.kill()
    for layer in range(1, view.num_layers):
        transfer.send_layer(layer_of(view, layer))

    with pytest.raises(PeerLost) as caught:
        transfer.wait_for_send(deadline)
    assert time.monotonic() < deadline.at
    assert caught.value.key == descriptor.key
    assert sender.group_ids() == []
    sender.close()
