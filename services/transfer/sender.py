"""Prefill side of a transfer: send a packed view, layer by layer, over a pair group.

    lease = sender.reserve(key, decode_store_address, device, deadline)
    descriptor = TransferDescriptor(..., source_worker=sender.worker_id, route=lease.route, ...)
    transfer = sender.start_send(descriptor, lease, deadline)
    decode_stub.AcceptTransfer(handoff_to_proto(handoff))     # control over gRPC
    for layer in range(L):
        transfer.send_layer(layer_of(view, layer))            # as soon as layer is packed
    transfer.send_sidecar(sidecar)                            # recallable manifests only
    transfer.wait_for_send(deadline)

`send_layer` never blocks: layers queue until the group is connected and then go out in
the background, so the decode side receives early layers while later ones are packed.
A failure tears the pair group down and raises a typed error carrying the transfer key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.transfer.deadline import Deadline
from services.transfer.descriptor import PairRoute, TransferDescriptor
from services.transfer.errors import PeerLost, TransferError, TransferKey, TransferMismatch
from services.transfer.layout import PackedLayer, check_layer
from services.transfer.pairgroup import (
    SENDER_RANK,
    GroupId,
    PairGroup,
    PairGroupConfig,
    PairGroupPool,
    backend_available,
    backend_for,
    connect_store,
    new_epoch,
    new_secret,
    wire_tag,
)
from services.transfer.sidecar import Sidecar, check_sidecar, sidecar_tag


@dataclass(frozen=True)
class PairLease:
    """A pair group reserved for one transfer; `route` goes into its descriptor."""

    route: PairRoute
    group: PairGroup


class KVSender:
    """A prefill worker's sending side: its pair groups to every decode worker it talks to."""

    def __init__(self, worker_id: str, config: PairGroupConfig | None = None) -> None:
        self.worker_id = worker_id
        self.config = config or PairGroupConfig()
        self._pool = PairGroupPool(self.config)
        self._stores: dict[str, dist.TCPStore] = {}
        self._store_lock = threading.Lock()

    def reserve(self, key: TransferKey, store_address: str, device: torch.device | str, deadline: Deadline) -> PairLease:
        """Hold a pair group to the decode worker at `store_address` for one transfer: an idle
        one the receiver still holds open, else a new one (a fresh epoch, connected later by
        `start_send`). Bounded by `deadline`; nothing is reserved if it raises."""
        backend = backend_for(device)
        if not backend_available(backend):
            raise TransferMismatch(key, "device", f"{backend} is not available on this worker")
        self._pool.sweep()
        while (group := self._pool.take_idle(lambda g: _matches(g, store_address, backend))) is not None:
            if self._still_open(group, key, deadline):
                return _lease(group)
            self._pool.discard(group, "the decode worker closed it")
        group = PairGroup(
            GroupId(self.worker_id, backend, new_epoch()),
            SENDER_RANK,
            store_address,
            torch.device(device),
            self.config.bind_host,
            new_secret(),  # drawn here, so it reaches the decode worker only in the descriptor
        )
        self._pool.admit(group, key)
        return _lease(group)

    def start_send(self, descriptor: TransferDescriptor, lease: PairLease, deadline: Deadline) -> SendTransfer:
        """Begin a transfer on a reserved group; connecting (if needed) runs in the background
        and gives up at `deadline`."""
        key = descriptor.key
        if descriptor.route != lease.route:
            self.cancel(lease, "descriptor names another pair group")
            raise TransferMismatch(key, "rendezvous_address", f"{descriptor.route} != reserved {lease.route}")
        if descriptor.source_worker != self.worker_id:
            self.cancel(lease, "descriptor names another sender")
            raise TransferMismatch(key, "source_worker", f"{descriptor.source_worker!r} != {self.worker_id!r}")
        lease.group.start_rendezvous(deadline)
        return SendTransfer(descriptor, lease.group, self._pool)

    def cancel(self, lease: PairLease, reason: str) -> None:
        """Give up a reservation that will not be used (e.g. AcceptTransfer was refused).
        The group may already have seen traffic, so it is closed, not reused."""
        self._pool.discard(lease.group, reason)

    def sweep(self) -> list[GroupId]:
        """Close idle groups past the idle timeout (also done on every `reserve`)."""
        return self._pool.sweep()

    def group_ids(self) -> list[GroupId]:
        return self._pool.group_ids()

    def close(self) -> None:
        self._pool.close_all("sender closed")

    def _still_open(self, group: PairGroup, key: TransferKey, deadline: Deadline) -> bool:
        try:
            store = self._store(group.store_address, deadline)
            store.set_timeout(deadline.timedelta())
            return store.check([group.id.open_key])
        except RuntimeError as exc:
            with self._store_lock:
                self._stores.pop(group.store_address, None)
            self._pool.discard(group, f"rendezvous store unreachable: {exc}")
            raise PeerLost(key, f"rendezvous store {group.store_address} unreachable: {exc}") from exc

    def _store(self, address: str, deadline: Deadline) -> dist.TCPStore:
        with self._store_lock:
            store = self._stores.get(address)
        if store is None:
            store = connect_store(address, deadline)
            with self._store_lock:
                self._stores[address] = store
        return store


