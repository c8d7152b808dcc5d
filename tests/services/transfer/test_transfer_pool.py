"""Pair-group bookkeeping in one process: bounds, LRU and idle eviction, reservations, and
the receiver's checks before it joins a group. No peer ever connects here."""

from __future__ import annotations

import hashlib

import pytest
import torch

from services.transfer import (
    Deadline,
    KVReceiver,
    KVSender,
    PairGroupConfig,
    PairGroupsExhausted,
    PairRoute,
    PeerLost,
    TransferDescriptor,
    TransferKey,
    TransferMismatch,
    TransferTimeout,
    ViewLayout,
)
from services.transfer.pairgroup import GroupId, PairGroup, PairGroupPool, backend_for, wire_tag

KEY = TransferKey("req-1", 1, 1, "t-1")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _group(epoch: int, sender: str = "prefill-0") -> PairGroup:
    return PairGroup(GroupId(sender, "gloo", epoch), 0, "127.0.0.1:1", torch.device("cpu"), "127.0.0.1", "5" * 64)


def _pool(max_groups: int = 2, idle_timeout_s: float = 10.0) -> tuple[PairGroupPool, FakeClock, list[GroupId]]:
    clock, closed = FakeClock(), []
    config = PairGroupConfig(max_groups=max_groups, idle_timeout_s=idle_timeout_s)
    return PairGroupPool(config, on_close=lambda g: closed.append(g.id), clock=clock), clock, closed


def test_least_recently_used_idle_group_makes_room() -> None:
    pool, clock, closed = _pool(max_groups=2)
    first, second, third = _group(1), _group(2), _group(3)
    pool.admit(first, KEY)
    clock.now = 1.0
    pool.admit(second, KEY)
    pool.release(second)  # idle since t=1
    clock.now = 2.0
    pool.release(first)  # idle since t=2: more recently used than `second`
    pool.admit(third, KEY)
    assert closed == [second.id]
    assert second.closed_reason is not None and "least recently used" in second.closed_reason
    assert set(pool.group_ids()) == {first.id, third.id}
    assert pool.was_closed(second.id) and not pool.was_closed(first.id)


def test_busy_groups_are_never_evicted() -> None:
    pool, _, closed = _pool(max_groups=2)
    pool.admit(_group(1), KEY)
    pool.admit(_group(2), KEY)
    with pytest.raises(PairGroupsExhausted) as caught:
        pool.admit(_group(3), KEY)
    assert caught.value.key == KEY
    assert closed == [] and len(pool.group_ids()) == 2


def test_idle_groups_close_after_the_timeout() -> None:
    pool, clock, closed = _pool(idle_timeout_s=5.0)
    idle, busy = _group(1), _group(2)
    pool.admit(idle, KEY)
    pool.admit(busy, KEY)
    pool.release(idle)
    clock.now = 5.0
    assert pool.sweep() == []
    clock.now = 5.5
    assert pool.sweep() == [idle.id]
    assert closed == [idle.id] and pool.group_ids() == [busy.id]


def test_take_idle_hands_out_a_group_exclusively() -> None:
    pool, clock, _ = _pool(max_groups=3)
    older, newer = _group(1), _group(2)
    for group in (older, newer):
        pool.admit(group, KEY)
        clock.now += 1
        pool.release(group)
    assert pool.take_idle(lambda g: True) is newer
    assert pool.take_idle(lambda g: True) is older
    assert pool.take_idle(lambda g: True) is None


def test_sender_reservations_respect_the_bound() -> None:
    sender = KVSender("prefill-0", PairGroupConfig(max_groups=1))
    deadline = Deadline.after(5)
    lease = sender.reserve(KEY, "127.0.0.1:1", "cpu", deadline)
    assert lease.route.backend == "gloo" and lease.route.store_address == "127.0.0.1:1"
    with pytest.raises(PairGroupsExhausted):
        sender.reserve(KEY, "127.0.0.1:1", "cpu", deadline)
    sender.cancel(lease, "not used")
    assert sender.group_ids() == []
    again = sender.reserve(KEY, "127.0.0.1:1", "cpu", deadline)
    assert again.route.epoch != lease.route.epoch
    sender.close()


def test_backend_follows_the_device_and_tags_are_distinct() -> None:
    assert backend_for("cpu") == "gloo"
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    tags = {wire_tag(layer, field) for layer in range(64) for field in range(4)}
    assert len(tags) == 256


@pytest.fixture
def receiver() -> KVReceiver:
    receiver = KVReceiver(PairGroupConfig())
    yield receiver  # type: ignore[misc]
    receiver.close()


def _descriptor(route: PairRoute) -> TransferDescriptor:
    return TransferDescriptor(
        transfer_id=KEY.transfer_id,
        request_id=KEY.request_id,
        request_generation=KEY.request_generation,
        state_generation=KEY.state_generation,
        cache_generation=0,
        receipt_digest=hashlib.sha256(b"r").hexdigest(),
        source_worker="prefill-0",
        route=route,
        layout=ViewLayout((2, 3), 2, 4, torch.float32, torch.float32),
    )


def test_receiver_refuses_routes_it_cannot_serve(receiver: KVReceiver) -> None:
    elsewhere = _descriptor(PairRoute("127.0.0.2:1", "gloo", 7, "5" * 64))
    with pytest.raises(TransferMismatch) as caught:
        receiver.start_recv(elsewhere, Deadline.after(1))
    assert caught.value.field == "rendezvous_address"
    on_gpu = _descriptor(PairRoute(receiver.address, "nccl", 7, "5" * 64))
    with pytest.raises(TransferMismatch) as caught:
        receiver.start_recv(on_gpu, Deadline.after(1))
    assert caught.value.field == "rendezvous_address.backend"
    assert receiver.group_ids() == []


def test_receiver_never_rejoins_a_group_it_closed(receiver: KVReceiver) -> None:
    descriptor = _descriptor(PairRoute(receiver.address, "gloo", 7, "5" * 64))
    transfer = receiver.start_recv(descriptor, Deadline.after(0.5))
    assert [g.epoch for g in receiver.group_ids()] == [7]
    with pytest.raises(TransferTimeout) as caught:  # no sender ever joins
        transfer.wait_for_layer(0, Deadline.after(0.2))
    assert caught.value.key == KEY
    assert receiver.group_ids() == []
    with pytest.raises(PeerLost, match="already closed"):
        receiver.start_recv(descriptor, Deadline.after(1))
