"""The rendezvous store listens only on the worker's host, and a pair group is usable only
once both ranks proved they hold its secret (in-process gloo groups over loopback)."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket

import psutil
import pytest
from test_transfer_pairs import check_symbolic, describe, key_of, symbolic_view

from services.transfer import (
    Deadline,
    KVReceiver,
    KVSender,
    PairGroupConfig,
    PeerUnauthenticated,
    TransferMismatch,
    layer_of,
)
from services.transfer.pairgroup import new_secret

pytestmark = pytest.mark.timeout(60)
DEADLINE_S = 10.0


@pytest.fixture
def receiver():
    kv_receiver = KVReceiver(PairGroupConfig(bind_host="127.0.0.1"))
    yield kv_receiver
    kv_receiver.close()


@pytest.fixture
def sender():
    kv_sender = KVSender("prefill-auth")
    yield kv_sender
    kv_sender.close()


def _listening(port: int) -> set[str]:
    """The local addresses this process listens on at `port`."""
    connections = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return str(address.address)
    return None


def _transfer(sender: KVSender, receiver: KVReceiver, transfer_id: str, secret: str | None = None):
    """Send the symbolic view; `secret` replaces the descriptor's pair-group key (a forgery)."""
    view = symbolic_view()
    deadline = Deadline.after(DEADLINE_S)
    lease = sender.reserve(key_of(transfer_id), receiver.address, "cpu", deadline)
    descriptor = describe(view, sender, lease.route, transfer_id)
    sending = sender.start_send(descriptor, lease, deadline)
    for layer in range(view.num_layers):
        sending.send_layer(layer_of(view, layer))
    if secret is not None:
        descriptor = dataclasses.replace(descriptor, route=dataclasses.replace(descriptor.route, secret=secret))
    return sending, receiver.start_recv(descriptor, deadline), deadline


def test_store_and_gloo_listen_only_on_the_configured_host(sender: KVSender, receiver: KVReceiver) -> None:
    port = int(receiver.address.rpartition(":")[2])
    assert _listening(port) == {"127.0.0.1"}
    other = _non_loopback_ipv4()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to probe the store from")
    with pytest.raises(OSError):
        socket.create_connection((other, port), timeout=2.0).close()
    sending, receiving, deadline = _transfer(sender, receiver, "bind")
    check_symbolic(receiving.wait_for_view(deadline))
    sending.wait_for_send(deadline)
    # Every socket this process listens on (the store's and gloo's) is on loopback.
    listening = {c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert listening == {"127.0.0.1"}


def test_a_receiver_with_another_key_is_refused_by_both_ranks(sender: KVSender, receiver: KVReceiver) -> None:
    sending, receiving, deadline = _transfer(sender, receiver, "forged", secret=new_secret())
    with pytest.raises(PeerUnauthenticated, match="secret"):
        receiving.wait_for_view(deadline)
    with pytest.raises(PeerUnauthenticated, match="secret"):
        sending.wait_for_send(deadline)
    assert receiver.group_ids() == [] and sender.group_ids() == []
    # The next transfer, on a fresh group, goes through.
    sending, receiving, deadline = _transfer(sender, receiver, "honest")
    check_symbolic(receiving.wait_for_view(deadline))
    assert sending.wait_for_send(deadline) > 0


def test_a_reused_group_refuses_a_descriptor_with_another_key(sender: KVSender, receiver: KVReceiver) -> None:
    sending, receiving, deadline = _transfer(sender, receiver, "first")
    receiving.wait_for_view(deadline)
    sending.wait_for_send(deadline)
    (group_id,) = receiver.group_ids()
    with pytest.raises(TransferMismatch) as caught:
        _transfer(sender, receiver, "second", secret=new_secret())
    assert caught.value.field == "rendezvous_secret"
    assert receiver.group_ids() == [group_id]  # refused, not torn down