class SendTransfer:
    """One packed view on its way out: `send_layer` per layer, then `wait_for_send`."""

    def __init__(self, descriptor: TransferDescriptor, group: PairGroup, pool: PairGroupPool) -> None:
        self.descriptor = descriptor
        self.bytes_moved = 0
        self._key = descriptor.key
        self._group = group
        self._pool = pool
        self._lock = threading.Lock()
        self._given: set[int] = set()
        self._sidecar_given = False
        self._queued: list[tuple[int, torch.Tensor]] = []  # (tag, tensor) not yet posted
        self._posted: list[tuple[dist.Work, torch.Tensor]] = []  # in send order
        self._error: TransferError | None = None
        self._finished = False
        group.when_ready(self._post_queued)

    def send_layer(self, layer: PackedLayer) -> None:
        """Queue one layer (checked against the descriptor); it goes out as soon as the pair
        group is connected. Never blocks on the network."""
        check_layer(self.descriptor.layout, layer, self._key)
        if layer.layer in self._given:
            raise TransferMismatch(self._key, "layer", f"layer {layer.layer} was already sent")
        device = layer.packed_k.device
        if device.type != self._group.device.type:
            raise TransferMismatch(self._key, "device", f"layer on {device}, pair group on {self._group.device}")
        # Metadata may live on the CPU; every message travels from the group's device.
        messages = [
            (wire_tag(layer.layer, field), tensor.to(self._group.device).contiguous())
            for field, tensor in enumerate(layer.wire_tensors())
            if tensor.numel() > 0  # the descriptor already says this message is empty
        ]
        self._given.add(layer.layer)
        with self._lock:
            self._queued.extend(messages)
        self._post_queued()

    def send_sidecar(self, sidecar: Sidecar) -> None:
        """Queue the page summaries (and host-tier rows) the descriptor announces after the
        last layer; like `send_layer`, never blocks on the network."""
        layout = self.descriptor.sidecar
        if layout is None:
            raise TransferMismatch(self._key, "sidecar", "the descriptor announces no sidecar")
        if self._sidecar_given:
            raise TransferMismatch(self._key, "sidecar", "was already sent")
        check_sidecar(layout, sidecar, self._key)
        messages = [
            (sidecar_tag(name), tensor.to(self._group.device).contiguous())
            for name, tensor in sidecar.tensors().items()
            if tensor.numel() > 0
        ]
        self._sidecar_given = True
        with self._lock:
            self._queued.extend(messages)
        self._post_queued()

    def wait_for_send(self, deadline: Deadline) -> int:
        """Block until every layer is out; returns the bytes moved. On any failure the pair
        group is torn down and a typed error is raised."""
        if self._finished:
            return self.bytes_moved
        try:
            self._group.wait_ready(deadline, self._key)
            missing = sorted(set(range(self.descriptor.layout.num_layers)) - self._given)
            if missing:
                raise TransferMismatch(self._key, "layer", f"layers {missing} were never sent")
            if self.descriptor.sidecar is not None and not self._sidecar_given:
                raise TransferMismatch(self._key, "sidecar", "was never sent")
            self._post_queued()
            if self._error is not None:
                raise self._error
            for work, tensor in self._posted:
                self._group.wait(work, deadline, self._key)
                self.bytes_moved += tensor.numel() * tensor.element_size()
        except TransferError as exc:
            self._finished = True
            self._pool.discard(self._group, str(exc))
            raise
        self._finished = True
        self._pool.release(self._group)
        return self.bytes_moved

    def cancel(self, reason: str) -> None:
        """Abandon the transfer before `wait_for_send`; the pair group is torn down."""
        if not self._finished:
            self._finished = True
            self._pool.discard(self._group, reason)

    def _post_queued(self) -> None:
        # Runs in the caller's thread or, once, in the rendezvous thread; the lock keeps
        # messages in send order.
        if not self._group.ready:
            return
        with self._lock:
            messages, self._queued = self._queued, []
            if self._error is not None:
                return
            try:
                for tag, tensor in messages:
                    self._posted.append((self._group.post_send(tensor, tag, self._key), tensor))
            except TransferError as exc:
                self._error = exc


def _lease(group: PairGroup) -> PairLease:
    route = PairRoute(group.store_address, group.id.backend, group.id.epoch, group.secret)
    return PairLease(route, group)


def _matches(group: PairGroup, store_address: str, backend: str) -> bool:
    return group.store_address == store_address and group.id.backend == backend
